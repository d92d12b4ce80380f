"""Reading a safetensors weights file into a model's own tensors: the header parsed and every
tensor checked against the model before the first byte is copied (`fitted`), then either
copied from bytes already in memory (model.weights.load_weights) or streamed from the file a
piece at a time (`stream_into`).

The format: 8 bytes of header length, a JSON header naming each tensor's dtype, shape and byte
range, then the raw bytes. Streaming matters for the biggest read of all, loading a model
folder (model.policy.load_policy): transformers' from_pretrained maps the whole file and the
pages it touches stay resident until the load ends, so a bf16 Qwen3-0.6B loaded into an fp32
model peaked at 3.69 GiB against 2.58 GiB once loaded. Read a piece at a time, the file costs
one piece (PIECE) above the model.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from volunteer_rl.errors import VrlError
from volunteer_rl.model.vetting import WEIGHTS_FILE

ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
             torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
             torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
"""The safetensors name of each torch dtype a weights file may hold."""
ST_TORCH = {v: k for k, v in ST_DTYPES.items()}

PIECE = 16 << 20
"""Bytes read, written or cast at a time."""

MAX_HEADER_BYTES = 100 << 20
"""The safetensors format's own limit on a header."""

Header = dict[str, tuple[torch.dtype, list[int], list[int]]]
"""Each tensor's (dtype, shape, [begin, end) byte range after the header)."""


class WeightsError(VrlError, ValueError):
    """A weights file that is not safetensors or does not fit the model (names the file)."""


def header_length(first8: bytes, file_bytes: int, name: str) -> int:
    """The header's length, from a file's first 8 bytes; WeightsError naming the file unless
    it fits in the file and in MAX_HEADER_BYTES."""
    n = int.from_bytes(first8[:8], "little")
    if file_bytes < 8 or n > min(MAX_HEADER_BYTES, file_bytes - 8):
        raise WeightsError(f"{name}: not a safetensors file (a header of {n:,} bytes in a "
                           f"file of {file_bytes:,})")
    return n


def parse_header(head: bytes, name: str) -> Header:
    """The tensors a safetensors header names (WeightsError naming the file if it is not one)."""
    try:
        header = json.loads(head)
        header.pop("__metadata__", None)
        return {k: (ST_TORCH[v["dtype"]], [int(d) for d in v["shape"]],
                    [int(o) for o in v["data_offsets"]]) for k, v in header.items()}
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise WeightsError(f"{name}: not a safetensors file ({type(exc).__name__}: {exc})") from None


def fitted(model: torch.nn.Module, header: Header, data_start: int, file_bytes: int,
           name: str) -> dict[str, torch.Tensor]:
    """The model's tensors (state dict, parameters themselves) that `header` fills, once every
    one of them is checked: the same names (a tied lm_head may be missing), each tensor's shape,
    and a byte range of the right length inside the file's `file_bytes`. WeightsError naming
    the file otherwise."""
    targets = model.state_dict(keep_vars=True)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    missing = set(targets) - set(header) - tied
    unexpected = sorted(set(header) - set(targets))
    if missing or unexpected:
        raise WeightsError(f"{name}: weights do not fit the model "
                           f"(missing {sorted(missing)[:3]}, unexpected {unexpected[:3]})")
    for key, (dtype, shape, (begin, end)) in header.items():
        target = targets[key]
        if list(target.shape) != shape or end - begin != math.prod(shape) * dtype.itemsize \
                or begin < 0 or data_start + end > file_bytes:
            raise WeightsError(f"{name}: {key} has shape {shape} (bytes {begin}-{end}), "
                               f"the model {list(target.shape)}")
    return targets


def view(buf: memoryview, base: int, dtype: torch.dtype, shape: list[int],
         begin: int) -> torch.Tensor:
    """A tensor over `buf`'s bytes (no copy) at `base + begin`."""
    count = math.prod(shape)
    src = torch.frombuffer(buf, dtype=dtype, count=count, offset=base + begin) if count \
        else torch.empty(0, dtype=dtype)
    return src.view(shape)


def stream_into(model: torch.nn.Module, path: Path) -> list[torch.Tensor]:
    """Copy the safetensors file at `path` into `model`'s own tensors (cast to their dtype,
    bf16 into fp32 exactly), reading PIECE bytes at a time, so the file never sits in memory
    beside the model. Every tensor is checked (`fitted`) before the first is copied: a file
    that does not fit (WeightsError naming it) leaves the model as it was. Returns the
    tensors filled."""
    path = Path(path)
    name = path.name if path.name == WEIGHTS_FILE else str(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        n = header_length(f.read(8), size, name)
        header = parse_header(f.read(n), name)
        targets = fitted(model, header, 8 + n, size, name)
        piece = bytearray(PIECE)
        filled = []
        with torch.no_grad():
            for key, (dtype, shape, (begin, end)) in sorted(header.items(), key=lambda kv: kv[1][2][0]):
                dst = targets[key].view(-1)
                step = max(1, PIECE // dtype.itemsize)
                f.seek(8 + n + begin)
                for i in range(0, math.prod(shape), step):
                    count = min(step, dst.numel() - i)
                    got = f.readinto(memoryview(piece)[:count * dtype.itemsize])
                    if got != count * dtype.itemsize:  # the file shrank under us
                        raise WeightsError(f"{name}: {key} ends early")
                    dst[i:i + count].copy_(torch.frombuffer(piece, dtype=dtype, count=count))
                filled.append(targets[key])
    return filled
