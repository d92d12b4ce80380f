"""The trainer as N ranks under torchrun (issue 28): which rank this process is, the process
group it joined, the policy sharded with FSDP2, its share of a step's batch, the full
weights gathered for the one writer and broadcast from it, the writer's messages to the other
ranks, and one-line errors for a join or a collective that fails. trainer/roles.py,
writer.py and follower.py decide what the ranks do with these; docs/SCALE.md says where they
split and meet.

Every collective and every piece of process management is PyTorch's own: torchrun starts and
restarts the ranks and sets their environment, `torch.distributed` joins them, `fully_shard`
(FSDP2) shards parameters, gradients and AdamW state and reduces gradients, and
`torch.distributed.checkpoint.state_dict` gathers the full state dict.

Without torchrun's environment every function here is the single process it always was:
`join` returns `SINGLE` and joins no group, `shard_model` leaves the model alone,
`rank_share` is the whole batch, `gradient_scale` is 1 and `sum_over_ranks` returns its input.
"""

from __future__ import annotations

import hashlib
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from volunteer_rl.errors import VrlError
from volunteer_rl.progress import Log

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
"""What torchrun sets for every rank it starts. All of them present: this process is a rank;
none: a single process; some: a broken launch (RankJoinError)."""

class RankJoinError(VrlError):
    """This rank could not join the process group torchrun's environment describes."""


class RankLostError(VrlError):
    """A collective failed after the join: another rank died (torchrun then restarts them all,
    given --max-restarts), hung past the timeout, or the network between them broke."""


_COLLECTIVE = re.compile(r"gloo|nccl|c10d|ProcessGroup|Connection (reset|closed)|timed? ?out", re.I)
"""What torch's errors from a failed collective say (its RuntimeError names the backend or
the broken connection), as against a bug of ours that happens to raise a RuntimeError."""


def _first_sentence(e: Exception) -> str:
    """torch's message without the C++ log lines and stack trace it runs on into
    ("...).[E1126 20:50:18.77 socket.cpp:.."), and without the source path gloo puts first."""
    first = re.split(r"\[[EWI]\d{4} ", str(e).strip() + "\n")[0].splitlines()[0].strip()
    return re.sub(r"^\[[^\]]*\.(cc|cpp):\d+\]\s*", "", first)


@contextmanager
def collective_errors(ranks: "Ranks", during: str):
    """Turn torch's error from a failed collective into RankLostError (one line, naming this
    rank and what it was doing); any other exception passes unchanged, traceback and all."""
    try:
        yield
    except RuntimeError as e:
        if not ranks.joined or not _COLLECTIVE.search(str(e)):
            raise
        raise RankLostError(f"rank {ranks.rank} of {ranks.world_size} lost the other ranks "
                            f"{during}: {_first_sentence(e)}") from e


@dataclass(frozen=True)
class Ranks:
    """Where this process stands among the trainer's ranks."""

    rank: int
    world_size: int
    device: torch.device
    """This rank's device: cuda:LOCAL_RANK for CUDA ranks, else the device asked for."""
    joined: bool
    """A process group was joined (torchrun's environment was present); only then does
    `shard_model` shard, even for a world of one."""

    @property
    def is_writer(self) -> bool:
        """Rank 0 alone publishes (and, later, writes the ledger's commits)."""
        return self.rank == 0

    @property
    def is_follower(self) -> bool:
        """A joined rank other than the writer: it does what the writer tells it."""
        return self.joined and not self.is_writer

    def describe(self) -> str:
        """A joined rank's first log line: `rank 1 of 2, backend gloo, device cpu: follows
        rank 0`, so a torchrun log says how it ran (progress.Log puts `[rank 1]` before it)."""
        role = "the writer, it publishes" if self.is_writer else "follows rank 0"
        return (f"rank {self.rank} of {self.world_size}, backend {backend_for(self.device)}, "
                f"device {self.device}: {role}")


def single(device: torch.device | str = "cpu") -> Ranks:
    """The plain `vrl trainer`: one process, rank 0 of 1, no process group."""
    return Ranks(rank=0, world_size=1, device=torch.device(device), joined=False)


def backend_for(device: torch.device) -> str:
    """The process group's backend, from the device the ranks train on.

    CUDA: NCCL for the CUDA tensors and gloo beside it for any CPU tensor a collective meets
    (grail and torchtitan launch the same way). CPU: gloo. Nothing else has a backend here:
    MPS has no collective library in torch."""
    if device.type == "cuda":
        return "cuda:nccl,cpu:gloo"
    if device.type == "cpu":
        return "gloo"
    raise RankJoinError(f"--device {device}: a trainer of several ranks runs on cuda (NCCL) or "
                        f"cpu (gloo); use one of those or launch without torchrun")


def join(device: torch.device | str, timeout_seconds: float) -> Ranks:
    """This process's Ranks: joined to the process group when torchrun started it, else
    `single(device)` with no group and nothing else done.

    Under torchrun a CUDA rank trains on cuda:LOCAL_RANK (one GPU per rank, as torchrun's
    --nproc-per-node counts them). Every collective of the group, the join included, fails
    after `timeout_seconds` (init_process_group's `timeout`, which gloo applies to each
    collective and NCCL's watchdog enforces; the trainer's --rank-timeout). RankJoinError (one line) for an incomplete torchrun environment,
    a device with no backend, or a group not joined within the timeout."""
    device = torch.device(device)
    present = [k for k in TORCHRUN_ENV if k in os.environ]
    if not present:
        return single(device)
    missing = [k for k in TORCHRUN_ENV if k not in os.environ]
    if missing:
        raise RankJoinError(f"{', '.join(present)} set but {', '.join(missing)} not: launch "
                            f"the trainer with torchrun, or unset {', '.join(present)}")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = backend_for(device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    try:
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_seconds),
                                device_id=device if device.type == "cuda" else None,
                                store=_attempt_store(rank, world, timeout_seconds),
                                rank=rank, world_size=world)
    except (RuntimeError, ValueError) as e:  # torch's DistError (store, network) is a RuntimeError
        raise RankJoinError(f"rank {rank} of {world} did not join the {backend} group at {where} "
                            f"within {timeout_seconds:g}s: {_first_sentence(e)}") from e
    return Ranks(rank=rank, world_size=world, device=device, joined=True)


def announce(ranks: Ranks, log: Callable[[str], None]) -> None:
    """A joined rank's first log line (`describe`), and from it on every line of the
    process's log (progress.Log) prefixed with `[rank R] `. A single process says nothing."""
    if not ranks.joined:
        return
    if isinstance(log, Log):
        log.prefix = f"[rank {ranks.rank}] "
    log(ranks.describe())


def _attempt_store(rank: int, world: int, timeout_seconds: float) -> dist.Store:
    """The store the ranks meet in, as init_process_group's env:// would make it (a client of
    the TCPStore that torchrun's agent hosts, or rank 0's own without the agent's), under a
    prefix of torchrun's restart count.

    Why the prefix: torchrun keeps one store across the restarts of its ranks (its default
    since torch 2.5), and the ranks' addresses are kept there under the same names every
    time, so a restarted rank could read a dead rank's address from the attempt before and
    fail to connect (seen here: `Gloo connectFullMesh failed ... Connection refused` after
    `kill -9` of one rank, one run in two; pytorch/pytorch#135712, whose workaround is
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun). A prefix per attempt works with
    either setting."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=rank == 0 and not agent,
                          timeout=timedelta(seconds=timeout_seconds), multi_tenant=not agent)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"vrl/attempt-{attempt}", store)


def leave(ranks: Ranks, meet: bool = False) -> None:
    """Destroy the process group `join` made (nothing for a single process).

    After a barrier when `meet`: the ranks end together, so none tears its connections down
    while another still reads from them. Without it rank 0 (whose last message is a
    broadcast it returns from as soon as it is sent) aborted at exit in about one run of
    five here ("terminate called without an active exception", SIGABRT from gloo's
    teardown). `meet` false: leaving after a failure, when the others may be gone. What
    this leaves (gloo's threads outlive the group and may free tensors while the interpreter
    finalizes) is why a rank process ends with os._exit (cli/main.py)."""
    if ranks.joined and dist.is_initialized():
        if meet:
            dist.barrier()
        dist.destroy_process_group()


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks, found by class name in its `_no_split_modules`.

    transformers gathers that set over the model and its sub-models at construction; it names
    the blocks an accelerate device map must not split, which are exactly the units to shard:
    LlamaDecoderLayer, Qwen3DecoderLayer, Gemma3DecoderLayer, GPT2Block. A model without the
    attribute (not a transformers PreTrainedModel) has no layers found and is sharded at the
    root only. Order: children before their parents (fully_shard must go bottom-up)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = [m for m in model.modules() if m is not model and type(m).__name__ in names]
    return list(reversed(found))


def shard_model(model: torch.nn.Module, ranks: Ranks) -> torch.nn.Module:
    """Shard `model` in place with FSDP2 across the group: `fully_shard` on every decoder
    layer (`decoder_layers`), then at the root, which takes what is left (embeddings, the
    final norm, a tied or untied LM head). Each layer's parameters are all-gathered for its
    forward and backward and freed after; gradients are reduce-scattered, averaged over the
    ranks (FSDP2's default: see `gradient_scale`); an optimizer built after this holds only
    this rank's shard of every parameter and of AdamW's moments.

    Parameters stay in their dtype (no MixedPrecisionPolicy: the single process trains in
    fp32 and the ranks must match it). A single process (`ranks.joined` false): the model
    is returned untouched."""
    if not ranks.joined:
        return model
    from torch.distributed.fsdp import fully_shard

    for layer in decoder_layers(model):
        fully_shard(layer)
    fully_shard(model)
    return model


def rank_share(n: int, ranks: Ranks) -> slice:
    """The rows of a step's batch of `n` groups that this rank computes the loss on: a
    contiguous 1/world_size of them.

    Every rank holds the whole batch (the ranks agree on it before the step) and takes its own
    slice. `n` must divide evenly: FSDP2 runs collectives in every forward and backward, so
    ranks with different micro-batch counts would wait on each other until the timeout
    (ValueError, a bug in the caller, not a user's mistake)."""
    if n % ranks.world_size:
        raise ValueError(f"a batch of {n} groups does not split evenly over "
                         f"{ranks.world_size} ranks")
    size = n // ranks.world_size
    return slice(ranks.rank * size, (ranks.rank + 1) * size)


def gradient_scale(ranks: Ranks) -> float:
    """What each rank multiplies its part of the step's loss by.

    A rank's part is its rows' token losses over the whole step's token count, so the parts
    sum to the single process's loss. FSDP2 reduce-scatters gradients as a mean over the
    ranks; scaling every part by world_size makes that mean the sum, the single process's
    gradient. (A power of two for 2, 4, 8 ranks: the scaling and FSDP's division are exact.)"""
    return float(ranks.world_size)


def sum_over_ranks(values: list[float], ranks: Ranks) -> list[float]:
    """`values` summed element-wise over the ranks, the same result on every rank (one
    all-reduce on this rank's device); a single process gets them back. Used for the step's
    loss and statistics, so every rank takes the same apply-or-refuse decision."""
    if not ranks.joined:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=ranks.device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def clip_grad_norm(parameters, max_norm: float) -> float:
    """Clip the whole gradient to `max_norm`; returns its norm before the clip, the same on
    every rank.

    torch.nn.utils.clip_grad_norm_ split in its own two halves (it is exactly these two
    calls): with FSDP2's DTensor gradients the total norm comes back as a DTensor whose local
    value is this rank's shard's part, so it is made whole (`full_tensor`, an all-reduce)
    before it scales the gradients and before `.item()`. Plain tensors pass straight through."""
    from torch.distributed.tensor import DTensor

    params = list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, 2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total.item()


def full_state_dict(model: torch.nn.Module, ranks: Ranks,
                    everyone: bool = False) -> dict[str, torch.Tensor]:
    """The model's full, unsharded state dict on the CPU, for the writer to publish exactly
    what a single process would; every rank must call it (it all-gathers), and the other
    ranks get an empty dict, or with `everyone` the full dict too (ranks that audit their
    share of the fleet keep each published version's weights, as the writer does).

    torch.distributed.checkpoint's get_model_state_dict with full_state_dict and cpu_offload:
    each parameter is gathered and copied to the CPU on rank 0 alone, one at a time, so only
    the writer ever holds the whole model, and in CPU memory. `everyone`: without cpu_offload,
    every rank gets every gathered parameter, moved to the CPU here. A single process: its own
    state dict, on the CPU (shared with the live model where it already is on the CPU)."""
    if not ranks.joined:
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if everyone:
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        return {k: v.detach().cpu() for k, v in full.items()}
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))
    return full if ranks.is_writer else {}


def broadcast_bytes(data: bytes | None, ranks: Ranks) -> bytes:
    """The writer's `data` on every rank (the others pass None): its length, then its bytes,
    as two broadcasts of CPU tensors (gloo on CPU, the gloo half of cuda:nccl,cpu:gloo on
    CUDA). The writer's step decisions travel this way, as JSON of its own making: nothing a
    rank receives is unpickled. A single process gets `data` back."""
    if not ranks.joined:
        return data or b""
    size = torch.tensor([len(data) if ranks.is_writer else 0], dtype=torch.int64)
    dist.broadcast(size, src=0)
    buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if ranks.is_writer and size.item()
           else torch.empty(int(size.item()), dtype=torch.uint8))
    if size.item():
        dist.broadcast(buf, src=0)
    return bytes(buf.numpy()) if size.item() else b""


def load_full_optimizer_state(model: torch.nn.Module, opt: torch.optim.Optimizer, full: dict,
                              ranks: Ranks) -> None:
    """The writer's whole optimizer state `full` (keyed by parameter name: state.
    named_optimizer_state; the others pass {}) into every rank's sharded optimizer: torch's
    set_optimizer_state_dict broadcasts it from rank 0 and each rank keeps its shard. This is
    how ranks resume the moments a single process saved."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, opt, full, options=StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=True))


def all_gather_bytes(data: bytes, ranks: Ranks) -> list[bytes]:
    """Every rank's `data`, in rank order, on every rank: the lengths, then the bytes padded
    to the longest, as two all-gathers of CPU tensors (gloo). Each rank's intake reports travel
    this way, as JSON of the trainer's own making: nothing is unpickled. A single process gets
    [data]."""
    if not ranks.joined:
        return [data]
    size = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(ranks.world_size)]
    dist.all_gather(sizes, size)
    longest = max(int(s.item()) for s in sizes)
    if not longest:
        return [b""] * ranks.world_size
    mine = torch.zeros(longest, dtype=torch.uint8)
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    bufs = [torch.empty(longest, dtype=torch.uint8) for _ in range(ranks.world_size)]
    dist.all_gather(bufs, mine)
    return [bytes(b[: int(s.item())].numpy()) for b, s in zip(bufs, sizes)]


def owner_rank(volunteer: str, world_size: int) -> int:
    """The rank whose intake reads `volunteer`'s shards: a stable hash of the id (the same on
    every rank, in every run, whatever Python's hash seed), so each volunteer's state (trust,
    group numbers, audits) lives on one rank."""
    digest = hashlib.sha256(volunteer.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") % world_size


def barrier(ranks: Ranks) -> None:
    """Every rank waits for the others here (nothing for a single process)."""
    if ranks.joined:
        dist.barrier()


def scatter_full_weights(model: torch.nn.Module, full: dict[str, torch.Tensor],
                         ranks: Ranks) -> None:
    """The writer's full weights `full` (the others pass {}) into every rank's shards of the
    sharded `model`, one tensor at a time: each parameter scattered from the writer
    (`distribute_tensor`, whose other ranks need a tensor of the whole shape: one
    parameter's worth, for a moment), every buffer broadcast whole. The ranks start from the
    writer's weights this way, whether it built, warm-started or resumed them. torch's
    set_model_state_dict(broadcast_from_rank0), used before, held the whole state dict on
    every rank at once. A follower's model may have been built on the meta device and
    materialized empty (`to_empty`): this gives every parameter and buffer its value. A
    single process: load_state_dict."""
    if not ranks.joined:
        model.load_state_dict(full)
        return
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        for name, p in model.named_parameters():  # a tied parameter once
            src = (full[name].to(ranks.device) if ranks.is_writer
                   else torch.empty(p.shape, dtype=p.dtype, device=ranks.device))
            if isinstance(p, DTensor):
                shard = distribute_tensor(src, p.device_mesh, p.placements)
                p.to_local().copy_(shard.to_local())
            else:
                dist.broadcast(src, src=0)
                p.copy_(src)
            del src
        for _, b in model.named_buffers():
            dist.broadcast(b, src=0)
