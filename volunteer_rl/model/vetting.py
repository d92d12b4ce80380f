"""What a checkpoint may be, checked by every reader before it downloads anything.

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

A config, a tokenizer file or a patch comes from the bucket through `read_verified`: into a
buffer of the size the manifest lists, hashed as it lands, handed over only if its sha256
matched (the weights file is checked by pieces: chain.py).
"""

from __future__ import annotations

import json
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from volunteer_rl.model.hashing import CheckpointError, Hasher, byte_buffer, sha256_bytes
from volunteer_rl.protocol import layout
from volunteer_rl.protocol.manifest import ADAPTER_FILE, FileEntry, Manifest, WeightsEntry
from volunteer_rl.storage.base import ShortObject, Storage, TooLarge

# A checkpoint file larger than this is refused before download (volunteers bound what they
# read too). 64 GiB leaves room for multi-billion-parameter models in one safetensors file.
MAX_CHECKPOINT_FILE_BYTES = 64 << 30


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
    # a LoRA version's adapter (schema 10); read_adapter bounds it by the model's shapes
    ADAPTER_FILE: MAX_CHECKPOINT_FILE_BYTES,
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


def file_refusal(name: str, size: int) -> str | None:
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
        reason = file_refusal(name, entry.size)
        if reason:  # repr: a name from the bucket may hold anything, newlines included
            raise CheckpointRefused(f"{layout.MANIFEST}: v{manifest.version} lists {name!r}, "
                                    f"which {reason}; refused before downloading the checkpoint")


# ---------------------------------------------------------------------------------------------
# What config.json may ask for, and the model it may describe.

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


def weights_itemsize(weights_dtype: str) -> int:
    """Bytes a value of a manifest's `weights_dtype`; CheckpointRefused for any dtype but
    float32 and bfloat16."""
    itemsize = _WEIGHTS_ITEMSIZE.get(weights_dtype)
    if itemsize is None:
        raise CheckpointRefused(f"{layout.MANIFEST}: weights_dtype {weights_dtype!r:.40} is not "
                                f"float32 or bfloat16")
    return itemsize


def check_weights_size(shape: ModelShape, entry: WeightsEntry, weights_dtype: str, key: str) -> None:
    """CheckpointRefused unless a safetensors file of `shape`'s tensors, floats in
    `weights_dtype`, could be `entry.size` bytes long: its data exactly, plus 8 bytes and a
    header of 2 bytes up to 4 KiB + 1 KiB per tensor. A listed size that is not that is
    refused before the reader allocates a buffer for it."""
    data = shape.weights_bytes(weights_itemsize(weights_dtype))
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


# ---------------------------------------------------------------------------------------------
# One object of a checkpoint, read and checked against its manifest entry.


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
