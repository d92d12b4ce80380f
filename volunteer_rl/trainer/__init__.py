"""The central trainer. The loop (loop: `Trainer`, wiring the rooms below) and its rooms: the
learner (policy, AdamW, the step count, the state saved between publishes: learner, state),
the weights held besides it for replays and evals (held), the publisher (where the run stands,
each publish and what follows it: publisher, publish), the records (metrics, evals, views,
ledger records: records), starting fresh or resuming (startup), and the role this process
plays (roles: a single process; under torchrun the writer, writer, or a follower, follower).
Beside them: the intake of rollout shards (ingest), its replay audits (audit, withheld) and
the grants of group numbers it answers (granting),
the losses and the step (losses, step), the warm start, held-out evaluation, the
per-volunteer counts and denials, retention, and the ranks of a trainer under torchrun
(ranks: the process group and FSDP2 sharding; shares: each rank's share of the fleet's intake
and what the ranks' intakes exchange).

May import: observe, model, task, protocol, storage and the shared modules.
"""
