"""The real tiny transformers model: build, save as safetensors, load through the HF path."""

import pytest
import torch
from safetensors import safe_open

from volunteer_rl.model.devices import (TORCH_DEFAULT_THREADS, sampling_prompts, sampling_threads,
                                        set_sampling_threads)
from volunteer_rl.model.policy import Policy, encode_prompts, load_policy
from volunteer_rl.model.sampling import draw, gumbel_noise, perturbed, sample
from volunteer_rl.model.scoring import token_logprobs
from volunteer_rl.model.tiny import build_tiny_model, build_tokenizer
from volunteer_rl.model.weights import load_weights, save_policy
from volunteer_rl.task.calculator_generate import generate_problems


@pytest.fixture(scope="module")
def tiny():
    problems = generate_problems(300, seed=5)
    tok = build_tokenizer([p.prompt for p in problems] + [p.expression for p in problems], vocab_size=400)
    torch.manual_seed(0)
    return Policy(build_tiny_model(tok, seed=0).eval(), tok, "plain", torch.device("cpu")), problems


def test_save_load_round_trip_with_tied_embeddings(tiny, tmp_path):
    policy, problems = tiny
    folder = save_policy(policy, tmp_path / "ckpt")
    names = {p.name for p in folder.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "vrl.json"} <= names
    assert not any(n.endswith((".bin", ".pt", ".pkl")) for n in names)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.embed_tokens.weight" in keys
    loaded = load_policy(folder)
    assert loaded.prompt_format == "plain"
    assert loaded.model.lm_head.weight.data_ptr() == loaded.model.model.embed_tokens.weight.data_ptr()
    ids = encode_prompts(policy, [problems[0].prompt])
    x = torch.tensor(ids)
    with torch.no_grad():
        assert torch.allclose(policy.model(x).logits, loaded.model(x).logits, atol=1e-6)


def test_load_weights_swaps_in_place(tiny, tmp_path):
    policy, _ = tiny
    folder = save_policy(policy, tmp_path / "a")
    other = load_policy(folder)
    with torch.no_grad():
        for p in other.model.parameters():
            p.add_(0.01)
    save_policy(other, tmp_path / "b")
    target = load_policy(folder)
    ptr = target.model.model.embed_tokens.weight.data_ptr()
    load_weights(target, tmp_path / "b" / "model.safetensors")
    assert target.model.model.embed_tokens.weight.data_ptr() == ptr
    assert torch.equal(target.model.model.embed_tokens.weight, other.model.model.embed_tokens.weight)
    assert torch.equal(target.model.lm_head.weight, other.model.lm_head.weight)


def test_sampled_logprobs_match_the_trainers_forward(tiny):
    policy, problems = tiny
    prompts = encode_prompts(policy, [p.prompt for p in problems[:6]])
    torch.manual_seed(1)
    groups = sample(policy, prompts, k=4, temperature=0.7, max_new_tokens=12)
    assert [len(g) for g in groups] == [4] * 6
    with torch.no_grad():
        logp, mask = token_logprobs(policy, prompts, [[s.token_ids for s in g] for g in groups], 0.7)
    claimed = [s.logprobs for g in groups for s in g]
    for i, lp in enumerate(claimed):
        n = len(lp)
        assert mask[i].sum().item() == n
        assert torch.allclose(logp[i, :n], torch.tensor(lp), atol=1e-4)
    # EOS is kept and nothing after it
    for s in (s for g in groups for s in g):
        assert policy.eos_id not in s.token_ids[:-1]


def test_chat_template_models_are_prompted_with_it(tiny, tmp_path):
    policy, _ = tiny
    tok = policy.tokenizer
    tok.chat_template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>"
    try:
        folder = tmp_path / "chat"
        policy.model.save_pretrained(folder)
        tok.save_pretrained(folder)  # no vrl.json: an ordinary HF folder
        loaded = load_policy(folder)
        assert loaded.prompt_format == "chat"
        from volunteer_rl.model.policy import format_prompt
        text = format_prompt(loaded, "add 1 and 2")
        assert text.startswith("<|user|>") and text.endswith("<|assistant|>") and "add 1 and 2" in text
    finally:
        tok.chat_template = None


def test_shared_prompt_scoring_matches_one_row_at_a_time(tiny):
    """The K completions of a prompt share one prompt pass: values and gradients must equal
    scoring each (prompt, completion) pair on its own."""
    policy, problems = tiny
    prompts = encode_prompts(policy, [p.prompt for p in problems[:3]])
    comps = [[[5, 6, 7], [8, policy.eos_id]], [[9], [10, 11, 12, 13]], [[14, 15], [16]]]
    logp, mask = token_logprobs(policy, prompts, comps, 1.0)
    (logp * mask).sum().backward()
    shared = [p.grad.clone() for p in policy.model.parameters()]
    policy.model.zero_grad()
    total = 0.0
    for i, (p, group) in enumerate(zip(prompts, comps)):
        for j, c in enumerate(group):
            lp, m = token_logprobs(policy, [p], [[c]], 1.0)
            assert torch.allclose(lp[0, : len(c)], logp[2 * i + j, : len(c)], atol=1e-5)
            total = total + (lp * m).sum()
    total.backward()
    for a, p in zip(shared, policy.model.parameters()):
        assert torch.allclose(a, p.grad, atol=1e-5)
    policy.model.zero_grad()


def test_trainer_publishes_any_hf_folder_through_the_same_path(tiny, tmp_path):
    """`--model PATH`: an ordinary HF folder (no vrl.json, a chat template) becomes v0."""
    from volunteer_rl.config import TrainerConfig
    from volunteer_rl.trainer.evaluate import load_version
    from volunteer_rl.trainer.loop import Trainer

    policy, _ = tiny
    folder = tmp_path / "hf-model"
    policy.model.save_pretrained(folder)
    tok = policy.tokenizer
    tok.chat_template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>"
    try:
        tok.save_pretrained(folder)
    finally:
        tok.chat_template = None
    bucket = f"memory://hf-folder-{tmp_path.name}"
    cfg = TrainerConfig(bucket=bucket, model=str(folder), eval_prompts=20, work_dir=str(tmp_path / "w"))
    t = Trainer(cfg, log=lambda m: None)
    t.held_out = t.held_out[:20]
    t.start()
    assert t.manifest.version == 0 and t.manifest.prompt_format == "chat"
    from volunteer_rl.protocol.signing import Trust, public_key_text
    m, loaded = load_version(t.storage, 0, tmp_path / "ev", trust=Trust(public_key_text(t.key)))
    assert loaded.prompt_format == "chat" and m.files["model.safetensors"].size > 0
    assert torch.equal(loaded.model.model.embed_tokens.weight, policy.model.model.embed_tokens.weight)


def test_warm_start_loss_matches_masked_scoring(tiny):
    """The mask-free right-padded loss equals the masked, left-padded scorer's."""
    from volunteer_rl.trainer.warmstart import target_nll

    policy, problems = tiny
    prompts = encode_prompts(policy, [p.prompt for p in problems[:5]])
    targets = [list(policy.tokenizer(p.expression, add_special_tokens=False)["input_ids"]) + [policy.eos_id]
               for p in problems[:5]]
    with torch.no_grad():
        logp, mask = token_logprobs(policy, prompts, [[t] for t in targets], 1.0)
        expected = -(logp * mask).sum() / mask.sum()
        assert torch.allclose(target_nll(policy, prompts, targets), expected, atol=1e-5)


def test_draw_follows_the_softmax_and_never_picks_an_impossible_token():
    torch.manual_seed(0)
    probs = torch.tensor([0.5, 0.0, 0.2, 0.3, 0.0])
    n = 40_000
    words = torch.randint(0, 1 << 32, (n, 2))  # n completions' key words, position 0
    noise = gumbel_noise(words, torch.zeros(n, dtype=torch.long), 5)
    picked = draw(perturbed(probs.log().expand(n, 5), 1.0, noise))
    freq = torch.bincount(picked, minlength=5).double() / n
    assert freq[1] == 0 and freq[4] == 0  # 0-probability tokens, the last one included
    assert torch.allclose(freq, probs.double(), atol=0.01)  # 4 standard errors


def test_greedy_sampling_equals_generate_one_prompt_at_a_time(tiny):
    """Left-padded, batched, rows leaving the batch at EOS: the same tokens as `generate`."""
    policy, problems = tiny
    prompts = encode_prompts(policy, [p.prompt for p in problems[:5]])
    groups = sample(policy, prompts, k=1, temperature=0.0, max_new_tokens=8)
    with torch.no_grad():
        for p, (s,) in zip(prompts, groups):
            ids = torch.tensor([p])
            out = policy.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                        max_new_tokens=8, pad_token_id=policy.pad_id,
                                        eos_token_id=policy.eos_id)[0, len(p):].tolist()
            n = out.index(policy.eos_id) + 1 if policy.eos_id in out else len(out)
            assert s.token_ids == out[:n]
            assert len(s.logprobs) == n and s.text == policy.tokenizer.decode(out[:n], skip_special_tokens=True)


def test_rows_stop_at_max_new_tokens_or_their_first_eos(tiny):
    policy, problems = tiny
    prompts = encode_prompts(policy, [p.prompt for p in problems[:4]])
    torch.manual_seed(3)
    for s in (s for g in sample(policy, prompts, k=8, temperature=1.0, max_new_tokens=3) for s in g):
        assert 1 <= len(s.token_ids) <= 3 and len(s.logprobs) == len(s.token_ids)
        assert policy.eos_id not in s.token_ids[:-1]
        assert len(s.token_ids) == 3 or s.token_ids[-1] == policy.eos_id
    assert all(s.token_ids == [] for g in sample(policy, prompts, 2, 1.0, 0) for s in g)


def test_small_models_sample_32_prompts_a_round_big_ones_16(tiny):
    policy, _ = tiny
    assert sampling_prompts(policy) == 32                 # 0.5 M parameters
    assert sampling_prompts(policy, prompts=7) == 7       # --prompts-per-batch wins
    big = Policy(torch.nn.Linear(2500, 2500), policy.tokenizer, "plain", torch.device("cpu"))
    assert sampling_prompts(big) == 16                    # 6.3 M parameters: its KV cache counts


def test_small_models_sample_on_one_thread_big_ones_on_torchs_default(tiny):
    policy, _ = tiny
    assert sampling_threads(policy) == 1                  # 0.5 M parameters on the CPU
    assert sampling_threads(policy, threads=3) == 3       # --threads wins
    big = Policy(torch.nn.Linear(2500, 2500), policy.tokenizer, "plain", torch.device("cpu"))
    assert sampling_threads(big) == TORCH_DEFAULT_THREADS  # 6.3 M parameters
    gpu = Policy(policy.model, policy.tokenizer, "plain", torch.device("cuda"))
    assert sampling_threads(gpu) == TORCH_DEFAULT_THREADS  # no CPU matmuls to size
    before = torch.get_num_threads()
    try:
        assert set_sampling_threads(policy) == 1 == torch.get_num_threads()
        assert set_sampling_threads(policy, 2) == 2 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
