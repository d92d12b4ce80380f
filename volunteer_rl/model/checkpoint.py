"""Publishing and fetching immutable checkpoint folders (`checkpoints/v000042/...`).

Write order (restic's rule): every file of the version first, each verified present at its
size, and only then the manifest that points at them (see `trainer.publish`). Read order is
the reverse: the manifest, then each file, each checked against the manifest's sha256 (the
weights file: its pieces' sha256s) before anything is loaded from it.

Big files stream: the trainer's weights file is made in memory, hashed by pieces on every
core while it uploads (`trainer.publish`, `upload_buffer`), and a volunteer's comes from the
bucket into one buffer, its pieces hashed as they land (`fetch_weights`), and is copied into the
model only after every hash matched. Hashing runs in threads of its own (hashlib releases
the GIL on big buffers), so it overlaps the writing or the reading of the next piece.

A signature says who wrote a manifest, not that what it names is harmless: a stolen key, or
a trainer host someone else controls, can list any file. So a reader also limits what a
checkpoint may be, before it downloads anything (`check_checkpoint`, run by every fetch):
only the file names in CHECKPOINT_FILES (no code, no pickle, no paths), each under its size
cap (`check_files`); and config.json is fetched first and checked before the weights are
(`check_model_config`): nothing in it may ask transformers to run code, every dimension that
sizes a tensor is bounded, the model it describes must fit MAX_MODEL_FP32_BYTES, and the
weights file the manifest lists must be the size those parameters take. `load_policy` runs
the same config checks on any folder it loads (`check_model_folder`), and loads it with
remote code off, local files only, safetensors only.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable

from volunteer_rl.errors import VrlError
from volunteer_rl.faults import crash_point
from volunteer_rl.progress import progress
from volunteer_rl.protocol import layout
from volunteer_rl.protocol.manifest import (
    PIECE_BYTES,
    FileEntry,
    Keyframe,
    Link,
    Manifest,
    Weights,
    WeightsEntry,
    pieces_root,
)
from volunteer_rl.storage.base import ShortObject, Storage, StorageError, TooLarge

# A checkpoint file larger than this is refused before download (volunteers bound what they
# read too). 64 GiB leaves room for multi-billion-parameter models in one safetensors file.
MAX_CHECKPOINT_FILE_BYTES = 64 << 30


class CheckpointError(VrlError):
    """A checkpoint file is missing, too large, or its bytes do not match the manifest. The
    message is one line naming the file."""


class CheckpointRefused(CheckpointError):
    """A checkpoint refused for what it is, not for bytes that failed to arrive: a file it
    may not hold, a config that asks for code or kernels or describes a model out of bounds,
    weights of another size than the config's. Fetching it again cannot help, so a volunteer
    that holds no model yet stops on it (Volunteer.try_switch)."""


# ---------------------------------------------------------------------------------------------
# What a checkpoint may hold.

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
VRL_CONFIG = "vrl.json"  # small side file in every checkpoint: how to prompt this model
MAX_CONFIG_BYTES = 1 << 20
"""config.json, generation_config.json, vrl.json: a few KB each; a Gemma 3 config is 2 KB."""
MAX_TOKENIZER_FILE_BYTES = 128 << 20
"""Each tokenizer file. Gemma 3's tokenizer.json (262k tokens) is 33 MB, the biggest we know."""

CHECKPOINT_FILES = {
    WEIGHTS_FILE: MAX_CHECKPOINT_FILE_BYTES,
    CONFIG_FILE: MAX_CONFIG_BYTES,
    "generation_config.json": MAX_CONFIG_BYTES,
    VRL_CONFIG: MAX_CONFIG_BYTES,
    # What a tokenizer's save_pretrained writes. transformers 5 writes the first three for
    # Llama, Qwen3, Gemma 3 and GPT-2 tokenizers alike; 4.x also writes special_tokens_map.json
    # and, for a tokenizer with a slow twin, that one's files: vocab.json and merges.txt
    # (GPT-2, Qwen), tokenizer.model (SentencePiece: Llama 2, Gemma), added_tokens.json.
    "tokenizer.json": MAX_TOKENIZER_FILE_BYTES,
    "tokenizer_config.json": MAX_TOKENIZER_FILE_BYTES,
    "chat_template.jinja": MAX_TOKENIZER_FILE_BYTES,
    "special_tokens_map.json": MAX_TOKENIZER_FILE_BYTES,
    "added_tokens.json": MAX_TOKENIZER_FILE_BYTES,
    "vocab.json": MAX_TOKENIZER_FILE_BYTES,
    "merges.txt": MAX_TOKENIZER_FILE_BYTES,
    "tokenizer.model": MAX_TOKENIZER_FILE_BYTES,
}
"""Every file name a checkpoint may list, with its size cap: what `save_policy` writes, and no
more. Not on it, on purpose: code (*.py, which transformers runs for a config's auto_map),
pickles (pytorch_model.bin, *.pt: unpickling runs code), sharded weights (the trainer writes
one file, and model.safetensors.index.json names further paths for transformers to open),
and anything else (README.md, processor configs): nothing here loads it, so nothing fetches it.
A name added here is a protocol change: older readers refuse manifests that list it, and
`publish_checkpoint` refuses to publish any other."""


def _file_refusal(name: str, size: int) -> str | None:
    """Why a checkpoint may not hold a file of this name and size; None if it may."""
    cap = CHECKPOINT_FILES.get(name)
    if cap is None:
        return ("is not a file a checkpoint may hold (weights, configs and tokenizer files "
                "only: no code, no pickle, no paths)")
    if not 0 <= size <= cap:
        return f"is {size:,} bytes, over the {cap:,}-byte limit for that file"
    return None


def check_files(manifest: Manifest) -> None:
    """CheckpointRefused unless every file the manifest lists is one a checkpoint may hold,
    under its size cap. Readers call it before they fetch anything of the checkpoint, so a
    listed .py or pickle is never downloaded, let alone given to transformers."""
    for name, entry in manifest.files.items():
        reason = _file_refusal(name, entry.size)
        if reason:  # repr: a name from the bucket may hold anything, newlines included
            raise CheckpointRefused(f"{layout.MANIFEST}: v{manifest.version} lists {name!r}, "
                                    f"which {reason}; refused before downloading the checkpoint")


# Every config field that sizes a tensor (or a Python loop in the config's own __init__, as
# `layer_types` is built from num_hidden_layers), with the largest value accepted. The real
# models are far inside: Llama 3.1 405B has hidden 16,384, MLP 53,248, 126 layers, 128 heads;
# Gemma 3 the biggest vocabulary (262,208) and head_dim (256); Qwen3 30B-A3B 128 experts.
# Checked wherever the key appears, nested configs (text_config, vision_config) included.
DIM_LIMITS = {
    "vocab_size": 1 << 22,
    "hidden_size": 1 << 16, "n_embd": 1 << 16, "d_model": 1 << 16,
    "intermediate_size": 1 << 18, "n_inner": 1 << 18, "moe_intermediate_size": 1 << 18,
    "num_hidden_layers": 512, "n_layer": 512, "num_layers": 512,
    "num_attention_heads": 1024, "n_head": 1024, "num_key_value_heads": 1024,
    "head_dim": 4096,
    "max_position_embeddings": 1 << 24, "n_positions": 1 << 24, "n_ctx": 1 << 24,
    "num_experts": 1024, "num_local_experts": 1024, "n_routed_experts": 1024,
}
_MAY_BE_NULL = {"n_inner", "num_key_value_heads", "head_dim", "moe_intermediate_size",
                "num_experts", "num_local_experts", "n_routed_experts"}  # null: derived
_MAY_BE_ZERO = {"num_experts", "num_local_experts", "n_routed_experts"}  # 0: a dense model
_LOOP_SUFFIXES = (("layers", "num_hidden_layers"), ("n_layer", "num_hidden_layers"),
                  ("experts", "num_experts"))
"""Any other integer field named like a layer or expert count (decoder_layers, which sizes
BartForCausalLM; num_shared_experts) is held to that count's limit: such counts drive Python
loops, which the meta device does not make free. Non-integers (mlp_only_layers, a list) pass."""
MAX_LAYER_EXPERTS = 1 << 16
"""layers x experts, at most: what building the model on the meta device costs grows with it
(DeepSeek-V3: 61 x 256 = 15,616)."""

MAX_MODEL_FP32_BYTES = 64 << 30
"""The largest model a reader builds: its parameters and buffers in fp32, as the volunteer
holds them, at most this many bytes (about 17 B parameters). The same as the largest
checkpoint file: a bigger model's fp32 weights could not be published in one. A volunteer
without the memory fails on its own; this only keeps a config from asking for more."""

# Config keys that make transformers fetch and run code: auto_map points at .py files (in
# the folder or on the hub); an attention or experts implementation other than the built-in
# ones is a kernel downloaded from the hub (with the `kernels` package installed, even
# flash_attention_2 falls back to one); a quantization config loads quantizer libraries,
# some of which fetch hub kernels too (mxfp4), and vrl runs plain fp32 weights anyway.
_CODE_KEYS = {"auto_map": "asks transformers to run code shipped with the checkpoint",
              "quantization_config": "asks for quantized weights, which load through kernels "
                                     "and libraries vrl does not use"}
_IMPLEMENTATION_KEYS = {"attn_implementation", "_attn_implementation", "experts_implementation",
                        "_experts_implementation"}
_BUILTIN_IMPLEMENTATIONS = {"eager", "sdpa", "grouped_mm", "batched_mm"}
_NO_CODE = "volunteer_rl never runs code or kernels from a checkpoint"


class _Refused(Exception):
    """Why a config is refused, without the file's name (check_model_config adds it)."""


def _check_config_values(obj: dict, where: str = "", depth: int = 0) -> None:
    """The key checks of one config dict and of the dicts nested in it (sub-configs)."""
    if depth > 8:
        raise _Refused("nested more than 8 levels deep")
    for key, value in obj.items():
        path = f"{where}{key if key.isprintable() else repr(key)}"  # messages stay one line
        if key in _CODE_KEYS:
            raise _Refused(f"{path} {_CODE_KEYS[key]}; {_NO_CODE}")
        if key in _IMPLEMENTATION_KEYS:
            names = value.values() if isinstance(value, dict) else [value]
            if not all(v is None or (isinstance(v, str) and v in _BUILTIN_IMPLEMENTATIONS)
                       for v in names):
                raise _Refused(f"{path} is {value!r:.80}, not one of "
                               f"{', '.join(sorted(_BUILTIN_IMPLEMENTATIONS))}: other names are "
                               f"kernels fetched from the hub; {_NO_CODE}")
        if key in DIM_LIMITS:
            if value is None and key in _MAY_BE_NULL:
                continue
            low = 0 if key in _MAY_BE_ZERO else 1
            # bool is an int in Python: `true` must not pass as 1
            if type(value) is not int or not low <= value <= DIM_LIMITS[key]:
                raise _Refused(f"{path} is {value!r:.40}, not an integer in "
                               f"{low}..{DIM_LIMITS[key]:,}")
        elif isinstance(value, int):
            for suffix, like in _LOOP_SUFFIXES:
                if key.endswith(suffix) and value > DIM_LIMITS[like]:
                    raise _Refused(f"{path} is {str(value)[:40]}, over {DIM_LIMITS[like]:,} (the "
                                   f"limit for {like})")
        if isinstance(value, dict):
            _check_config_values(value, f"{path}.", depth + 1)
    layers = max((obj.get(k) for k in ("num_hidden_layers", "n_layer", "num_layers")
                  if isinstance(obj.get(k), int)), default=1)
    experts = max((obj.get(k) for k in ("num_experts", "num_local_experts", "n_routed_experts")
                   if isinstance(obj.get(k), int)), default=1)
    if layers * max(experts, 1) > MAX_LAYER_EXPERTS:
        raise _Refused(f"{where}{layers} layers of {experts} experts, more than "
                       f"{MAX_LAYER_EXPERTS:,} in all")


def _json_object(data: bytes) -> dict:
    """The JSON object of a config file's bytes, after the key checks (_check_config_values)."""
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError) as exc:  # RecursionError: [[[[... nested too deep
        raise _Refused(f"not JSON ({type(exc).__name__}: {str(exc)[:200]})") from None
    if not isinstance(raw, dict):
        raise _Refused("not a JSON object")
    _check_config_values(raw)
    return raw


@dataclass(frozen=True)
class ModelShape:
    """What a config makes transformers allocate: counted, not estimated (see _model_shape)."""

    params: int        # parameters and persistent buffers, tied ones once
    float_params: int  # those that are floating point (cast on publish)
    other_bytes: int   # bytes of the others (integer buffers), as they are
    tensors: int       # tensors a checkpoint of it stores
    fp32_bytes: int    # every parameter and buffer (non-persistent ones too) in fp32

    def weights_bytes(self, dtype_itemsize: int) -> int:
        """Bytes of tensor data in a safetensors file of it, floats in that many bytes each."""
        return self.float_params * dtype_itemsize + self.other_bytes


def _model_shape(raw: dict) -> ModelShape:
    """Build the model a checked config describes on torch's meta device, where tensors have
    a shape and no memory, and count its tensors: exactly what from_pretrained will allocate,
    for any architecture transformers knows, without allocating it. A formula per
    architecture would miss what it does not know (vision towers, per-layer embeddings,
    expert layouts); this runs transformers' own classes, never code from the checkpoint
    (`auto_map` was refused), with every dimension already bounded, so building costs at most
    a second or two. _Refused if transformers cannot build it or it exceeds MAX_MODEL_FP32_BYTES."""
    import torch
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise _Refused(f"model_type {model_type!r:.60} is not an architecture transformers knows")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = CONFIG_MAPPING[model_type].from_dict(dict(raw))
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config, trust_remote_code=False,
                                                         dtype=torch.float32)
    except Exception as exc:  # whatever the config made transformers raise is the config's fault
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise _Refused(f"transformers cannot build a causal LM from it "
                       f"({type(exc).__name__}: {first})") from None
    # state_dict as a checkpoint stores it: a tied lm_head is the embedding's very Parameter,
    # counted once (on meta every data_ptr is 0, so identity, not address, tells them apart)
    stored = {id(t): t for t in model.state_dict(keep_vars=True).values()}.values()
    held = {id(t): t for t in (*model.parameters(), *model.buffers())}.values()
    floats = sum(t.numel() for t in stored if t.is_floating_point())
    other = sum(t.numel() * t.element_size() for t in stored if not t.is_floating_point())
    fp32 = sum(t.numel() * (4 if t.is_floating_point() else t.element_size()) for t in held)
    shape = ModelShape(sum(t.numel() for t in stored), floats, other, len(stored), fp32)
    if shape.fp32_bytes > MAX_MODEL_FP32_BYTES:
        raise _Refused(f"describes a model of {shape.params:,} parameters, "
                       f"{shape.fp32_bytes:,} bytes in fp32, over the "
                       f"{MAX_MODEL_FP32_BYTES:,}-byte limit (MAX_MODEL_FP32_BYTES)")
    return shape


_WEIGHTS_ITEMSIZE = {"float32": 4, "bfloat16": 2}
_HEADER_BYTES_PER_TENSOR = 1024  # a safetensors header entry is ~100-200 bytes: name, dtype, shape, offsets


def check_weights_size(shape: ModelShape, entry: WeightsEntry, weights_dtype: str, key: str) -> None:
    """CheckpointRefused unless a safetensors file of `shape`'s tensors, floats in
    `weights_dtype`, could be `entry.size` bytes long: its data exactly, plus 8 bytes and a
    header of 2 bytes up to 4 KiB + 1 KiB per tensor. A listed size that is not that is
    refused before the reader allocates a buffer for it."""
    itemsize = _WEIGHTS_ITEMSIZE.get(weights_dtype)
    if itemsize is None:
        raise CheckpointRefused(f"{layout.MANIFEST}: weights_dtype {weights_dtype!r:.40} is not "
                                f"float32 or bfloat16")
    data = shape.weights_bytes(itemsize)
    least, most = data + 10, data + 8 + 4096 + _HEADER_BYTES_PER_TENSOR * shape.tensors
    if not least <= entry.size <= most:
        raise CheckpointRefused(
            f"{key}: {entry.size:,} bytes in manifest.json, but config.json describes "
            f"{shape.params:,} parameters: {data:,} bytes of {weights_dtype} data, "
            f"{least:,}-{most:,} bytes with the header")


_SHAPES: OrderedDict[str, ModelShape | None | str] = OrderedDict()
"""Checked configs by the sha256 of their bytes: the ModelShape, None (no model_type) or why
the config is refused. The volunteer checks one at fetch, at load and at every weights swap,
and retries a refused one at every poll: it is built on the meta device only once."""


def _verdict(sha: str, data: Callable[[], bytes]) -> ModelShape | None | str:
    """The cached verdict on the config of this sha256, computed from `data()` if not cached
    (`data()` must return bytes of that sha256)."""
    if sha not in _SHAPES:
        try:
            raw = _json_object(data())
            _SHAPES[sha] = _model_shape(raw) if "model_type" in raw else None
        except _Refused as exc:
            _SHAPES[sha] = str(exc)
        while len(_SHAPES) > 8:
            _SHAPES.popitem(last=False)
    return _SHAPES[sha]


def _shape(verdict: ModelShape | None | str, name: str, require_model: bool) -> ModelShape | None:
    if isinstance(verdict, str):
        raise CheckpointRefused(f"{name}: {verdict}")
    if verdict is None and require_model:
        raise CheckpointRefused(f"{name}: no model_type; not a transformers model config")
    return verdict


def check_model_config(data: bytes, name: str, require_model: bool = False) -> ModelShape | None:
    """Check config.json's bytes: its keys (no code, no kernels, every dimension bounded),
    then the model it describes, built on the meta device (MAX_MODEL_FP32_BYTES); its
    ModelShape. CheckpointRefused naming `name` (the file's key or path) otherwise.

    A config with no model_type describes no model: None, unless `require_model` (the
    loader's case: transformers would guess the architecture from the folder's path)."""
    return _shape(_verdict(sha256_bytes(data), lambda: data), name, require_model)


def check_checkpoint(storage: Storage, manifest: Manifest,
                     require_model: bool = False) -> ModelShape | None:
    """Everything a reader checks of the manifest's checkpoint before it downloads any of it:
    the files it lists (check_files); config.json, fetched first and verified
    (check_model_config); the listed size of model.safetensors against the model that config
    describes, in the manifest's weights_dtype (check_weights_size). `require_model`: the
    manifest must list both files and the config must name a model_type (what volunteers and
    `vrl eval` load; a reader that does not says nothing about files it does not fetch).
    A config seen before (by sha256) is not fetched again."""
    check_files(manifest)
    config, weights = manifest.files.get(CONFIG_FILE), manifest.files.get(WEIGHTS_FILE)
    if require_model and (config is None or weights is None):
        missing = CONFIG_FILE if config is None else WEIGHTS_FILE
        raise CheckpointRefused(f"{layout.MANIFEST}: v{manifest.version} lists no {missing}; "
                                f"not a model checkpoint")
    if config is None:
        return None
    key = layout.checkpoint_key(manifest.version, CONFIG_FILE)
    shape = _shape(_verdict(config.sha256, lambda: bytes(read_verified(storage, key, config))),
                   key, require_model)
    if shape is not None and weights is not None:
        check_weights_size(shape, weights, manifest.weights_dtype,
                           layout.checkpoint_key(manifest.version, WEIGHTS_FILE))
    return shape


_SIDE_CONFIGS = ("tokenizer_config.json", "generation_config.json")
"""Read by from_pretrained besides config.json; held to the same key checks (a tokenizer's
auto_map asks for code too)."""
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


def check_model_folder(folder: Path) -> ModelShape:
    """The loader's checks on a local model folder, before transformers reads any of it:
    config.json (check_model_config, a model required), safetensors weights present (one
    model.safetensors, or the index of a sharded local folder), and the key checks on
    tokenizer_config.json and generation_config.json. CheckpointRefused naming the file."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointRefused(f"{folder}: not a local model folder")
    config = folder / CONFIG_FILE
    if not config.is_file():
        raise CheckpointRefused(f"{config}: missing; not a model folder")
    shape = check_model_config(_read_capped(config, MAX_CONFIG_BYTES), str(config),
                               require_model=True)
    if not (folder / WEIGHTS_FILE).is_file() and not (folder / f"{WEIGHTS_FILE}.index.json").is_file():
        pickles = sorted(p.name for p in folder.iterdir() if p.name.endswith(_PICKLE_SUFFIXES))
        found = f" (found {', '.join(pickles)[:120]}: pickled weights are never loaded)" if pickles else ""
        raise CheckpointRefused(f"{folder / WEIGHTS_FILE}: missing; volunteer_rl loads "
                                f"safetensors weights only{found}")
    for name in _SIDE_CONFIGS:
        if (folder / name).is_file():
            read_json_object(folder / name, CHECKPOINT_FILES[name])
    return shape


def read_json_object(path: Path, cap: int = MAX_CONFIG_BYTES) -> dict:
    """A small JSON file of a model folder, after the config key checks (no code, no kernels,
    bounded dimensions); CheckpointRefused naming the file otherwise."""
    try:
        return _json_object(_read_capped(path, cap))
    except _Refused as exc:
        raise CheckpointRefused(f"{path}: {exc}") from None


def _read_capped(path: Path, cap: int) -> bytes:
    with open(path, "rb") as f:
        data = f.read(cap + 1)
    if len(data) > cap:
        raise CheckpointRefused(f"{path}: over the {cap:,}-byte limit for that file")
    return data

CHUNK = 16 << 20
"""Bytes per piece handed to the hash thread and to the sink."""


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Hasher:
    """sha256 of a stream, computed in a thread of its own while the caller moves the next
    piece. Pieces must stay unchanged until hashed (they are views, never copies); at most
    `depth` wait at once, so a fast producer cannot pile up memory."""

    def __init__(self, depth: int = 4):
        self.depth = depth
        self.pool = ThreadPoolExecutor(1)
        self.pending: deque[Future] = deque()
        self.reset()

    def reset(self) -> None:
        """Start over (a retried read begins again at offset 0)."""
        self._drain()
        self.h, self.size = hashlib.sha256(), 0

    def update(self, piece) -> None:
        piece = memoryview(piece).cast("B")
        while len(self.pending) >= self.depth:
            self.pending.popleft().result()
        self.pending.append(self.pool.submit(self.h.update, piece))
        self.size += len(piece)

    def add(self, offset: int, piece: memoryview) -> None:
        """`Storage.read_into`'s on_chunk: pieces in order; offset 0 again means a retry."""
        if offset == 0 and self.size:
            self.reset()
        if offset != self.size:
            raise CheckpointError(f"piece at {offset} out of order (expected {self.size})")
        self.update(piece)

    def _drain(self) -> None:
        while self.pending:
            self.pending.popleft().result()

    def entry(self) -> FileEntry:
        """sha256 and size of everything so far; the hash thread is shut down."""
        self._drain()
        self.pool.shutdown()
        return FileEntry(self.h.hexdigest(), self.size)


class HashingSink:
    """A file-like for `Storage.create_from` writers: every write is hashed (in the Hasher's
    thread) and passed on to the storage sink in CHUNK pieces, so both proceed together."""

    def __init__(self, sink: BinaryIO):
        self.sink, self.hasher = sink, Hasher()

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), CHUNK):
            piece = view[start:start + CHUNK]
            self.hasher.update(piece)
            self.sink.write(piece)
        return len(view)


def _copy_file(path: Path) -> Callable[[BinaryIO], None]:
    """A writer that streams a local file in CHUNK pieces."""
    def write(out) -> None:
        with open(path, "rb", buffering=0) as f:
            while piece := f.read(CHUNK):
                out.write(piece)
    return write


def upload_stream(storage: Storage, key: str, write: Callable[[BinaryIO], None]) -> FileEntry:
    """Create `key` from what `write(f)` writes, hashing it on the way; its FileEntry.

    A retried attempt (Retrying) calls `write` again on a new sink, with a new hash."""
    entries: list[FileEntry] = []

    def attempt(sink: BinaryIO) -> None:
        hashing = HashingSink(sink)
        try:
            write(hashing)
        finally:
            entries.append(hashing.hasher.entry())

    storage.create_from(key, attempt)
    return entries[-1]


def upload_buffer(storage: Storage, key: str, buf: memoryview,
                  ready: Callable[[int], None] = lambda end: None) -> None:
    """Create `key` from `buf` and check the object's size after. Not hashed on the way, unlike
    upload_stream: the caller hashes this very buffer, immutable in memory once made, so a
    second pass over a multi-GB file would prove nothing and cost a core for seconds.
    `ready(end)` returns once buf[:end] is made (Filling.wait: the upload follows the making)."""
    view = memoryview(buf).cast("B")

    def write(sink: BinaryIO) -> None:
        for start in range(0, len(view), CHUNK):
            end = min(start + CHUNK, len(view))
            ready(end)
            sink.write(view[start:end])

    storage.create_from(key, write)
    if storage.size(key) != len(view):
        raise CheckpointError(f"{key}: size after upload differs from {len(view)} bytes")


def publish_checkpoint(storage: Storage, version: int, folder: Path
                       ) -> dict[str, FileEntry | WeightsEntry]:
    """Upload every file of `folder` under checkpoints/vNNNNNN/, then verify each one landed.
    (The trainer's folder holds no weights file: it uploads that from memory, upload_buffer.
    One that is there goes up whole, listed by its root; keyframe_weights gives the
    manifest's `weights` for it.)

    Returns the per-file sha256 (the weights file: its root) and size for the manifest,
    hashed from the very bytes sent.
    Objects are created write-once: a version folder that already holds the file is an
    error (AlreadyExists), not an overwrite. A file readers would refuse (check_files) is
    CheckpointRefused before anything is uploaded.
    """
    entries: dict[str, FileEntry | WeightsEntry] = {}
    writers = {p.name: _copy_file(p) for p in sorted(Path(folder).iterdir()) if p.is_file()}
    sizes = {p.name: p.stat().st_size for p in Path(folder).iterdir() if p.is_file()}
    for name in writers:  # what readers refuse is not published
        reason = _file_refusal(name, sizes[name])
        if reason:
            raise CheckpointRefused(f"{Path(folder) / name} {reason}; readers refuse a "
                                    f"checkpoint holding it, so v{version} is not published")
    with progress(f"upload v{version}", sum(sizes.values()), unit_bytes=True) as advance:
        for name, write in sorted(writers.items()):
            key = layout.checkpoint_key(version, name)
            if name == WEIGHTS_FILE:  # under its size cap: checked above
                data = memoryview((Path(folder) / name).read_bytes())
                upload_buffer(storage, key, data)
                entry = keyframe_weights(version, data)[0]
            else:
                entry = upload_stream(storage, key, write)
            crash_point("checkpoint_upload")
            entries[name] = entry
            advance(sizes.get(name, 0))
    for name, entry in entries.items():
        key = layout.checkpoint_key(version, name)
        if storage.size(key) != entry.size:
            raise CheckpointError(f"{key}: size after upload differs from {entry.size} bytes")
    return entries


def fetch_checkpoint(storage: Storage, manifest: Manifest, dest: Path,
                     only: list[str] | None = None, require_model: bool = False,
                     weights: memoryview | None = None) -> Path:
    """Download the manifest's checkpoint into `dest`, verifying every sha256 and size.

    Nothing is downloaded (nor `dest` created) before `check_checkpoint(storage, manifest,
    require_model)` passed: volunteers and `vrl eval` pass require_model=True.
    `only` restricts the download to some files. The weights file comes from `weights` if
    given (a buffer fetch_weights returned for this manifest), else from build_weights (the
    keyframe and the patches after it). Files land under a temp name and are renamed when
    verified, so `dest` never holds bytes that did not match. A full fetch also removes files
    the manifest does not name (left by another version or bucket), so a loader reading the
    whole folder reads only files checked against this manifest.
    """
    check_checkpoint(storage, manifest, require_model)
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    wanted = {n: e for n, e in manifest.files.items() if only is None or n in only}
    with progress(f"fetch v{manifest.version}", sum(e.size for e in wanted.values()),
                  unit_bytes=True) as advance:
        for name, entry in wanted.items():
            if name == WEIGHTS_FILE:  # a manifest that lists it has weights (its schema)
                data = weights if weights is not None else build_weights(storage, manifest).buf
                _write_file(data, dest / name)
            else:
                _fetch_file(storage, layout.checkpoint_key(manifest.version, name), entry, dest / name)
            advance(entry.size)
    if only is None:
        for path in dest.iterdir():
            if path.is_file() and path.name not in manifest.files:
                path.unlink()
    return dest


def byte_buffer(size: int, reuse: memoryview | None = None) -> memoryview:
    """A buffer of `size` bytes: `reuse` if it has that size (a fresh multi-GB buffer costs a
    page fault per 4 KiB page on first touch, which took longer than reading a file into it),
    else a new one, not zero-filled: its callers overwrite every byte."""
    import numpy as np

    if reuse is not None and len(reuse) == size:
        return reuse
    return memoryview(np.empty(size, dtype=np.uint8))


def read_verified(storage: Storage, key: str, entry: FileEntry,
                  reuse: memoryview | None = None) -> memoryview:
    """The object's bytes in a buffer of exactly `entry.size`, hashed while they arrive;
    CheckpointError unless size and sha256 match the manifest. Nothing may use the buffer
    before this returns: it is the only check between an untrusted bucket and the model.

    `reuse`, a buffer an earlier call returned, is filled again if it has the right size
    (byte_buffer). On failure its content is garbage, never used."""
    if entry.size > MAX_CHECKPOINT_FILE_BYTES:
        raise CheckpointError(f"{key}: {entry.size} bytes exceeds the checkpoint file limit")
    buf = byte_buffer(entry.size, reuse)
    hasher = Hasher()
    try:
        storage.read_into(key, buf, hasher.add)
    except (TooLarge, ShortObject):
        raise CheckpointError(f"{key}: sha256 or size does not match manifest.json") from None
    finally:
        got = hasher.entry()
    if got != entry:
        raise CheckpointError(f"{key}: sha256 or size does not match manifest.json")
    return buf


# ---------------------------------------------------------------------------------------------
# Weights: pieces hashed on every core, and rebuilt from a keyframe and patches.

def piece_hashes(buf, piece_bytes: int, workers: int = 0,
                 ready: Callable[[int], None] = lambda end: None) -> list[str]:
    """sha256 of every `piece_bytes` slice of `buf`, computed on `workers` threads (0: one per
    CPU; hashlib releases the GIL on big buffers, so they run on all cores). Each piece is
    hashed once `ready(its end)` returns (Filling.wait: while the buffer is being made)."""
    view = memoryview(buf).cast("B")
    starts = range(0, len(view), piece_bytes)

    def one(start: int) -> str:
        end = min(start + piece_bytes, len(view))
        ready(end)
        return sha256_bytes(view[start:end])

    if len(starts) <= 1:
        return [one(i) for i in starts]
    with ThreadPoolExecutor(min(len(starts), workers or os.cpu_count() or 1)) as pool:
        return list(pool.map(one, starts))


def keyframe_weights(version: int, buf, piece_bytes: int = PIECE_BYTES
                     ) -> tuple[WeightsEntry, Weights]:
    """files["model.safetensors"] and `weights` of version `version` published whole, its
    weights file the bytes `buf`: the pieces hashed, the root made of them."""
    size = len(memoryview(buf).cast("B"))
    pieces = piece_hashes(buf, piece_bytes)
    entry = WeightsEntry(pieces_root(piece_bytes, size, pieces), size)
    return entry, Weights(piece_bytes, tuple(pieces), Keyframe(version, entry.root, entry.size))


class Filling:
    """How much of a buffer being made is made, for threads that follow the maker: each waits
    (`wait(end)`) for the bytes it needs, and the maker says how far it got (`made`) or that
    it failed (`fail`: every waiter raises instead of waiting for ever)."""

    def __init__(self):
        import threading

        self.cond = threading.Condition()
        self.end, self.error = 0, None

    def made(self, end: int) -> None:
        with self.cond:
            self.end = end
            self.cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self.cond:
            self.error = error
            self.cond.notify_all()

    def wait(self, end: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.end >= end or self.error is not None)
            if self.end < end:
                raise CheckpointError(f"the weights file was not made ({self.error})")


class PieceHasher:
    """`Storage.read_into`'s on_chunk: hashes each piece of the buffer being filled as soon as
    its last byte has landed, on a pool of one thread per CPU, while the read goes on."""

    def __init__(self, buf: memoryview, piece_bytes: int):
        self.buf, self.piece_bytes = buf, piece_bytes
        self.pool = ThreadPoolExecutor(os.cpu_count() or 1)
        self.futures: list[Future] = []
        self.filled = 0

    def add(self, offset: int, piece: memoryview) -> None:
        if offset == 0 and self.filled:  # a retried read starts again
            for f in self.futures:
                f.cancel()
            self.futures, self.filled = [], 0
        if offset != self.filled:
            raise CheckpointError(f"piece at {offset} out of order (expected {self.filled})")
        self.filled += len(piece)
        done = self.filled // self.piece_bytes
        if self.filled == len(self.buf):
            done = -(-len(self.buf) // self.piece_bytes)
        while len(self.futures) < done:
            i = len(self.futures) * self.piece_bytes
            self.futures.append(self.pool.submit(sha256_bytes, self.buf[i:i + self.piece_bytes]))

    def hashes(self) -> list[str]:
        """The pieces' sha256s so far (every piece, after a read that filled the buffer)."""
        try:
            return [f.result() for f in self.futures]
        finally:
            self.pool.shutdown()


@dataclass
class Held:
    """A weights file a reader holds in memory, verified: the bytes whose root is `root`
    (manifest.pieces_root), version `version` of run `run_id`. `fetch_weights` may patch it
    into a newer version in place, so after a fetch that failed its content is garbage and
    it is no longer held."""

    run_id: str
    version: int
    root: str
    buf: memoryview


@dataclass(frozen=True)
class Fetched:
    """What fetch_weights did: the verified buffer, how (`held`: already there, `patches`: the
    held version patched forward, `keyframe`: the keyframe and the patches after it) and the
    bytes it downloaded."""

    buf: memoryview
    how: str
    bytes: int
    links: int


def plan_fetch(m: Manifest, held: Held | None) -> tuple[str, list[Keyframe | Link]]:
    """("held" | "patches" | "keyframe", the links to download, in order): the fewer bytes of
    patching the held version forward (when the manifest lists every patch after it) and of
    the keyframe with the patches after it. Pure: no I/O."""
    w, whole = m.weights, m.files[WEIGHTS_FILE]
    same_run = held is not None and held.run_id == m.run_id
    if same_run and held.root == whole.root:
        return "held", []
    from_keyframe = [w.keyframe, *(p for p in w.patches if p.version > w.keyframe.version)]
    if same_run and w.patches and w.patches[0].version - 1 <= held.version < m.version:
        from_held = [p for p in w.patches if p.version > held.version]
        if sum(p.size for p in from_held) < sum(p.size for p in from_keyframe):
            return "patches", from_held
    return "keyframe", from_keyframe


def _read_link(storage: Storage, key: str, link: Link) -> memoryview:
    return read_verified(storage, key, FileEntry(link.sha256, link.size))


def _read_whole(storage: Storage, key: str, buf: memoryview,
                on_chunk: Callable[[int, memoryview], None]) -> None:
    """Fill `buf` with the object; CheckpointError if it is not exactly that long."""
    try:
        storage.read_into(key, buf, on_chunk)
    except (TooLarge, ShortObject):
        raise CheckpointError(f"{key}: size does not match manifest.json") from None


def _check_pieces(m: Manifest, hashes: list[str], how: str = "") -> None:
    """CheckpointError naming the first piece whose sha256 is not the manifest's; `how` says
    how the file was made if it was not read whole."""
    if hashes != list(m.weights.pieces):
        bad = next((i for i, (a, b) in enumerate(zip(hashes, m.weights.pieces)) if a != b), len(hashes))
        raise CheckpointError(f"{layout.checkpoint_key(m.version, WEIGHTS_FILE)}: sha256 of piece "
                              f"{bad} does not match manifest.json" + (f" ({how})" if how else ""))


def _patch_forward(storage: Storage, m: Manifest, buf: memoryview, base: str,
                   links: list[Link]) -> int:
    """Apply `links` (patches, in order) to `buf`, the file whose root is `base`, in place;
    the bytes downloaded."""
    from volunteer_rl.protocol.patch import PatchError, apply_patch

    got = 0
    for link in links:
        key = Weights.patch_key(link.version)
        patch = _read_link(storage, key, link)
        got += link.size
        try:
            info = apply_patch(buf, patch, key, base)
        except PatchError as exc:
            raise CheckpointError(str(exc)) from None
        base = info.target
    return got


def fetch_weights(storage: Storage, manifest: Manifest, held: Held | None = None,
                  log: Callable[[str], None] | None = None,
                  reuse: memoryview | None = None) -> Fetched:
    """The manifest's weights file, verified, in memory only: what a volunteer swapping
    weights needs, with no copy on disk (see weights.load_weights).

    The checkpoint is checked first as a model's (check_checkpoint, require_model): no buffer
    is allocated for weights of another size than its config.json describes. Then the
    cheaper of the ways plan_fetch weighs: the held version patched forward in place, or the
    keyframe read into the held buffer or `reuse` (reused when of the right size: a fresh
    multi-GB buffer costs a page fault per 4 KiB page) and patched forward. Either way the result is
    checked piece by piece against the manifest before it is returned. A patch path that
    fails (a patch missing, corrupt, or made for another base than the held bytes) is logged
    in one line and the keyframe path runs instead; if that fails too, CheckpointError, or
    the StorageError of the object that could not be read (NotFound: retention removed it,
    and the reader should read the manifest again)."""
    check_checkpoint(storage, manifest, require_model=True)
    return build_weights(storage, manifest, held, log, reuse)


def build_weights(storage: Storage, manifest: Manifest, held: Held | None = None,
                  log: Callable[[str], None] | None = None,
                  reuse: memoryview | None = None) -> Fetched:
    """fetch_weights after its check of the checkpoint: the weights file from the held
    version or the keyframe, checked by pieces."""
    w, whole = manifest.weights, manifest.files[WEIGHTS_FILE]
    if w is None:
        raise CheckpointError(f"{layout.MANIFEST}: v{manifest.version} names no weights pieces")
    how, links = plan_fetch(manifest, held)
    if how == "held":
        return Fetched(held.buf, how, 0, 0)
    if how == "patches":
        try:
            got = _patch_forward(storage, manifest, held.buf, held.root, links)
            _check_pieces(manifest, piece_hashes(held.buf, w.piece_bytes),
                          f"patched from v{held.version}")
            return Fetched(held.buf, how, got, len(links))
        except (CheckpointError, StorageError) as exc:
            if log is not None:
                log(f"warning: {exc}; fetching keyframe v{w.keyframe.version} instead")
            how, links = plan_fetch(manifest, None)
    buf = byte_buffer(whole.size, held.buf if held is not None else reuse)
    key = w.keyframe_key()
    if w.keyframe.version == manifest.version:  # the file itself: its pieces hash as they land
        hasher = PieceHasher(buf, w.piece_bytes)
        try:
            _read_whole(storage, key, buf, hasher.add)
        finally:
            hashes = hasher.hashes()
        _check_pieces(manifest, hashes)
        return Fetched(buf, how, whole.size, 1)
    _read_whole(storage, key, buf, lambda offset, piece: None)
    got = whole.size + _patch_forward(storage, manifest, buf, w.keyframe.root, links[1:])
    _check_pieces(manifest, piece_hashes(buf, w.piece_bytes),
                  f"rebuilt from keyframe v{w.keyframe.version}")
    return Fetched(buf, how, got, len(links))


def _fetch_file(storage: Storage, key: str, entry: FileEntry, path: Path) -> None:
    """Download one file, check it against the manifest, then move it into place."""
    _write_file(read_verified(storage, key, entry), path)


def _write_file(data, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.part")
    with open(tmp, "wb") as f:
        f.write(data)
    tmp.replace(path)


def clear_folder(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
