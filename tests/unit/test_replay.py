"""Sampling with committed Gumbel noise (model.sampling) and the trainer's replay of it
(model.replay)."""
import math

import pytest
import torch

from volunteer_rl.config import TrainerConfig
from volunteer_rl.model import replay as replay_module
from volunteer_rl.model.policy import Policy, bf16_rounded, encode_prompts
from volunteer_rl.model.replay import ReplayRow, replay
from volunteer_rl.model.sampling import margins, sample
from volunteer_rl.model.tiny import build_tiny_model, build_tokenizer
from volunteer_rl.protocol.draws import group_keys
from volunteer_rl.task.calculator_generate import generate_problems
from volunteer_rl.trainer.warmstart import warm_start

K, MAX_NEW, WARM_STEPS = 4, 10, 40
TOL = TrainerConfig(bucket="unused").replay_tolerance  # the trainer's default, in nats


@pytest.fixture(scope="module")
def tiny():
    problems = generate_problems(300, seed=5)
    tok = build_tokenizer([p.prompt for p in problems] + [p.expression for p in problems],
                          vocab_size=400)
    policy = Policy(build_tiny_model(tok, seed=0), tok, "plain", torch.device("cpu"))
    # A short warm start: completions end at EOS at different lengths, as a volunteer's do.
    # One thread: two wait for each other at every op on a busy 2-core machine.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        warm_start(policy, [p.prompt for p in problems], [p.expression for p in problems], WARM_STEPS, batch_size=32, log=lambda m: None)
    finally:
        torch.set_num_threads(before)
    # Prompts of different lengths, so batches left-pad.
    by_length = {}
    for p in encode_prompts(policy, [p.prompt for p in problems]):
        by_length.setdefault(len(p), p)
    prompts = [by_length[n] for n in sorted(by_length)][:6]
    assert len({len(p) for p in prompts}) == len(prompts) >= 4
    return policy, prompts


def keys(n_prompts: int, seq0: int = 0, k: int = K) -> list[list[bytes]]:
    return [group_keys("test-run", 1, "vol-1", seq0 + g, g, k, "test-nonce") for g in range(n_prompts)]


def tokens_of(groups) -> list[list[list[int]]]:
    return [[s.token_ids for s in g] for g in groups]


def test_only_the_top_token_or_the_runner_up_of_a_near_tie_passes():
    """The acceptance rule on hand-made perturbed scores: a near-tie of three tokens lets the
    top two pass and not the third; a runner-up far below the top does not pass."""
    near = torch.tensor([5.0, 5.0 - 1e-6, 5.0 - 2e-6, 1.0], dtype=torch.float64)
    far = torch.tensor([5.0, 4.0, -1.0, 1.0], dtype=torch.float64)
    nan = torch.tensor([5.0, float("nan"), 4.0, 1.0], dtype=torch.float64)
    scores = torch.stack([near] * 4 + [far] * 2 + [nan])
    m = margins(scores, torch.tensor([0, 1, 2, 3, 0, 1, 0])).tolist()
    assert m[0] == pytest.approx(1e-6) and m[1] == pytest.approx(-1e-6)
    assert m[2] == m[3] == -math.inf                       # third and fourth: never
    assert m[4] == 1.0 and m[5] == -1.0 and m[6] == -math.inf
    row = ReplayRow(m[:4], [0.0] * 4, [0] * 4, [1] * 4)
    assert row.first_failure(1e-5) == 2 and row.margin == -math.inf and row.position == 2
    assert ReplayRow(m[:2], [0.0] * 2, [0] * 2, [1] * 2).first_failure(1e-5) == -1
    assert ReplayRow(m[:2], [0.0] * 2, [0] * 2, [1] * 2).first_failure(1e-7) == 1
    assert ReplayRow(m[4:6], [0.0] * 2, [0] * 2, [1] * 2).first_failure(0.5) == 1


def test_committed_sampling_ignores_the_torch_seed(tiny):
    policy, prompts = tiny
    torch.manual_seed(1)
    a = sample(policy, prompts, K, 1.0, MAX_NEW, draw_keys=keys(len(prompts)))
    torch.manual_seed(2)
    b = sample(policy, prompts, K, 1.0, MAX_NEW, draw_keys=keys(len(prompts)))
    assert tokens_of(a) == tokens_of(b)
    assert [[s.logprobs for s in g] for g in a] == [[s.logprobs for s in g] for g in b]
    c = sample(policy, prompts, K, 1.0, MAX_NEW, draw_keys=keys(len(prompts), seq0=10))
    assert tokens_of(c) != tokens_of(a)  # other streams, other tokens


def test_a_prompt_samples_the_same_tokens_alone_or_in_any_batch(tiny):
    policy, prompts = tiny
    u = keys(len(prompts))
    together = tokens_of(sample(policy, prompts, K, 1.0, MAX_NEW, draw_keys=u))
    two_per_call = tokens_of(sample(policy, prompts, K, 1.0, MAX_NEW, batch_size=2 * K,
                                    draw_keys=u))
    reversed_order = tokens_of(sample(policy, prompts[::-1], K, 1.0, MAX_NEW,
                                      draw_keys=u[::-1]))[::-1]
    alone = [tokens_of(sample(policy, [p], K, 1.0, MAX_NEW, draw_keys=[s]))[0]
             for p, s in zip(prompts, u)]
    assert together == two_per_call == reversed_order == alone
    assert len({len(t) for g in together for t in g}) > 1  # rows left the batch at EOS


def test_one_or_two_torch_threads_sample_the_same_tokens(tiny):
    policy, prompts = tiny
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = tokens_of(sample(policy, prompts, K, 1.0, MAX_NEW, draw_keys=keys(len(prompts))))
        torch.set_num_threads(2)
        two = tokens_of(sample(policy, prompts, K, 1.0, MAX_NEW, draw_keys=keys(len(prompts))))
    finally:
        torch.set_num_threads(before)
    assert one == two


def test_greedy_is_unchanged_by_draw_keys(tiny):
    policy, prompts = tiny
    plain = tokens_of(sample(policy, prompts, 2, 0.0, MAX_NEW))
    committed = sample(policy, prompts, 2, 0.0, MAX_NEW, draw_keys=keys(len(prompts), k=2))
    assert tokens_of(committed) == plain


def test_draw_keys_that_do_not_fit_are_refused(tiny):
    policy, prompts = tiny
    u = keys(2)
    with pytest.raises(ValueError):
        sample(policy, prompts[:3], K, 1.0, MAX_NEW, draw_keys=u)               # a prompt short
    with pytest.raises(ValueError):
        sample(policy, prompts[:2], K + 1, 1.0, MAX_NEW, draw_keys=u)           # a key short
    with pytest.raises(ValueError):
        sample(policy, prompts[:1], K, 1.0, MAX_NEW, draw_keys=[[b"short"] * K])  # not a key
    with pytest.raises(ValueError):
        replay(policy, prompts[:2], [[[5]] * (K + 1)] * 2, u, 1.0)             # a key short
    with pytest.raises(ValueError):
        replay(policy, prompts[:2], [[[5]] * K] * 2, u, 0.0)                   # greedy: no draw



@pytest.mark.parametrize("weights", ["fp32", "bf16"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_honest_samples_pass_the_replay(tiny, temperature, weights):
    """Sampled in one batch, in batches of one group, with 1 and with 2 threads, and replayed
    in one call: no position falls below the trainer's tolerance."""
    policy, prompts = tiny
    if weights == "bf16":
        policy = bf16_rounded(policy)
    u = keys(len(prompts))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        together = sample(policy, prompts, K, temperature, MAX_NEW, draw_keys=u)
        torch.set_num_threads(1)
        alone = sample(policy, prompts, K, temperature, MAX_NEW, batch_size=K, draw_keys=u)
        for groups in (together, alone):
            rows = replay(policy, prompts, tokens_of(groups), u, temperature)
            samples = [s for g in groups for s in g]
            assert len(rows) == len(samples)
            for row, s in zip(rows, samples):
                assert row.first_failure(TOL) == -1 and 0 <= row.position < len(s.token_ids)
                assert row.drawn == s.token_ids or row.margin < 0  # own token but at a near-tie
                assert len(row.logprobs) == len(s.logprobs)
                assert max(abs(a - b) for a, b in zip(row.logprobs, s.logprobs)) < 1e-4
    finally:
        torch.set_num_threads(before)


def test_a_swapped_token_fails_where_it_was_swapped(tiny):
    """The attacker's best choices: the runner-up of the committed draw, and the policy's most
    likely token. Both fail at their position, with their true logprobs."""
    policy, prompts = tiny
    u = keys(1)
    (group,) = sample(policy, prompts[:1], K, 1.0, MAX_NEW, draw_keys=u)
    j = max(range(K), key=lambda i: len(group[i].token_ids))
    honest = group[j].token_ids
    at = 2
    assert len(honest) > at
    (own,) = replay(policy, prompts[:1], [[honest]], [[u[0][j]]], 1.0)
    assert own.drawn[at] == honest[at]
    with torch.no_grad():
        logits = policy.model(torch.tensor([prompts[0] + honest[:at]])).logits[0, -1]
    first, second = logits.topk(2).indices.tolist()
    likely = second if honest[at] == first else first
    for chosen in (own.runner_up[at], likely):
        forged = honest[:at] + [chosen] + honest[at + 1:]
        (row,) = replay(policy, prompts[:1], [[forged]], [[u[0][j]]], 1.0)
        assert row.first_failure(TOL) == at and row.margins[at] < -TOL
        # Its logprob is the forged token's true one: the logprob audit alone would pass it.
        assert row.logprobs[at] == pytest.approx(torch.log_softmax(logits, -1)[chosen].item(),
                                                 abs=1e-4)


def test_completions_sampled_with_other_keys_are_caught(tiny):
    """Unless the other keys happen to pick the very tokens the committed ones pick: then it
    is the committed sample."""
    policy, prompts = tiny
    u = keys(len(prompts))
    honest = [t for g in tokens_of(sample(policy, prompts, K, 1.0, MAX_NEW, draw_keys=u))
              for t in g]
    other = tokens_of(sample(policy, prompts, K, 1.0, MAX_NEW, draw_keys=keys(len(prompts), 100)))
    rows = replay(policy, prompts, other, u, 1.0)
    differ = [a != b for a, b in zip(honest, (t for g in other for t in g))]
    assert sum(differ) >= len(differ) // 2
    assert [r.first_failure(TOL) >= 0 for r in rows] == differ


def test_no_tail_token_passes_on_a_32k_vocabulary():
    """On a real vocabulary's width with a peaked distribution (where inverse CDF left a choice
    among tens of tail tokens within float noise of one uniform), a completion whose every
    token is replaced by its neighbour in vocabulary order fails at every position, and the
    honest one passes at every position."""
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = 32_000
    tok = build_tokenizer(["1 + 2 * 3 - 4"], vocab_size=40)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                         tie_word_embeddings=False, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id, bos_token_id=None)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(60.0)  # peaked: mean top-1 probability about 0.4
    policy = Policy(model, tok, "plain", torch.device("cpu"))
    prompts, k, n = [[5, 6, 7], [8, 9]], 4, 16
    u = keys(len(prompts), k=k)
    honest = tokens_of(sample(policy, prompts, k, 1.0, n, draw_keys=u))
    neighbours = [[[(t + 1) % vocab for t in c] for c in g] for g in honest]
    with torch.no_grad():
        p = torch.softmax(model(torch.tensor([prompts[0]])).logits[0], -1).max(-1).values
    assert 0.2 < p.mean().item() < 0.7
    for row in replay(policy, prompts, honest, u, 1.0):
        assert row.first_failure(TOL) == -1
    for row in replay(policy, prompts, neighbours, u, 1.0):
        assert all(m < -TOL for m in row.margins)


def test_chunked_replay_equals_one_pass_and_empty_completions_pass(tiny, monkeypatch):
    policy, prompts = tiny
    u = keys(len(prompts))
    comps = tokens_of(sample(policy, prompts, K, 1.0, MAX_NEW, draw_keys=u))
    comps[1][2] = []  # an empty completion among the others
    whole = replay(policy, prompts, comps, u, 1.0)
    vocab = policy.model.get_output_embeddings().weight.shape[0]
    monkeypatch.setattr(replay_module, "CHUNK_BYTES", 3 * vocab * 8)  # 1 row, 3 positions a slice
    chunked = replay(policy, prompts, comps, u, 1.0)
    assert whole[1 * K + 2].margin == math.inf and whole[1 * K + 2].logprobs == []
    assert chunked[1 * K + 2].position == -1
    for a, b in zip(whole, chunked):
        assert a.margins == pytest.approx(b.margins, abs=1e-5) and a.drawn == b.drawn
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
