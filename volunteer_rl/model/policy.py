"""The policy: a causal LM and its tokenizer, how prompts are written, how it samples, and
how the trainer scores tokens under it.

Every model, including the project's own `--model tiny`, is a Hugging Face model folder
(config.json + model.safetensors + tokenizer files) loaded by `load_policy`, so a local
Hugging Face checkpoint goes through exactly the same code as the tiny one.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from volunteer_rl.model.checkpoint import (
    VRL_CONFIG,
    WEIGHTS_FILE,
    CheckpointRefused,
    check_model_folder,
    read_json_object,
)

WEIGHTS_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""What `--weights-dtype` accepts, and the dtype each name publishes."""
PLAIN_TEMPLATE = "Q: {question}\nA: "
CHAT_INSTRUCTION = ("Write the arithmetic below as one Python expression. "
                    "Answer with the expression only.\n\n{question}")
PROMPT_FORMATS = ("plain", "chat")


@dataclass
class Policy:
    model: torch.nn.Module
    tokenizer: object  # a transformers PreTrainedTokenizerBase
    prompt_format: str  # "plain" (Q:/A:) or "chat" (the tokenizer's chat template)
    device: torch.device

    @property
    def eos_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def pad_id(self) -> int:
        return int(self.tokenizer.pad_token_id)


def pick_device(name: str = "auto") -> torch.device:
    """cuda, then mps, then cpu, unless a device is named."""
    if name != "auto":
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


SMALL_MODEL_PARAMS = 5_000_000
"""Below this many parameters a model on the CPU samples on one torch thread (sampling_threads)."""

TORCH_DEFAULT_THREADS = torch.get_num_threads()
"""torch's own thread count at start (its default, or what OMP_NUM_THREADS asked for)."""


def sampling_threads(policy: Policy, threads: int = 0) -> int:
    """torch CPU threads to sample with: `threads` when > 0, else (auto) one for a model of
    fewer than SMALL_MODEL_PARAMS parameters on the CPU and torch's default otherwise.

    A small model's matmuls (128 rows x hidden 128 for the tiny one) are too short for
    threads to pay for their hand-offs, and every step waits for the slowest thread: on this
    2-core machine while other work ran on it, the tiny model sampled 5-15x more completions/s
    on one thread than on two (bench/generation.py). A volunteer's machine is a shared one by
    design, so one thread is the robust choice for small models; big models keep all cores.
    """
    if threads > 0:
        return threads
    if policy.device.type == "cpu" and sum(p.numel() for p in policy.model.parameters()) < SMALL_MODEL_PARAMS:
        return 1
    return TORCH_DEFAULT_THREADS


def set_sampling_threads(policy: Policy, threads: int = 0) -> int:
    """Apply `sampling_threads` to this process; returns the thread count now in force."""
    n = sampling_threads(policy, threads)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n


# ---------------------------------------------------------------------------------------------
# The tiny model: built offline from a config and a tokenizer trained on the task's own text.

def build_tokenizer(texts: list[str], vocab_size: int = 640):
    """A byte-level BPE trained on the task corpus.

    Byte-level so any text encodes; trained on the task so most numbers and words are one
    token, which made the warm start about twice as fast as characters in our calibration.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   padding_side="left")


def build_tiny_model(tokenizer, seed: int = 0, hidden: int = 128, layers: int = 2,
                     heads: int = 4):
    """A Llama-shaped causal LM (~0.6 M parameters) with tied input/output embeddings."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=4 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=256, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


# ---------------------------------------------------------------------------------------------
# Loading and saving: one code path for every model folder.

def _quiet_transformers() -> None:
    """One log line per event is ours to print; transformers' progress bars are noise here."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def save_policy(policy: Policy, folder: Path, weights_dtype: torch.dtype = torch.float32,
                weights: bool = True) -> Path:
    """Write an HF model folder: config (with `dtype` set to the weights' dtype), generation
    config, tokenizer, vrl.json and, unless `weights` is False (the trainer streams them
    straight to the bucket instead, see trainer.publish), model.safetensors in
    `weights_dtype` with tied tensors saved once."""
    import copy

    _quiet_transformers()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model = policy.model
    config = copy.deepcopy(model.config)  # the live model's config stays as it is
    config.dtype = str(weights_dtype).removeprefix("torch.")
    config.architectures = [type(model).__name__]
    config.save_pretrained(folder)
    if model.can_generate():
        model.generation_config.save_pretrained(folder)
    policy.tokenizer.save_pretrained(folder)
    (folder / VRL_CONFIG).write_text(json.dumps({"prompt_format": policy.prompt_format}))
    if weights:
        with open(folder / WEIGHTS_FILE, "wb") as f:
            write_weights(model, f, weights_dtype)
    return folder


# safetensors, by hand: the format is 8 bytes of header length, a JSON header naming each
# tensor's dtype, shape and byte range, then the raw bytes. Writing it ourselves lets the
# bytes go from the tensors straight into the sink (a bucket object, being hashed on the
# way) with no second copy in memory; `save_pretrained` took 12 s for Qwen3-0.6B here,
# this takes the time of the write.
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
              torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
              torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
_ST_TORCH = {v: k for k, v in _ST_DTYPES.items()}
_PIECE = 16 << 20


def published_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict as a checkpoint stores it: a tensor shared under several names (a tied
    lm_head) is kept under its first name only, as transformers saves it."""
    out, seen = {}, set()
    for name, t in model.state_dict().items():
        ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if ident not in seen:
            seen.add(ident)
            out[name] = t
    return out


def write_weights(model: torch.nn.Module, out, dtype: torch.dtype = torch.float32) -> int:
    """Write the model's weights to `out` as safetensors, floating tensors cast to `dtype`
    (round-to-nearest-even for bf16, the same rounding `Tensor.to` gives everywhere), one
    tensor at a time. Returns the bytes written."""
    tensors = published_tensors(model)
    cast = lambda t: t.detach().to(dtype) if t.is_floating_point() else t.detach()  # noqa: E731
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, t in tensors.items():
        dt = dtype if t.is_floating_point() else t.dtype
        size = t.numel() * dt.itemsize
        header[name] = {"dtype": _ST_DTYPES[dt], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-(8 + len(head)) % 8)  # the data starts 8-byte aligned, as safetensors does
    out.write(len(head).to_bytes(8, "little") + head)
    with torch.no_grad():
        for t in tensors.values():
            data = cast(t).contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
            for start in range(0, len(data), _PIECE):
                out.write(memoryview(data[start:start + _PIECE]))
    return 8 + len(head) + offset


def weights_writer(model: torch.nn.Module, dtype: torch.dtype):
    """A `publish_checkpoint` stream that serializes the model's weights as they are now."""
    return lambda out: write_weights(model, out, dtype)


def load_policy(path: str | Path, device: torch.device | str = "cpu") -> Policy:
    """Load a local Hugging Face causal-LM folder: config.json, safetensors weights and the
    tokenizer's files. `check_model_folder` runs first (CheckpointRefused naming the file,
    before transformers reads any of it); transformers then loads with remote code off, local
    files only (a hub id is no folder: refused) and safetensors only."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _quiet_transformers()
    folder = Path(path)
    check_model_folder(folder)
    device = torch.device(device)
    local = {"trust_remote_code": False, "local_files_only": True}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tokenizer = AutoTokenizer.from_pretrained(str(folder), **local)
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                     use_safetensors=True, **local)
    if tokenizer.pad_token_id is None:  # many chat models ship without one
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    model.config.pad_token_id = tokenizer.pad_token_id
    side = folder / VRL_CONFIG
    if side.is_file():
        fmt = read_json_object(side).get("prompt_format", "plain")
        if fmt not in PROMPT_FORMATS:
            raise CheckpointRefused(f"{side}: prompt_format {fmt!r:.40} is not plain or chat")
    else:
        fmt = "chat" if getattr(tokenizer, "chat_template", None) else "plain"
    model.to(device)
    return Policy(model, tokenizer, fmt, device)


def load_weights(policy: Policy, source) -> None:
    """Swap new weights into the live model in place (no rebuild, no re-allocation).

    `source` is a safetensors file's path or its bytes already in memory (a verified buffer
    from checkpoint.fetch_weights): each tensor is copied straight from those bytes into the
    model's own tensor, cast to its dtype (bf16 weights into an fp32 model are upcast
    exactly), with no intermediate state dict. A tied lm_head is saved once under the
    embedding's name, so it may be missing here. Every tensor's shape and byte range is
    checked before the first one is copied: weights that do not fit (ValueError) leave the
    model as it was."""
    import math

    import numpy as np

    if isinstance(source, (str, Path)):
        name = Path(source).name
        source = memoryview(np.fromfile(source, dtype=np.uint8))
    else:
        name = WEIGHTS_FILE
    buf = memoryview(source).cast("B")
    try:
        n = int.from_bytes(buf[:8], "little")
        header = json.loads(bytes(buf[8:8 + n]))
        header.pop("__metadata__", None)
        header = {k: (_ST_TORCH[v["dtype"]], [int(d) for d in v["shape"]],
                      [int(o) for o in v["data_offsets"]]) for k, v in header.items()}
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise ValueError(f"{name}: not a safetensors file ({type(exc).__name__}: {exc})") from None
    targets = policy.model.state_dict()
    tied = {"lm_head.weight"} if policy.model.config.tie_word_embeddings else set()
    missing = set(targets) - set(header) - tied
    unexpected = sorted(set(header) - set(targets))
    if missing or unexpected:
        raise ValueError(f"{name}: weights do not fit the model "
                         f"(missing {sorted(missing)[:3]}, unexpected {unexpected[:3]})")
    base = 8 + n
    for key, (dtype, shape, (begin, end)) in header.items():
        target = targets[key]
        if list(target.shape) != shape or end - begin != math.prod(shape) * dtype.itemsize \
                or begin < 0 or base + end > len(buf):
            raise ValueError(f"{name}: {key} has shape {shape} (bytes {begin}-{end}), "
                             f"the model {list(target.shape)}")
    with torch.no_grad():
        for key, (dtype, shape, (begin, end)) in header.items():
            count = math.prod(shape)
            src = torch.frombuffer(buf, dtype=dtype, count=count, offset=base + begin) if count \
                else torch.empty(0, dtype=dtype)
            targets[key].copy_(src.view(shape))


# ---------------------------------------------------------------------------------------------
# Prompts, sampling, scoring.

def format_prompt(policy: Policy, question: str) -> str:
    if policy.prompt_format == "chat":
        messages = [{"role": "user", "content": CHAT_INSTRUCTION.format(question=question)}]
        return policy.tokenizer.apply_chat_template(messages, tokenize=False,
                                                    add_generation_prompt=True)
    return PLAIN_TEMPLATE.format(question=question)


def encode_prompts(policy: Policy, questions: list[str]) -> list[list[int]]:
    texts = [format_prompt(policy, q) for q in questions]
    return [list(ids) for ids in policy.tokenizer(texts, add_special_tokens=False)["input_ids"]]


@dataclass
class Sample:
    token_ids: list[int]   # generated tokens up to and including the first EOS
    logprobs: list[float]  # their logprobs under the sampling distribution (logits / T)
    text: str


def _left_pad(seqs: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s):] = 1
    return ids.to(device), mask.to(device)


def _prefill(policy: Policy, prompts: list[list[int]], k: int):
    """Run each prompt once and repeat its KV cache K times: prompts are most of the tokens
    of a batch, and the K rows of a group share theirs. Returns (last-position logits [G*K, V],
    cache, attention mask [G*K, L], next position ids [G*K, 1])."""
    ids, mask = _left_pad(prompts, policy.pad_id, policy.device)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = policy.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                       logits_to_keep=1)
    out.past_key_values.batch_repeat_interleave(k)
    return (out.logits[:, -1].repeat_interleave(k, 0), out.past_key_values,
            mask.repeat_interleave(k, 0), pos[:, -1:].repeat_interleave(k, 0) + 1)


def draw(logp: torch.Tensor) -> torch.Tensor:
    """One token per row of `logp` [rows, V], drawn from softmax, i.e. from exp(logp).

    Inverse CDF: one uniform per row against the running sum of the row's probabilities,
    both in float64, so every token's interval is its probability to ~1e-16 and a token of
    probability 0 is never drawn. One random number per row instead of one per vocabulary
    entry (the exponential race, also how torch.multinomial draws one sample) made a
    128 x 640 draw about 8x cheaper here. MPS has no float64: float32 there."""
    cdf = logp.to(torch.float32 if logp.device.type == "mps" else torch.float64).exp().cumsum(-1)
    u = torch.rand((logp.shape[0], 1), dtype=cdf.dtype, device=cdf.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True)[:, 0].clamp_(max=logp.shape[-1] - 1)


@torch.inference_mode()
def _generate_batch(policy: Policy, prompts: list[list[int]], k: int, temperature: float,
                    max_new_tokens: int) -> list[Sample]:
    """K completions for each prompt, rows in group order; temperature <= 0 means greedy.

    A plain sampling loop over the KV cache rather than `generate`: it shares the prompt
    pass across the K rows, drops rows from the batch as soon as they emit EOS, and samples
    from exactly softmax(logits / T) (no top-k / top-p), which is what the logprobs describe.
    Tokens and logprobs stay in tensors until the end: no per-token Python work.
    """
    logits, cache, mask, pos = _prefill(policy, prompts, k)
    rows, dev, eos = len(prompts) * k, policy.device, policy.eos_id
    tokens = torch.full((rows, max_new_tokens), eos, dtype=torch.long, device=dev)
    logps = torch.zeros((rows, max_new_tokens), dtype=torch.float32, device=dev)
    live = torch.arange(rows, device=dev)  # original row of each batch row
    steps = 0
    for step in range(max_new_tokens):
        logp = torch.log_softmax(logits.float() / (temperature if temperature > 0 else 1.0), -1)
        nxt = logp.argmax(-1) if temperature <= 0 else draw(logp)
        tokens[live, step] = nxt
        logps[live, step] = logp.gather(-1, nxt[:, None])[:, 0]
        steps = step + 1
        going = nxt != eos
        if step == max_new_tokens - 1 or not going.any():
            break
        if not going.all():  # finished rows leave the batch: no compute spent on padding
            keep = going.nonzero()[:, 0]
            cache.batch_select_indices(keep)
            live, nxt, mask, pos = live[keep], nxt[keep], mask[keep], pos[keep]
        mask = torch.cat([mask, mask.new_ones(len(live), 1)], dim=1)
        out = policy.model(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos,
                           past_key_values=cache)
        logits, pos = out.logits[:, -1], pos + 1
    # A row's length runs to its first EOS, inclusive; a row that never emitted one ran
    # all `steps` (the loop stops early only once every row has ended).
    is_eos = tokens[:, :steps] == eos
    lengths = (torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, steps).tolist() if steps
               else [0] * rows)
    token_rows = [t[:n] for t, n in zip(tokens[:, :steps].tolist(), lengths)]
    logp_rows = [lp[:n] for lp, n in zip(logps[:, :steps].tolist(), lengths)]
    texts = policy.tokenizer.batch_decode(token_rows, skip_special_tokens=True)
    return [Sample(t, lp, text) for t, lp, text in zip(token_rows, logp_rows, texts)]


def sample(policy: Policy, prompts: list[list[int]], k: int, temperature: float,
           max_new_tokens: int, batch_size: int = 256) -> list[list[Sample]]:
    """K samples for each prompt, many prompts per batched call.

    Prompts are sorted by length before batching so rows in one call pad little; results come
    back in the caller's order as one list of K samples per prompt.
    """
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    per_call = max(1, batch_size // k)
    result: list[list[Sample]] = [[] for _ in prompts]
    for start in range(0, len(order), per_call):
        chunk = order[start:start + per_call]
        samples = _generate_batch(policy, [prompts[i] for i in chunk], k, temperature,
                                  max_new_tokens)
        for j, i in enumerate(chunk):
            result[i] = samples[j * k:(j + 1) * k]
    return result


def right_pad(seqs: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids.to(device), mask.to(device)


def token_logprobs(policy: Policy, prompts: list[list[int]], completions: list[list[list[int]]],
                   temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs of each completion token given its prompt, under logits / temperature.

    prompts: G prompts; completions: for each prompt the same number K of completions.
    Returns logp [G*K, T] (with grad) and mask [G*K, T], T the longest completion, rows in
    group order, each completion left-aligned at column 0.

    Each prompt is run once and its KV cache is repeated K times for the completions, instead
    of running the prompt K times: prompts are most of the tokens here, so this cuts the
    step's compute by about 2.5x at K = 8. Gradients flow through the shared prompt pass.
    Prompts are left-padded as in generation, so positions match what was sampled.
    """
    k = len(completions[0])
    if any(len(c) != k for c in completions):
        raise ValueError("every prompt needs the same number of completions")
    p_ids, p_mask = _left_pad(prompts, policy.pad_id, policy.device)
    p_pos = (p_mask.cumsum(-1) - 1).clamp(min=0)
    out = policy.model(input_ids=p_ids, attention_mask=p_mask, position_ids=p_pos, use_cache=True,
                       logits_to_keep=1)
    cache = out.past_key_values
    cache.batch_repeat_interleave(k)
    flat = [c for group in completions for c in group]
    c_ids, c_mask = right_pad(flat, policy.pad_id, policy.device)
    c_pos = p_pos[:, -1:].repeat_interleave(k, 0) + 1 + torch.arange(c_ids.shape[1], device=policy.device)
    mask = torch.cat([p_mask.repeat_interleave(k, 0), c_mask], dim=1)
    logits = policy.model(input_ids=c_ids, attention_mask=mask, position_ids=c_pos,
                          past_key_values=cache).logits
    # The first completion token is predicted by the prompt's last position, the rest by the
    # completion positions before them.
    logits = torch.cat([out.logits[:, -1:].repeat_interleave(k, 0), logits[:, :-1]], dim=1)
    logp = torch.log_softmax(logits.float() / max(temperature, 1e-6), dim=-1)
    logp = logp.gather(-1, c_ids[..., None])[..., 0]
    return logp, c_mask.to(logp.dtype)
