"""The policy as tensors: devices and threads, the tiny model and its tokenizer, checkpoint
files and their checks before any download, safetensors weights I/O, sampling (with
committed Gumbel noise), scoring, and the replay of a committed draw.

May import: protocol, storage and the shared modules. Not task: a model does not know what a
reward is.
"""
