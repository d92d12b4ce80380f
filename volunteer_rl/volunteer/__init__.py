"""A volunteer: follow the signed manifest, fetch checkpoints safely, pick prompts
(curriculum), sample groups, upload shards, beat its heart.

May import: model, task, protocol, storage and the shared modules.
"""
