"""Activation checkpointing of the trainer's policy (--gradient-checkpointing): each decoder
layer keeps only its inputs for the backward, and runs its forward again there to get what its
backward needs, instead of keeping every intermediate tensor (attention, MLP, norms) of every
layer from the forward to the backward.

transformers' decoder layers (GradientCheckpointingLayer) checkpoint their own forward when
flagged, in training mode only: evaluation, sampling and replays, in eval mode, run as
before. Its switch, `activation_checkpointing_enable`, is not used as it is: it also flags the
model itself, which then turns the KV cache off (use_cache=False, and GPT-2 passes no cache to
its layers), and each flagged layer drops the cache it is given unless it may keep it (a layer
that writes the cache would write it a second time in the backward). The step's forward needs
the cache: scoring.completion_logits runs each prompt once and its completions on its cache,
with gradients through the shared prompt pass. So here only the layers are flagged, allowed to
keep the cache, and checkpointed with torch's non-reentrant checkpoint (no input needs
requires_grad, so a LoRA model's frozen embeddings are fine) keeping the cache: the forward
runs on the real cache, unchanged, and the backward's recompute on a stand-in that holds the
layer's cache entry as the forward found it (the prompt's keys and values the completions
attended to, or nothing before the prompt pass), so the recompute sees what the forward saw
and the real cache is never written twice. The logits are the tensors the forward gives
without checkpointing (nothing in the forward changes), so the step's loss and its own replay
of its groups (trainer.step.StepReplay) are unchanged; the gradients are the same up to float
noise (and torch's checkpoint checks that every recomputed tensor has the shape, dtype and
device of the one it stands for, raising if not).

Under FSDP2 (trainer.ranks) a layer's own `forward` is what is checkpointed, not its call
(transformers wraps the method), so FSDP2's hooks, which all-gather the layer's weights before
its forward and again before its backward, stay outside it.
"""

from __future__ import annotations

import copy
from functools import partial

import torch

from volunteer_rl.config import flag
from volunteer_rl.errors import ConfigError


def _base(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside one wrapped by model.lora, or `model`."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in _base(model).modules() if isinstance(m, GradientCheckpointingLayer)]


def enable_recompute(model: torch.nn.Module) -> None:
    """Checkpoint every decoder layer of `model` (a transformers model, or one wrapped by
    model.lora) in training mode from here on, keeping the KV cache (the module docstring).
    ConfigError for a model with no layer transformers can checkpoint."""
    layers = _layers(model)
    if not layers:
        raise ConfigError(f"{flag('gradient_checkpointing')}: {type(_base(model)).__name__} has "
                          "no decoder layer transformers can checkpoint")
    # A flagged layer given use_cache=True warns once that it sets it to False: true of that
    # argument, which the layers here do not use, but it reads as if the cache were dropped.
    from transformers.utils import logging as hf_logging

    hf_logging.get_logger("transformers.modeling_layers").setLevel(hf_logging.ERROR)
    for layer in layers:
        layer.gradient_checkpointing = True  # what transformers' switch sets on each layer
        layer._can_checkpoint_with_cache = True  # the cache stays in the layer's arguments
        layer._gradient_checkpointing_func = partial(checkpoint_keeping_cache, cache_index(layer))


def recomputes(model: torch.nn.Module) -> bool:
    """Whether every decoder layer of `model` is checkpointed (enable_recompute)."""
    layers = _layers(model)
    return bool(layers) and all(layer.gradient_checkpointing for layer in layers)


def cache_index(layer: torch.nn.Module) -> int:
    """The index of `layer`'s entry in the KV cache: its attention's `layer_idx` (Llama, Qwen3,
    Gemma 3, GPT-2 all name it so)."""
    for m in layer.modules():
        if isinstance(getattr(m, "layer_idx", None), int):
            return m.layer_idx
    raise ValueError(f"{type(layer).__name__}: no layer_idx, so its KV cache entry is unknown")


def checkpoint_keeping_cache(index: int, function, *args):
    """torch's non-reentrant checkpoint of `function` (transformers' partial of a decoder
    layer's forward, its keyword arguments bound) on `args`, its KV cache kept: the first run
    is the plain forward on the real cache; the backward's recompute runs on a stand-in
    (`_stand_in`). The cache is whichever argument is one, by keyword (most models) or by
    position (GPT-2)."""
    from torch.utils.checkpoint import checkpoint
    from transformers.cache_utils import Cache

    named = [k for k, v in function.keywords.items() if isinstance(v, Cache)]
    cache = (function.keywords[named[0]] if named
             else next((a for a in args if isinstance(a, Cache)), None))
    if cache is None:
        return checkpoint(function, *args, use_reentrant=False)
    stand_in = _stand_in(cache, index)
    ran = False

    def run(*given):
        nonlocal ran
        if not ran:  # the forward itself
            ran = True
            return function(*given)
        fresh = stand_in()  # the backward's recompute
        return function(*(fresh if a is cache else a for a in given), **dict.fromkeys(named, fresh))

    return checkpoint(run, *args, use_reentrant=False)


def _stand_in(cache, index: int):
    """A maker of caches that hold entry `index` of `cache` as it is now (the real cache moves
    on: the completions' pass appends to the prompt's entry) and nothing else, each one fresh
    (the recompute writes into it). The entry's tensors are kept until the backward; so is
    the real cache, which the layer's arguments hold and torch's checkpoint keeps for the
    recompute (without checkpointing, autograd keeps its keys and values for the attention's
    backward as well). A cache of another kind than a list of layers (an encoder-decoder
    cache, offloading) is refused: no model the trainer loads makes one."""
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list) or getattr(cache, "offloading", False):
        raise ValueError(f"{flag('gradient_checkpointing')}: a {type(cache).__name__} is not a "
                         "KV cache it can keep")
    entry = copy.copy(layers[index]) if index < len(layers) else None  # None: not made yet
    shell = copy.copy(cache)
    shell.layers = []

    def make():
        fresh = copy.copy(shell)
        fresh.layers = [None] * index + ([copy.copy(entry)] if entry is not None else [])
        return fresh

    return make
