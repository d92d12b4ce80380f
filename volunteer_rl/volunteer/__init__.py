"""A volunteer: follow the signed manifest, fetch checkpoints safely, number groups, sample
each for the prompt its number draws from the manifest's pool with its committed noise,
upload shards, beat its heart; and the unit that runs it as a login service (`service`).

May import: model, task, protocol, storage and the shared modules.
"""
