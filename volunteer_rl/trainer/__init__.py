"""The central trainer: the loop, intake of rollout shards (ingest) and its replay audits
(audit, withheld), the losses, the optimizer
state between publishes, the warm start, held-out evaluation, the per-volunteer counts and
denials, retention, stopping on a signal, and the ranks of a trainer under torchrun (ranks:
the process group, FSDP2 sharding, the writer's full weights and its messages to the others;
shares: each rank's share of the fleet's intake and what the ranks' intakes exchange).

May import: observe, model, task, protocol, storage and the shared modules.
"""
