"""The bucket as a protocol: every object's key, schema, reader and writer.

Owns the keys and the staleness window (layout), the commit point and its signature (manifest,
signing), the weights patches between versions (patch), rollout shards and their bounds
(shards), the committed sampling noise (draws), the grants of group numbers (grants),
the trainer's records (ledger, metrics),
the fleet objects people read (fleet, heartbeat), and how volunteer-written text may be shown
(printable). docs/PROTOCOL.md is the same contract in prose.

May import: storage and the shared modules (config, errors, faults). Never torch, boto3 or
transformers: a volunteer running an older build reads these objects too, and a reader of the
bucket should not need a deep-learning stack.
"""
