"""The policy as tensors: devices and threads, the tiny model and its tokenizer, checkpoints
(what one may be, checked before any download: vetting; the sha256 of its pieces: hashing;
a version's weights from its keyframe and patches: chain; publishing and fetching:
checkpoint), safetensors weights I/O, sampling (with committed Gumbel noise), scoring, and
the replay of a committed draw.

May import: protocol, storage and the shared modules. Not task: a model does not know what a
reward is.
"""
