"""The replay's forward (model.replay_forward): each distinct prefix of a prompt's completions
run once, as a node of a prefix tree, on the architectures whose attention allows it; one
padded row per distinct completion on the others. Either way every token's logits are what
the model computes on that completion alone, and the replay's verdicts are the same."""
import pytest
import torch

from volunteer_rl.model import replay_forward
from volunteer_rl.model.policy import encode_prompts, load_policy
from volunteer_rl.model.replay import replay, replay_scored, replays_in_training
from volunteer_rl.model.replay_forward import CALL_POSITIONS, by_length, replay_logits, tree_ok
from volunteer_rl.model.sampling import sample
from volunteer_rl.model.scoring import completion_logits
from volunteer_rl.model.tiny import build_tokenizer
from volunteer_rl.protocol.draws import group_keys
from volunteer_rl.task.calculator_generate import generate_problems

K, MAX_NEW, T = 6, 12, 0.1
TOL = 5e-5  # the trainer's default replay tolerance, in nats
ARCHS = ["llama", "qwen2", "qwen3", "gemma3", "gpt2"]


def small_config(arch: str, vocab: int):
    """A tiny random config of an architecture family: llama, qwen2 and qwen3 take the tree,
    gemma3 (sliding-window layers, a window shorter than its sequences here) and gpt2 do not."""
    from transformers import Gemma3TextConfig, GPT2Config, LlamaConfig, Qwen2Config, Qwen3Config

    # weights drawn wide enough that the policy is peaked: a prompt's completions share prefixes
    small = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                 initializer_range=0.2)
    return {"llama": lambda: LlamaConfig(**small),
            "qwen2": lambda: Qwen2Config(**small),
            "qwen3": lambda: Qwen3Config(**small, head_dim=8),
            "gemma3": lambda: Gemma3TextConfig(**small, head_dim=8, sliding_window=4),
            "gpt2": lambda: GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2, n_head=4,
                                       n_positions=128, initializer_range=0.2)}[arch]()


@pytest.fixture(scope="module")
def tokenizer():
    problems = generate_problems(200, seed=3)
    return build_tokenizer([p.prompt for p in problems] + [p.expression for p in problems],
                           vocab_size=300)


def saved_policy(arch: str, tokenizer, folder):
    """A tiny random `arch` model saved with save_pretrained and loaded as the trainer loads
    any model folder (load_policy)."""
    from transformers import AutoModelForCausalLM

    config = small_config(arch, len(tokenizer))
    config.pad_token_id, config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    config.bos_token_id = None
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return load_policy(folder)


@pytest.fixture(scope="module")
def policies(tokenizer, tmp_path_factory):
    return {arch: saved_policy(arch, tokenizer, tmp_path_factory.mktemp(arch))
            for arch in ARCHS}


def prompts_of(policy) -> list[list[int]]:
    """Prompts of different lengths, so the prompt pass left-pads: the two shortest and the two
    longest, which run apart (`by_length`)."""
    lengths = {}
    for p in encode_prompts(policy, [p.prompt for p in generate_problems(60, seed=4)]):
        lengths.setdefault(len(p), p)
    ordered = [lengths[n] for n in sorted(lengths)]
    return ordered[:2] + ordered[-2:]


def honest(policy, prompts) -> tuple[list[list[list[int]]], list[list[bytes]]]:
    """Honest completions and their keys, at a temperature low enough that a prompt's
    completions share prefixes."""
    keys = [group_keys("test-run", 1, "vol-1", g, g, K, "test-nonce") for g in range(len(prompts))]
    groups = sample(policy, prompts, K, T, MAX_NEW, draw_keys=keys)
    return [[s.token_ids for s in g] for g in groups], keys


def completions_of(policy, prompts) -> list[list[list[int]]]:
    """Honest completions and among them an exact repeat, a proper prefix of another, a
    one-token completion, and short completions that branch off one another (their tree fits
    in one row, so a row holds siblings)."""
    comps, _ = honest(policy, prompts)
    long = max(comps[0], key=len)
    assert len(long) >= 8
    comps[0][1] = list(long)
    comps[0][2] = long[:len(long) // 2]
    comps[1][3] = comps[1][3][:1]
    x, y = [t for t in range(3, 10) if t != long[2]][:2]
    comps[2] = [long[:4], long[:2] + [x] + long[3:6], long[:2] + [y, x], long[:3],
                long[:2] + [x], long[:2] + [y]]
    return comps


def common(a: list[int], b: list[int]) -> int:
    """The length of the common prefix of two completions."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def alone(policy, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """The logits that predict each token of `completion`: the model on that sequence alone,
    no padding, no cache."""
    ids = torch.tensor([prompt + completion])
    logits = policy.model(input_ids=ids).logits[0]
    return logits[len(prompt) - 1:len(prompt) + len(completion) - 1]


@pytest.mark.parametrize("arch", ARCHS)
def test_every_token_gets_the_logits_of_its_completion_alone(policies, arch):
    policy = policies[arch]
    assert_logits_of_each_alone(policy)
    assert tree_ok(policy) == (arch in ("llama", "qwen2", "qwen3"))


def test_an_eager_attention_model_takes_the_tree_with_an_additive_mask(policies, tokenizer,
                                                                       tmp_path):
    policy = saved_policy("llama", tokenizer, tmp_path / "eager")
    policy.model.set_attn_implementation("eager")
    assert tree_ok(policy)
    assert_logits_of_each_alone(policy)


def assert_logits_of_each_alone(policy) -> None:
    """replay_logits on prompts of two runs and completions_of's shapes: each completion's
    rows are the logits of that completion alone."""
    prompts = prompts_of(policy)
    assert len(by_length([len(p) for p in prompts])) == 2
    comps = completions_of(policy, prompts)
    with torch.inference_mode():
        logits, at = replay_logits(policy, prompts, comps)
        rows = [(p, c) for p, cs in zip(prompts, comps) for c in cs]
        assert len(at) == len(rows)
        for (prompt, completion), index in zip(rows, at):
            assert len(index) == len(completion)
            want = alone(policy, prompt, completion)
            assert (logits[index] - want).abs().max().item() < 1e-4


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_tree_runs_fewer_positions_than_a_row_per_completion(policies, arch, monkeypatch):
    """Shared prefixes are run once: the forward passes take fewer input positions than one
    padded row per distinct completion does."""
    policy = policies[arch]
    prompts = prompts_of(policy)
    comps = completions_of(policy, prompts)
    seen = []
    hook = policy.model.get_input_embeddings().register_forward_hook(
        lambda module, args, out: seen.append(args[0].numel()))
    try:
        with torch.inference_mode():
            replay_logits(policy, prompts, comps)
            tree = sum(seen)
            seen.clear()
            monkeypatch.setattr(replay_forward, "tree_ok", lambda policy: False)
            replay_logits(policy, prompts, comps)
            padded = sum(seen)
    finally:
        hook.remove()
    assert tree < padded


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_verdicts_are_the_same_as_a_row_per_completion_and_a_forged_token_is_caught(
        policies, arch, monkeypatch):
    """Honest completions pass on both forwards with the same margins, tokens and logprobs; a
    token swapped in a completion that shares its prefix with others fails where it was
    swapped, and its siblings still pass."""
    policy = policies[arch]
    prompts = prompts_of(policy)
    comps, keys, forged, shared = with_a_forgery(policy, prompts)
    tree = replay(policy, prompts, comps, keys, T)
    monkeypatch.setattr(replay_forward, "tree_ok", lambda policy: False)
    padded = replay(policy, prompts, comps, keys, T)
    assert_same_verdicts(tree, padded, forged, shared)


def with_a_forgery(policy, prompts):
    """Honest completions and keys, one of them forged: in a completion that shares a prefix
    with another of its group, a token after that prefix swapped for another. Also the
    forged completion's index (in group order) and the swapped position."""
    comps, keys = honest(policy, prompts)
    g, j, shared = next((g, j, n) for g, cs in enumerate(comps) for j, c in enumerate(cs)
                        for o in cs[j + 1:] for n in [common(c, o)] if 0 < n < len(c))
    victim = list(comps[g][j])
    victim[shared] = next(t for t in range(3, len(policy.tokenizer)) if t != victim[shared])
    comps[g][j] = victim
    return comps, keys, g * K + j, shared


def assert_same_verdicts(tree, padded, forged: int, shared: int) -> None:
    assert tree[forged].first_failure(TOL) == shared == padded[forged].first_failure(TOL)
    for i, row in enumerate(tree):
        assert i == forged or row.first_failure(TOL) == -1
    for a, b in zip(tree, padded):
        assert a.drawn == b.drawn and a.runner_up == b.runner_up
        # float noise between the two forwards, scaled by 1 / T = 10
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
        finite = [(x, y) for x, y in zip(a.margins, b.margins) if x > -1e300 or y > -1e300]
        assert all(abs(x - y) < 1e-4 for x, y in finite)


@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "gpt2"])
def test_a_training_steps_forward_gives_the_replays_verdicts(policies, arch):
    """The trainer's step forward (completion_logits in training mode, with gradients) replays
    the version in hand's groups (trainer.step.StepReplay): on every architecture whose
    training mode changes nothing, its verdicts are the replay's, the forgery included."""
    policy = policies[arch]
    assert replays_in_training(policy.model)
    prompts = prompts_of(policy)
    comps, keys, forged, shared = with_a_forgery(policy, prompts)
    policy.model.train()
    try:
        logits, _, _ = completion_logits(policy, prompts, comps)
    finally:
        policy.model.eval()
    assert logits.requires_grad
    flat = [c for cs in comps for c in cs]
    in_step = replay_scored(logits, list(range(len(flat))), flat,
                            [k for ks in keys for k in ks], T)
    assert_same_verdicts(in_step, replay(policy, prompts, comps, keys, T), forged, shared)


def test_a_model_with_dropout_is_never_replayed_from_a_training_forward(policies, tokenizer,
                                                                          tmp_path):
    """GPT-2's default config drops 10 % of its activations in training mode, so its step
    forward is not what volunteers ran; the same model with every rate at 0 is."""
    assert not replays_in_training(policies["gpt2"].model)
    from transformers import GPT2Config, GPT2LMHeadModel

    rates = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0)
    still = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=4,
                       n_positions=128, **rates)
    assert replays_in_training(GPT2LMHeadModel(still))
    still.attn_pdrop = 0.1  # a rate only the config holds still counts
    model = GPT2LMHeadModel(still)
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    assert not replays_in_training(model)


def test_prompts_run_apart_only_where_that_saves_more_than_a_call():
    """`by_length` splits the sorted prompt lengths where the padding saved outweighs
    CALL_POSITIONS a run, and every prompt is in exactly one run."""
    assert by_length([12] * 10 + [40] * 10) == [list(range(10)), list(range(10, 20))]
    assert by_length([40, 12] * 5) == [[1, 3, 5, 7, 9], [0, 2, 4, 6, 8]]
    assert by_length([12, 13, 14]) == [[0, 1, 2]]  # 3 positions saved: not worth a call
    assert by_length([30, 30 + CALL_POSITIONS + 1]) == [[0], [1]]
    assert by_length([30, 30 + CALL_POSITIONS - 1]) == [[0, 1]]
    lengths = [n % 200 + 1 for n in range(7919 * 3)]
    runs = by_length(lengths)
    assert sorted(i for run in runs for i in run) == list(range(len(lengths)))
    assert all(max(lengths[i] for i in a) <= min(lengths[i] for i in b)
               for a, b in zip(runs, runs[1:]))
