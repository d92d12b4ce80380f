"""A volunteer: follow the signed manifest, fetch checkpoints safely, pick prompts
(curriculum), number and sample groups with their committed noise, upload shards, beat its
heart.

May import: model, task, protocol, storage and the shared modules.
"""
