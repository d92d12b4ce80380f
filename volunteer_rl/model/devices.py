"""Where the policy runs: the torch device, and how many CPU threads sampling uses."""

from __future__ import annotations

import re

import torch

from volunteer_rl.errors import VrlError
from volunteer_rl.model.policy import Policy

DEVICES = "auto, cpu, cuda, cuda:N or mps"
"""The --device values, as messages spell them."""


class DeviceError(VrlError):
    """--device names a device this torch does not know or cannot use here."""


def pick_device(name: str = "auto") -> torch.device:
    """cuda, then mps, then cpu, unless a device is named; DeviceError (naming --device) for
    a name that is none of DEVICES or a device this torch build or machine lacks, before
    anything is loaded, rather than torch's own error on the first tensor moved there."""
    if name != "auto":
        return _named_device(name)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def _named_device(name: str) -> torch.device:
    if name == "cpu":
        return torch.device("cpu")
    if re.fullmatch(r"cuda(:\d+)?", name):
        if not torch.cuda.is_available():
            why = "is a CPU-only build" if torch.version.cuda is None else "sees no CUDA GPU"
            raise DeviceError(f"--device {name}: this torch {why}; use --device cpu or auto")
        index = int(name.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise DeviceError(f"--device {name}: there are {torch.cuda.device_count()} CUDA "
                              f"devices, numbered from 0")
        return torch.device(name)
    if name == "mps":
        if getattr(torch.backends, "mps", None) is None or not torch.backends.mps.is_available():
            raise DeviceError("--device mps: this torch or machine has no MPS (Apple GPU); "
                              "use --device cpu or auto")
        return torch.device("mps")
    raise DeviceError(f"--device {name}: use {DEVICES}")


SMALL_MODEL_PARAMS = 5_000_000
"""Below this many parameters a model on the CPU samples on one torch thread (sampling_threads),
and a volunteer's round holds SMALL_MODEL_PROMPTS prompts (sampling_prompts)."""
SMALL_MODEL_PROMPTS, MODEL_PROMPTS = 32, 16
"""Prompts per generate round by default (sampling_prompts): for a small model, and otherwise."""

TORCH_DEFAULT_THREADS = torch.get_num_threads()
"""torch's own thread count at start (its default, or what OMP_NUM_THREADS asked for)."""


def set_process_threads(threads: int) -> None:
    """`--threads` for the whole process, applied before any torch work: torch's intra-op
    threads and its inter-op pool. Unset (0), torch keeps its default of one thread per
    core, and two processes starting up side by side on a small machine then fight over
    every core (bench/startup.py). The inter-op pool can only be sized before its first
    use; a process that already used it keeps it as it is."""
    if threads <= 0:
        return
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(threads)
    except RuntimeError:  # "cannot set number of interop threads after parallel work has started"
        pass


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
    params = sum(p.numel() for p in policy.model.parameters())
    if policy.device.type == "cpu" and params < SMALL_MODEL_PARAMS:
        return 1
    return TORCH_DEFAULT_THREADS


def sampling_prompts(policy: Policy, prompts: int = 0) -> int:
    """Prompts per generate round: `prompts` when > 0, else (auto) SMALL_MODEL_PROMPTS for a
    model of fewer than SMALL_MODEL_PARAMS parameters and MODEL_PROMPTS otherwise.

    A round's rows share each decoding step's fixed cost (a forward call, the noise draw), so
    more rows per round sample faster: 32 prompts x K = 8 against 16 gave 1.15x the
    completions/s on the tiny model (bench/generation.py). Each row holds its own KV cache,
    though: for a 0.6 B model in fp32, 128 rows of a 60-token prompt and 32 new tokens are
    about 2.7 GB, so a real model keeps the smaller round. A small model's rows cost next to
    nothing."""
    if prompts > 0:
        return prompts
    params = sum(p.numel() for p in policy.model.parameters())
    return SMALL_MODEL_PROMPTS if params < SMALL_MODEL_PARAMS else MODEL_PROMPTS


def set_sampling_threads(policy: Policy, threads: int = 0) -> int:
    """Apply `sampling_threads` to this process; returns the thread count now in force."""
    n = sampling_threads(policy, threads)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n
