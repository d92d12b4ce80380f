"""Sampling with committed uniforms (model.sampling) and the trainer's replay of it
(model.replay)."""
import math

import pytest
import torch

from volunteer_rl.model import replay as replay_module
from volunteer_rl.model.policy import Policy, encode_prompts
from volunteer_rl.model.replay import replay
from volunteer_rl.model.sampling import draw, sample
from volunteer_rl.model.tiny import build_tiny_model, build_tokenizer
from volunteer_rl.protocol.draws import completion_uniforms
from volunteer_rl.task.generate import generate_problems
from volunteer_rl.trainer.warmstart import warm_start

K, MAX_NEW, WARM_STEPS = 4, 10, 40


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
        warm_start(policy, problems, WARM_STEPS, batch_size=32, log=lambda m: None)
    finally:
        torch.set_num_threads(before)
    # Prompts of different lengths, so batches left-pad.
    by_length = {}
    for p in encode_prompts(policy, [p.prompt for p in problems]):
        by_length.setdefault(len(p), p)
    prompts = [by_length[n] for n in sorted(by_length)][:6]
    assert len({len(p) for p in prompts}) == len(prompts) >= 4
    return policy, prompts


def streams(n_prompts: int, seq0: int = 0, k: int = K) -> list[list[list[float]]]:
    return [[completion_uniforms("test-run", 1, "vol-1", seq0 + g, g, j, MAX_NEW) for j in range(k)]
            for g in range(n_prompts)]


def tokens_of(groups) -> list[list[list[int]]]:
    return [[s.token_ids for s in g] for g in groups]


def test_draw_takes_the_token_whose_interval_holds_the_uniform():
    logp = torch.tensor([0.5, 0.0, 0.2, 0.3, 0.0]).log().expand(7, 5)
    u = torch.tensor([0.0, 0.49, 0.51, 0.69, 0.71, 0.95, 1 - 2 ** -53], dtype=torch.float64)
    assert draw(logp, u).tolist() == [0, 0, 2, 2, 3, 3, 3]  # never the 0-probability tokens


def test_committed_sampling_ignores_the_torch_seed(tiny):
    policy, prompts = tiny
    torch.manual_seed(1)
    a = sample(policy, prompts, K, 1.0, MAX_NEW, uniforms=streams(len(prompts)))
    torch.manual_seed(2)
    b = sample(policy, prompts, K, 1.0, MAX_NEW, uniforms=streams(len(prompts)))
    assert tokens_of(a) == tokens_of(b)
    assert [[s.logprobs for s in g] for g in a] == [[s.logprobs for s in g] for g in b]
    c = sample(policy, prompts, K, 1.0, MAX_NEW, uniforms=streams(len(prompts), seq0=10))
    assert tokens_of(c) != tokens_of(a)  # other streams, other tokens


def test_a_prompt_samples_the_same_tokens_alone_or_in_any_batch(tiny):
    policy, prompts = tiny
    u = streams(len(prompts))
    together = tokens_of(sample(policy, prompts, K, 1.0, MAX_NEW, uniforms=u))
    two_per_call = tokens_of(sample(policy, prompts, K, 1.0, MAX_NEW, batch_size=2 * K,
                                    uniforms=u))
    reversed_order = tokens_of(sample(policy, prompts[::-1], K, 1.0, MAX_NEW,
                                      uniforms=u[::-1]))[::-1]
    alone = [tokens_of(sample(policy, [p], K, 1.0, MAX_NEW, uniforms=[s]))[0]
             for p, s in zip(prompts, u)]
    assert together == two_per_call == reversed_order == alone
    assert len({len(t) for g in together for t in g}) > 1  # rows left the batch at EOS


def test_one_or_two_torch_threads_sample_the_same_tokens(tiny):
    policy, prompts = tiny
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = tokens_of(sample(policy, prompts, K, 1.0, MAX_NEW, uniforms=streams(len(prompts))))
        torch.set_num_threads(2)
        two = tokens_of(sample(policy, prompts, K, 1.0, MAX_NEW, uniforms=streams(len(prompts))))
    finally:
        torch.set_num_threads(before)
    assert one == two


def test_greedy_is_unchanged_by_uniforms(tiny):
    policy, prompts = tiny
    plain = tokens_of(sample(policy, prompts, 2, 0.0, MAX_NEW))
    committed = sample(policy, prompts, 2, 0.0, MAX_NEW, uniforms=streams(len(prompts), k=2))
    assert tokens_of(committed) == plain


def test_streams_that_do_not_fit_are_refused(tiny):
    policy, prompts = tiny
    u = streams(2)
    with pytest.raises(ValueError):
        sample(policy, prompts[:3], K, 1.0, MAX_NEW, uniforms=u)                # a prompt short
    with pytest.raises(ValueError):
        sample(policy, prompts[:2], K + 1, 1.0, MAX_NEW, uniforms=u)            # a stream short
    with pytest.raises(ValueError):
        sample(policy, prompts[:2], K, 1.0, MAX_NEW + 1, uniforms=u)            # too few values
    with pytest.raises(ValueError):
        replay(policy, prompts[:2], [[[5] * (MAX_NEW + 1)] * K] * 2, u, 1.0)   # too few values
    with pytest.raises(ValueError):
        replay(policy, prompts[:2], [[[5]] * K] * 2, u, 0.0)                   # greedy: no draw


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_honest_samples_replay_inside_their_intervals(tiny, temperature):
    policy, prompts = tiny
    u = streams(len(prompts))
    groups = sample(policy, prompts, K, temperature, MAX_NEW, uniforms=u)
    rows = replay(policy, prompts, tokens_of(groups), u, temperature)
    samples = [s for g in groups for s in g]
    assert len(rows) == len(samples)
    for row, s in zip(rows, samples):
        assert row.margin >= -1e-6 and 0 <= row.position < len(s.token_ids)
        assert len(row.logprobs) == len(s.logprobs)
        assert max(abs(a - b) for a, b in zip(row.logprobs, s.logprobs)) < 1e-4


def test_a_swapped_token_gets_a_negative_margin_where_it_was_swapped(tiny):
    policy, prompts = tiny
    u = streams(1)
    (group,) = sample(policy, prompts[:1], K, 1.0, MAX_NEW, uniforms=u)
    j = max(range(K), key=lambda i: len(group[i].token_ids))
    honest = group[j].token_ids
    at = 2
    assert len(honest) > at
    # The policy's most likely token there, unless that is the one drawn: then the next one.
    with torch.no_grad():
        logits = policy.model(torch.tensor([prompts[0] + honest[:at]])).logits[0, -1]
    first, second = logits.topk(2).indices.tolist()
    chosen = second if honest[at] == first else first
    forged = honest[:at] + [chosen]
    (row,) = replay(policy, prompts[:1], [[forged]], [[u[0][j]]], 1.0)
    assert row.position == at and row.margin < -1e-6
    # Its logprob is the forged token's true one: the logprob audit alone would pass it.
    assert row.logprobs[at] == pytest.approx(torch.log_softmax(logits, -1)[chosen].item(), abs=1e-4)


def test_completions_sampled_with_other_uniforms_are_caught(tiny):
    """Unless the other uniforms happen to pick the very tokens the committed ones pick: then
    it is the committed sample."""
    policy, prompts = tiny
    u = streams(len(prompts))
    honest = [t for g in tokens_of(sample(policy, prompts, K, 1.0, MAX_NEW, uniforms=u)) for t in g]
    other = tokens_of(sample(policy, prompts, K, 1.0, MAX_NEW, uniforms=streams(len(prompts), 100)))
    rows = replay(policy, prompts, other, u, 1.0)
    differ = [a != b for a, b in zip(honest, (t for g in other for t in g))]
    assert sum(differ) >= len(differ) // 2
    assert [r.margin < -1e-6 for r in rows] == differ


def test_chunked_replay_equals_one_pass_and_empty_completions_pass(tiny, monkeypatch):
    policy, prompts = tiny
    u = streams(len(prompts))
    comps = tokens_of(sample(policy, prompts, K, 1.0, MAX_NEW, uniforms=u))
    comps[1][2] = []  # an empty completion among the others
    whole = replay(policy, prompts, comps, u, 1.0)
    vocab = policy.model.get_output_embeddings().weight.shape[0]
    monkeypatch.setattr(replay_module, "CHUNK_BYTES", 3 * vocab * 8)  # 1 row, 3 positions a slice
    chunked = replay(policy, prompts, comps, u, 1.0)
    assert whole[1 * K + 2].margin == math.inf and whole[1 * K + 2].logprobs == []
    assert chunked[1 * K + 2].position == -1
    for a, b in zip(whole, chunked):
        assert a.margin == pytest.approx(b.margin, abs=1e-6) and a.position == b.position
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
