"""The central trainer: the loop, intake of rollout shards (ingest) and its replay audits
(audit, withheld), the losses, the optimizer
state between publishes, the warm start, held-out evaluation, the per-volunteer counts and
denials, retention, and stopping on a signal.

May import: observe, model, task, protocol, storage and the shared modules.
"""
