"""Where the policy runs: the torch device, and how many CPU threads sampling uses."""

from __future__ import annotations

import torch

from volunteer_rl.model.policy import Policy


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
    params = sum(p.numel() for p in policy.model.parameters())
    if policy.device.type == "cpu" and params < SMALL_MODEL_PARAMS:
        return 1
    return TORCH_DEFAULT_THREADS


def set_sampling_threads(policy: Policy, threads: int = 0) -> int:
    """Apply `sampling_threads` to this process; returns the thread count now in force."""
    n = sampling_threads(policy, threads)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n
