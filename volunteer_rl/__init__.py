"""volunteer_rl: reinforcement learning for language models with volunteers' machines as
generators and an object-storage bucket as the only thing trainer and volunteers share.

Rooms, named after roles, each importing only the rooms below it (checked by import-linter,
see .importlinter):

    demo                  the whole system as processes on one machine
    trainer, volunteer    the two programs
    observe               status and the dashboard
    model, task           the policy as tensors; the calculator and its reward
    protocol              every object in the bucket: keys, schemas, readers, writers
    storage               the bucket itself
    config, errors, faults, progress   shared by all

docs/ARCHITECTURE.md follows a group from a volunteer's sampler to a gradient step. Nothing
heavy is imported here, so `vrl --help` stays instant.
"""

__version__ = "0.1.0"
