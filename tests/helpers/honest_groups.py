"""Honest completions made the way a volunteer makes them (volunteer/loop.py `_generate`):
each completion sampled with its committed draw (protocol.draws). The one place tests that
need honest groups of a given policy call the sampler, so a change to the sampling rule is a
change here."""
from __future__ import annotations

from volunteer_rl.model.sampling import Sample, sample
from volunteer_rl.protocol.draws import group_keys, pool_prompt


def drawn_prompt(trainer, version: int, volunteer: str, seq: int) -> int:
    """The prompt id group number `seq` of `volunteer` must be for under `version`, as the
    trainer published that version's pool (protocol.draws.pool_prompt)."""
    return pool_prompt(trainer.pools[version], trainer.run_id, version, volunteer, seq)


def honest_group(policy, run_id: str, version: int, volunteer: str, seq: int, prompt_id: int,
                 prompt_tokens: list[int], k: int, temperature: float,
                 max_new_tokens: int) -> list[Sample]:
    """The K completions (token ids, behavior logprobs, text) volunteer `volunteer` uploads
    as its group number `seq` of `version` for prompt `prompt_id`, sampled with `policy`."""
    keys = group_keys(run_id, version, volunteer, seq, prompt_id, k)
    (samples,) = sample(policy, [prompt_tokens], k, temperature, max_new_tokens,
                        draw_keys=[keys])
    return samples
