"""The policy: a causal LM, its tokenizer and how prompts are written for it, and
`load_policy`, the one way any model folder is loaded.

Every model, including the project's own `--model tiny`, is a Hugging Face model folder
(config.json + model.safetensors + tokenizer files) loaded by `load_policy`, so a local
Hugging Face checkpoint goes through exactly the same code as the tiny one.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from volunteer_rl.model.vetting import (
    VRL_CONFIG,
    WEIGHTS_FILE,
    CheckpointRefused,
    check_model_folder,
    read_json_object,
)

PLAIN_TEMPLATE = "Q: {question}\nA: "
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

    @cached_property
    def special_ids(self) -> frozenset[int]:
        """The tokenizer's special tokens (EOS among them)."""
        return frozenset(int(i) for i in self.tokenizer.all_special_ids)

    def decode_all(self, ids: list[int]) -> str:
        """Token ids to text with special tokens spelled out: what the reward must see."""
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def bf16_rounded(policy: Policy) -> Policy:
    """A copy of `policy` with every weight rounded to bf16 and upcast: what a volunteer holds
    after loading a `--weights-dtype bf16` checkpoint (weights.load_weights upcasts exactly).
    For measuring replays against the weights volunteers really run (tests, bench)."""
    model = copy.deepcopy(policy.model)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(p.dtype))
    return Policy(model, policy.tokenizer, policy.prompt_format, policy.device)


def format_prompt(policy: Policy, question: str, instruction: str = "{question}") -> str:
    """The text the model continues: `Q: <question>\nA: ` in the plain format; in the chat
    format the tokenizer's template around one user message, the task's `instruction` with
    the question in it."""
    if policy.prompt_format == "chat":
        messages = [{"role": "user", "content": instruction.replace("{question}", question)}]
        return policy.tokenizer.apply_chat_template(messages, tokenize=False,
                                                    add_generation_prompt=True)
    return PLAIN_TEMPLATE.format(question=question)


def encode_prompts(policy: Policy, questions: list[str],
                   instruction: str = "{question}") -> list[list[int]]:
    texts = [format_prompt(policy, q, instruction) for q in questions]
    return [list(ids) for ids in policy.tokenizer(texts, add_special_tokens=False)["input_ids"]]


def quiet_transformers() -> None:
    """One log line per event is ours to print; transformers' progress bars are noise here."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def load_policy(path: str | Path, device: torch.device | str = "cpu",
                weights: bool = True) -> Policy:
    """Load a local Hugging Face causal-LM folder: config.json, safetensors weights and the
    tokenizer's files. `check_model_folder` runs first (CheckpointRefused naming the file,
    before transformers reads any of it); transformers then loads with remote code off, local
    files only (a hub id is no folder: refused) and safetensors only. `weights` False: the
    model is built from the config on the meta device, holding no memory (a trainer rank that
    takes the writer's weights into its shards), and is not moved to `device`."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    quiet_transformers()
    folder = Path(path)
    check_model_folder(folder)
    device = torch.device(device)
    local = {"trust_remote_code": False, "local_files_only": True}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tokenizer = AutoTokenizer.from_pretrained(str(folder), **local)
        config = AutoConfig.from_pretrained(str(folder), **local)
        if weights:
            model = _streamed(folder, config)
            if model is None:  # names transformers maps on load, or a sharded folder
                model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                             use_safetensors=True, **local)
        else:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                         trust_remote_code=False)
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
    if weights:
        model.to(device)
    return Policy(model, tokenizer, fmt, device)


def _streamed(folder: Path, config) -> torch.nn.Module | None:
    """The model of `folder`'s one model.safetensors, built from its config and filled a piece
    at a time (model.safetensors_file.stream_into), or None where the file's tensor names are
    not the model's own one for one (a checkpoint whose names transformers maps on load; a
    sharded folder): from_pretrained loads those. What from_pretrained does besides is done
    the same way: the model is built without initialising its weights, and after the load
    `initialize_weights` sets what the file does not hold (buffers such as rotary
    frequencies), skipping every tensor marked loaded; a tied output layer follows the
    embedding. The model comes back in eval mode, as from_pretrained gives it."""
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.initialization import no_init_weights

    from volunteer_rl.model.safetensors_file import WeightsError, stream_into

    path = folder / WEIGHTS_FILE
    if not path.is_file():
        return None
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                 trust_remote_code=False)
    try:
        filled = stream_into(model, path)
    except WeightsError:
        return None
    for t in filled:
        t._is_hf_initialized = True
    model.tie_weights()
    model.initialize_weights()
    if model.can_generate() and (folder / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(folder), local_files_only=True)
    return model.eval()
