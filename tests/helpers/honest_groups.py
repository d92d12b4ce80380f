"""Honest completions made the way a volunteer makes them (volunteer/loop.py `_generate`):
each completion sampled with its committed draw (protocol.draws). The one place tests that
need honest groups of a given policy call the sampler, so a change to the sampling rule is a
change here."""
from __future__ import annotations

from volunteer_rl.model.sampling import Sample, sample
from volunteer_rl.protocol.draws import group_keys, pool_prompt
from volunteer_rl.protocol.grants import grant_secret, seq_nonce
from volunteer_rl.protocol.signing import parse_private_key
from volunteer_rl.task.base import completion_reward
from volunteer_rl.task.calculator_task import CalculatorTask


def key_secret(key_path) -> bytes:
    """The grant secret of the trainer whose signing key is at `key_path` (protocol.grants):
    with it a test deals itself the nonces that trainer would grant."""
    return grant_secret(parse_private_key(open(key_path, "rb").read(), str(key_path)))


def nonce(secret: bytes, run_id: str, volunteer: str, version: int, seq: int) -> str:
    """The nonce number `seq` of `volunteer` is drawn with when granted for `version`."""
    return seq_nonce(secret, run_id, volunteer, version, seq)


def secret_of(trainer) -> bytes:
    """The grant secret of `trainer`: the conftest Template's, or an in-process Trainer's."""
    if hasattr(trainer, "publisher"):
        return grant_secret(trainer.publisher.key)
    return trainer.secret


def drawn_prompt(trainer, version: int, volunteer: str, seq: int) -> int:
    """The prompt id group number `seq` of `volunteer` must be for under `version`, as the
    trainer published that version's pool (protocol.draws.pool_prompt), the number granted for
    that version by that trainer (the Template's, or an in-process Trainer)."""
    return pool_prompt(trainer.pools[version], trainer.run_id, version, volunteer, seq,
                       nonce(secret_of(trainer), trainer.run_id, volunteer, version, seq))


def honest_group(policy, run_id: str, version: int, volunteer: str, seq: int, prompt_id: int,
                 prompt_tokens: list[int], k: int, temperature: float,
                 max_new_tokens: int, secret: bytes) -> list[Sample]:
    """The K completions (token ids, behavior logprobs, text) volunteer `volunteer` uploads
    as its group number `seq` of `version` for prompt `prompt_id`, sampled with `policy`, the
    number granted for `version` by the trainer of `secret`."""
    keys = group_keys(run_id, version, volunteer, seq, prompt_id, k,
                      nonce(secret, run_id, volunteer, version, seq))
    (samples,) = sample(policy, [prompt_tokens], k, temperature, max_new_tokens,
                        draw_keys=[keys])
    return samples


def forged(template, group):
    """The template's calculator `group` with one completion's first token swapped for another
    ordinary token (one its draw did not select: a lie a replay must catch), that completion's
    reward recomputed; None if the group lost its reward variance (it would not be trained)."""
    lie = swapped(template, group)
    return lie if len({c.reward for c in lie.completions}) > 1 else None


def covering(template, group):
    """A made-up group of equal rewards for `group`'s number: `group` (all its rewards equal)
    with one completion's first token swapped as `forged` does, which no draw gives; never
    trained, it only makes the number count as received. None if the swap changed a reward."""
    lie = swapped(template, group)
    return lie if len({c.reward for c in lie.completions}) == 1 else None


def swapped(template, group):
    """`group` with one completion's first token swapped for another ordinary token, that
    completion's reward recomputed."""
    policy = template.policy
    vocab = len(policy.tokenizer)
    completions = list(group.completions)
    j = next(i for i, c in enumerate(completions) if len(c.token_ids) >= 2)
    tokens = list(completions[j].token_ids)
    swap = (tokens[0] + 1) % vocab
    while swap == tokens[0] or swap == policy.eos_id or swap in policy.special_ids:
        swap = (swap + 1) % vocab
    tokens[0] = swap
    reward = completion_reward(CalculatorTask(), template.problems[group.prompt_id], tokens,
                               policy.decode_all, policy.eos_id, policy.special_ids)
    completions[j] = type(completions[j])(tokens, completions[j].logprobs, "", reward)
    return type(group)(group.prompt_id, group.policy_version, group.volunteer_id, group.seq, completions)
