"""volunteer_rl: reinforcement learning for language models with volunteers' machines as
generators and an object-storage bucket as the only thing trainer and volunteers share.

Modules, one concept each: layout (bucket keys), storage (the bucket), manifest and checkpoint
(the commit point and the files it names), shards (rollout files), task (the calculator),
policy (model, tokenizer, sampling), losses (pure), warmstart, evaluate, ingest, trainer,
volunteer, demo. Nothing heavy is imported here, so `vrl --help` stays instant.
"""

__version__ = "0.1.0"
