"""One batch of granted group numbers sampled into groups: each number's prompt drawn from the
version's pool and its committed noise, both keyed by the nonce of its grant, then the
completions sampled and scored. No I/O: the loop (volunteer.loop) fetches, uploads and waits."""

from __future__ import annotations

from typing import Callable

from volunteer_rl.model.policy import Policy, encode_prompts
from volunteer_rl.model.sampling import sample
from volunteer_rl.protocol.draws import group_keys, pool_prompt
from volunteer_rl.protocol.manifest import Manifest
from volunteer_rl.protocol.shards import Completion, Group
from volunteer_rl.task.base import Row, Task, completion_reward
from volunteer_rl.volunteer.numbering import Batch


def sample_batch(m: Manifest, policy: Policy, task: Task, problems: list[Row], volunteer_id: str,
                 batch: Batch, between_steps: Callable[[], None] | None = None) -> list[Group]:
    """The groups of `batch` (numbers of version `m`, the one `policy` holds), in number order.
    `between_steps` runs after every forward of the sampler (where a host-control pause holds)."""
    seqs = range(batch.first, batch.first + batch.count)
    picked = [problems[pool_prompt(m.prompt_pool, m.run_id, m.version, volunteer_id, n,
                                   batch.nonce(n))] for n in seqs]
    prompts = encode_prompts(policy, [task.prompt(p) for p in picked], task.instruction)
    s = m.sampling
    keys = [group_keys(m.run_id, m.version, volunteer_id, n, p.id, s.k, batch.nonce(n))
            for n, p in zip(seqs, picked)]
    out = sample(policy, prompts, s.k, s.temperature, s.max_new_tokens, draw_keys=keys,
                 between_steps=between_steps)
    groups = []
    for n, p, samples in zip(seqs, picked, out):
        completions = [Completion(x.token_ids, x.logprobs, x.text,
                                  completion_reward(task, p, x.token_ids, policy.decode_all,
                                                    policy.eos_id, policy.special_ids))
                       for x in samples]
        groups.append(Group(p.id, m.version, volunteer_id, n, completions))
    return groups
