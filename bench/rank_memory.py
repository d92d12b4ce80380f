"""Peak resident memory per trainer rank for a Qwen3-0.6B-shaped model: 2 torchrun ranks
against one process (issue 28; goal: the largest rank <= 0.6x the process's peak).

    python -m bench.rank_memory [--quick] [--json PATH]

Set-up (not measured). A Qwen3ForCausalLM of Qwen3-0.6B's shape (hidden 1024, 28 layers,
MLP 3072, 16 attention heads, 8 key/value heads, head_dim 128, vocabulary 151,936, tied
embeddings: 596,049,920 parameters), random weights (normal, std 0.02; norms 1), saved with
`save_pretrained` in bf16 as the real checkpoint is, with the tokenizer `--model tiny` builds
(tiny.build_tokenizer on the train set's text: 640 tokens). A model vocabulary larger than
its tokenizer is what the product meets anyway (Qwen3-0.6B's 151,936 rows hold 151,669
tokens): `load_policy` takes it, evaluations decode what they sample, and the intake refuses
any token id past the tokenizer's. `vrl trainer --model <folder>` loads it as any Hugging Face
folder. A random model earns no reward, so a volunteer's groups would all have one reward
for all K and the trainer would never step (a warm start of 0.6 B parameters is no set-up
step); so the bench writes the groups itself, as two volunteers would upload them (ids
chosen so that each rank's intake owns one, `ranks.owner_rank`), with the product's
`encode_shard`: once v0's manifest is out, one shard of 2 groups each under rollouts/v000000/,
every group for the prompt its number draws from v0's pool (`pool_prompt`), K = 8
completions, 4 the target expression + EOS (reward 1) and 4 a wrong one (reward 0), each
token with the behavior logprob of a uniform policy (-ln vocabulary), near what the random
model gives it, so the GRPO ratios stay near 1. With audits off nothing replays them; the
intake checks and rescores them as any shard.

Measured, one side after the other, each on a fresh folder bucket and work dir with the
same flags: `vrl trainer` as one plain process (`vrl_command`), then as 2 gloo ranks under
torchrun (`vrl_ranks_command(2, ...)`), every process with `OMP_NUM_THREADS=1 --threads 1`.
Each loads the model, publishes v0 and evaluates it, takes the 4 groups, trains 2 steps of 2
groups, publishes v1 (`--publish-every 2 --max-steps 2`; fp32 weights, the default) and
evaluates it (a final publish always does; --eval-dataset holds 2 rows), and exits 0.
`--micro-batch 8`: one group (K rows) per forward and backward on both sides, so a process's
activations are the same either way and the ratio is about the model's state, not about a
batch split in two. `--audit-tolerance 0 --eval-every 0 --dashboard-every 0`, and
`--patch-max-fraction 0.25` (PATCH_MAX_FRACTION says why). A process's peak is the kernel's
high-water mark of its resident memory (/proc/<pid>/status VmHWM), read every 0.5 s for the
trainer process, or for each rank (the children of torchrun, told apart by their RANK), the
last read before it exits being its peak; the final publish and evaluation come well before
the exit. torchrun's own process and the bench's are not counted, nor any volunteer's. The
getrusage max RSS of each side's process tree (wait4) is printed as a check.

Rows: the largest rank's peak (vrl) against the single process's (baseline), in GiB; ratio =
process / rank, as for a time (> 1: the rank needs less), so the issue's goal, rank <= 0.6x
the process, is ratio >= 1.67. Second row: the follower's peak against the same baseline.
The note gives the writer's and the follower's peaks and each peak in bytes a parameter.

What to expect, counted in bytes a parameter (P = 596 M; each process's runtime, ~0.5 GiB,
and one micro-batch of activations come on top):

- one process: weights, gradient and two AdamW moments 16; while it publishes v1, v0's file
  kept as the base of a patch (WeightsChain.last) 4, v1's file made in a new buffer 4, and
  count_changed's comparison of the two 1; while it saves its state, safetensors' copies of
  the moments; 25 and more, 14.9 GB. With fp32 weights and audits off it holds no second
  copy of the model and no window versions.
- each rank, lean (trainer.learner.Learner.lean: fp32 weights, audits off, as here): its shards
  of weights, gradient and moments 8; while the optimizer's shards are saved, two copies of
  one file of at most 256 MiB (state.FILE_BYTES); the writer while it publishes, the new
  weights file 4 and one gathered tensor at a time (the embedding, ~1), and nothing whole
  between publishes (v0's and v1's files wait on disk as the next patch's base); the
  follower built empty and filled one tensor at a time at start. During a step FSDP2's
  all-gathered blocks and the root's unsharded embedding (0.6 GB) and its gradient. About
  12-14, 0.45-0.5x the process.

Measured before the ranks were lean (7534bca, 37e1bd3, 76e9856; docs/PERFORMANCE.md has the
history): the writer held an unsharded copy, the gathered state dict, the new file and the
last one, and was killed for lack of memory at 13.5 GiB (>= 0.87x); streamed publishing
brought both ranks to 11.4 GiB (0.73x), where the rest was the optimizer save: one file per
rank, serialized twice in memory (4.4 GiB).

docs/SCALE.md counts, with audits on (the default): one process 36 a parameter (16, the audit
copy 4, the window's three published versions 12, the patch base 4), the writer 28 and a
follower 24, 0.78: audits need whole copies on every auditing rank. Audits are off here
because a full-size run with them on does not fit this machine (24 GiB): one process would
hold 28-36 bytes a parameter, 17-21 GB, and the two ranks together ~52, 31 GB. Run it on an
otherwise idle machine with 16 GB free, and ~14 GB of free disk (a side's bucket and state,
deleted after each side).

--quick: a tiny Qwen3 shape (vocabulary 1,024, hidden 64, 2 layers) checks the code path in
well under a minute a side; its figures are the Python runtime's, not the model's.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.common import Row, cli

COMMAND = "python -m bench.rank_memory"
RANKS = 2
GOAL = 0.6
"""The issue's goal: the largest rank's peak at most this share of one process's."""
STEPS = 2
GROUPS_PER_STEP = 2  # a multiple of RANKS: each rank computes one group
K = 8  # the trainer's default
MAX_NEW_TOKENS = 32  # the trainer's default; the longest train-set answer is 16 tokens + EOS
PATCH_MAX_FRACTION = 0.25
"""Below the default 0.5, so that WeightsChain.plan's "cannot pay" test (changed words x 4 x
0.5 against the limit) skips making a patch for v1, whose every fp32 word changed: making
one takes ~34 bytes a changed word for a moment (make_patch's index arrays and copies,
measured at 11.5 M parameters), ~20 GB more at 0.6 B on either side, which this machine does
not have. v1 goes out whole either way at this size (its patch came to ~0.8 of the file)."""
POLL_SECONDS = 0.5
GIB = float(1 << 30)
EVAL_ROWS = 2


@dataclass(frozen=True)
class Shape:
    label: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int


FULL = Shape("Qwen3-0.6B shape", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
             num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128)
QUICK = Shape("tiny Qwen3 shape", vocab_size=1024, hidden_size=64, intermediate_size=192,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
TIMEOUT = {True: 900.0, False: 7200.0}
"""Seconds one side may take (quick, full) before it is stopped and the bench fails."""


def log(msg: str) -> None:
    print(msg, flush=True)


# ---------------------------------------------------------------------------------------------
# Set-up: the model folder, the eval rows, and the groups the two volunteers upload.

def train_problems():
    from volunteer_rl.config import PACKAGE_DATA
    from volunteer_rl.task.dataset import load_csv

    return load_csv(PACKAGE_DATA / "train.csv")


def save_model(shape: Shape, folder: Path, problems) -> int:
    """A random Qwen3ForCausalLM of `shape` in bf16 and `--model tiny`'s tokenizer, saved as
    a Hugging Face folder with save_pretrained; its parameter count."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from volunteer_rl.model.policy import quiet_transformers
    from volunteer_rl.model.tiny import build_tokenizer

    quiet_transformers()  # no progress bar for the save
    tokenizer = build_tokenizer([p.prompt for p in problems] + [p.expression for p in problems])
    dims = {k: v for k, v in asdict(shape).items() if k != "label"}
    config = Qwen3Config(**dims, tie_word_embeddings=True, max_position_embeddings=40960,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=None)
    with torch.device("meta"):  # no init pass over 0.6 B parameters: filled below, in bf16
        model = Qwen3ForCausalLM(config)
    model = model.to(torch.bfloat16).to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.tie_weights()
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    del model
    return params


def write_eval_rows(path: Path) -> None:
    """The first EVAL_ROWS held-out rows: v0's and the final evaluation take a moment."""
    from volunteer_rl.config import PACKAGE_DATA

    lines = (PACKAGE_DATA / "eval.csv").read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:EVAL_ROWS + 1]))


def volunteer_ids() -> list[str]:
    """One volunteer id for each rank's intake (ranks.owner_rank), the same on both sides."""
    from volunteer_rl.trainer.ranks import owner_rank

    ids: dict[int, str] = {}
    n = 0
    while len(ids) < RANKS:
        vid = f"bench-vol-{n}"
        ids.setdefault(owner_rank(vid, RANKS), vid)
        n += 1
    return [ids[r] for r in range(RANKS)]


def write_groups(bucket: Path, manifest, tokenizer, problems, vocab: int, secret: bytes) -> int:
    """Each volunteer's shard of its groups 0, 1, ... for `manifest`'s version: every group
    for the prompt its number draws (as granted for that version by the trainer of `secret`,
    its grant secret), half its completions right and half wrong (see the module docstring);
    the number of groups written."""
    from volunteer_rl.protocol import layout
    from volunteer_rl.protocol.draws import pool_prompt
    from volunteer_rl.protocol.grants import seq_nonce
    from volunteer_rl.protocol.shards import Completion, Group, encode_shard, new_shard_name
    from volunteer_rl.storage import open_storage
    from volunteer_rl.task.reward import completion_reward

    storage = open_storage(str(bucket))
    eos, special = tokenizer.eos_token_id, frozenset(tokenizer.all_special_ids)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731 (Policy.decode_all)
    logprob = -math.log(vocab)
    per_volunteer = STEPS * GROUPS_PER_STEP // len(volunteer_ids())
    written = 0
    for vid in volunteer_ids():
        groups = []
        for seq in range(per_volunteer):
            pid = pool_prompt(manifest.prompt_pool, manifest.run_id, manifest.version, vid, seq,
                              seq_nonce(secret, manifest.run_id, vid, manifest.version, seq))
            p = problems[pid]
            # The wrong answer differs by group, so no two groups share their content.
            answers = [p.expression, f"{p.expression} + {seq + 1}"]
            completions = []
            for i in range(K):
                ids = tokenizer(answers[i % 2], add_special_tokens=False)["input_ids"] + [eos]
                if len(ids) > MAX_NEW_TOKENS:
                    raise RuntimeError(f"prompt {pid}: an answer of {len(ids)} tokens")
                r = completion_reward(ids, p.expression, decode, eos, special)
                completions.append(Completion(ids, [logprob] * len(ids),
                                              tokenizer.decode(ids, skip_special_tokens=True), r))
            if len({c.reward for c in completions}) != 2:
                raise RuntimeError(f"prompt {pid}: no reward variance in the group written")
            groups.append(Group(pid, manifest.version, vid, seq, completions))
        storage.create(layout.shard_key(manifest.version, vid, new_shard_name(0)),
                       encode_shard(groups))
        written += len(groups)
    return written


# ---------------------------------------------------------------------------------------------
# Measuring: the trainer's processes, their VmHWM every POLL_SECONDS.

def vm_hwm(pid: int) -> int | None:
    """The process's peak resident bytes so far (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def children(pid: int) -> list[int]:
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def rank_of(pid: int) -> int | None:
    """The RANK torchrun gave the process (None: not a rank, or gone)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            for item in f.read().split(b"\0"):
                if item.startswith(b"RANK="):
                    return int(item[5:])
    except (OSError, ValueError):
        pass
    return None


@dataclass
class Side:
    peaks: dict[int, int]
    """Rank (0 for the single process) -> peak resident bytes."""
    tree_max_rss: int
    """getrusage (wait4) max RSS of the process tree, bytes: a check."""
    seconds: float
    steps: int
    version: int
    step_seconds: tuple[float, ...] = ()
    """Each step's `train/step_time` from the metrics, in step order."""


def trainer_args(bucket: Path, work: Path, model: Path, eval_csv: Path,
                 extra: tuple[str, ...] = ()) -> list[str]:
    return ["trainer", "--bucket", str(bucket), "--work-dir", str(work), "--model", str(model),
            "--eval-dataset", str(eval_csv), "--audit-tolerance", "0", "--eval-every", "0",
            "--dashboard-every", "0", "--weights-dtype", "fp32", "-k", str(K),
            "--max-new-tokens", str(MAX_NEW_TOKENS), "--groups-per-step", str(GROUPS_PER_STEP),
            "--micro-batch", str(K), "--max-steps", str(STEPS), "--publish-every", str(STEPS),
            "--threads", "1", "--poll-seconds", "0.2", "--rank-timeout", "3600",
            # No patch is tried: see PATCH_MAX_FRACTION.
            "--patch-max-fraction", str(PATCH_MAX_FRACTION),
            *extra]  # last: a flag given twice takes its last value


def run_side(root: Path, ranks: int, model: Path, eval_csv: Path, tokenizer, problems,
             vocab: int, timeout: float, extra: tuple[str, ...] = ()) -> Side:
    """`vrl trainer` (as `ranks` torchrun ranks; 0: one plain process; `extra` flags after
    the bench's) on a fresh bucket, fed the groups once v0 is out, until it exits; each
    process's peak."""
    from volunteer_rl.launch import stop, vrl_command, vrl_env, vrl_ranks_command
    from volunteer_rl.protocol import layout
    from volunteer_rl.protocol.manifest import read_manifest
    from volunteer_rl.protocol.grants import grant_secret
    from volunteer_rl.protocol.signing import Trust, parse_private_key
    from volunteer_rl.storage import open_storage

    root.mkdir(parents=True)
    bucket, work, out = root / "bucket", root / "work", root / "trainer.log"
    args = trainer_args(bucket, work, model, eval_csv, extra)
    command = vrl_ranks_command(ranks, *args) if ranks else vrl_command(*args)
    peaks: dict[int, int] = {}
    fed = False
    started = time.monotonic()
    with open(out, "w") as f:
        p = subprocess.Popen(command, cwd=root, env=vrl_env({"OMP_NUM_THREADS": "1"}),
                             stdout=f, stderr=subprocess.STDOUT)
    try:
        while True:
            for pid in (children(p.pid) if ranks else [p.pid]):
                rank = rank_of(pid) if ranks else 0
                hwm = vm_hwm(pid)
                if rank is not None and hwm is not None:
                    peaks[rank] = max(peaks.get(rank, 0), hwm)
            done, status, usage = os.wait4(p.pid, os.WNOHANG)
            if done:
                p.returncode = os.waitstatus_to_exitcode(status)
                break
            if not fed and (bucket / layout.MANIFEST).exists():
                manifest = read_manifest(open_storage(str(bucket)), trust=Trust(allow_unsigned=False))
                key = parse_private_key((work / "signing-key.pem").read_bytes(), "the trainer's key")
                n = write_groups(bucket, manifest, tokenizer, problems, vocab, grant_secret(key))
                log(f"  v{manifest.version} is out after {time.monotonic() - started:.0f}s: wrote "
                    f"{n} groups in {len(volunteer_ids())} shards")
                fed = True
            if time.monotonic() - started > timeout:
                stop([p])
                raise SystemExit(f"vrl trainer ({ranks or 1} process(es)) did not finish in "
                                 f"{timeout:.0f}s:\n" + "\n".join(out.read_text().splitlines()[-40:]))
            time.sleep(POLL_SECONDS)
    except BaseException:
        if p.returncode is None:
            stop([p])
        raise
    seconds = time.monotonic() - started
    text = out.read_text()
    if p.returncode != 0:
        raise SystemExit(f"vrl trainer exited {p.returncode}:\n" + "\n".join(text.splitlines()[-40:]))
    lines = [json.loads(line) for path in sorted((bucket / "metrics").glob("v*.jsonl"))
             for line in path.read_text().splitlines()]
    step_lines = [m for m in lines if m.get("kind") == "step"]
    steps = len(step_lines)
    version = int(json.loads((bucket / layout.MANIFEST).read_text())["version"])
    if steps != STEPS or version != 1:
        raise SystemExit(f"expected {STEPS} steps and v1, found {steps} steps and v{version}:\n"
                         + "\n".join(text.splitlines()[-40:]))
    want = set(range(ranks)) if ranks else {0}
    if set(peaks) != want:
        raise SystemExit(f"peaks read for ranks {sorted(peaks)}, expected {sorted(want)}")
    return Side(peaks, usage.ru_maxrss * 1024, seconds, steps, version,
                tuple(m["train/step_time"] for m in step_lines))


def gib(n: int) -> float:
    return n / GIB


def prepare(shape: Shape, tmp: Path, problems) -> tuple[Path, Path, object, int]:
    """The set-up every side shares, in `tmp`: (the model folder, saved in bf16; the eval CSV;
    the model's tokenizer; its parameter count)."""
    from transformers import AutoTokenizer

    started = time.time()
    model, eval_csv = tmp / "model", tmp / "eval.csv"
    params = save_model(shape, model, problems)
    write_eval_rows(eval_csv)
    tokenizer = AutoTokenizer.from_pretrained(str(model), local_files_only=True)
    log(f"{shape.label}: {params:,} parameters (vocabulary {shape.vocab_size:,}, tokenizer "
        f"{len(tokenizer)}), saved in bf16 in {time.time() - started:.0f}s")
    return model, eval_csv, tokenizer, params


def results(quick: bool, shape: Shape | None = None) -> list[Row]:
    shape = shape or (QUICK if quick else FULL)
    command = COMMAND + (" --quick" if quick else "")
    timeout = TIMEOUT[quick]
    problems = train_problems()
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="vrl-rank-memory-") as tmp:
        tmp = Path(tmp)
        model, eval_csv, tokenizer, params = prepare(shape, tmp, problems)
        sides = {}
        for ranks in (0, RANKS):
            what = "one process" if not ranks else f"{ranks} ranks under torchrun"
            log(f"{what}: {STEPS} steps of {GROUPS_PER_STEP} groups, v1, audits off")
            side = run_side(tmp / f"ranks-{ranks}", ranks, model, eval_csv, tokenizer, problems,
                            shape.vocab_size, timeout)
            log("  peaks " + ", ".join(f"rank {r} {gib(b):.3f} GiB ({b / params:.1f} B/param)"
                                       for r, b in sorted(side.peaks.items()))
                + f"; wait4 max RSS of the tree {gib(side.tree_max_rss):.3f} GiB; "
                f"{side.seconds:.0f}s")
            shutil.rmtree(tmp / f"ranks-{ranks}")  # a full-size bucket and state: ~10 GB of disk
            sides[ranks] = side
    single = sides[0].peaks[0]
    writer, follower = sides[RANKS].peaks[0], sides[RANKS].peaks[1]
    largest = max(sides[RANKS].peaks.values())
    largest_rank = max(sides[RANKS].peaks, key=sides[RANKS].peaks.get)
    setting = (f"{params:,} parameters, fp32 weights, audits off, no patch tried, {STEPS} steps "
               f"of {GROUPS_PER_STEP} groups (K {K}, one group per micro-batch) then v1, 1 thread "
               f"per process; volunteers' memory not counted")
    per_param = (f"bytes a parameter: process {single / params:.1f}, writer {writer / params:.1f}, "
                 f"follower {follower / params:.1f}")
    check = (f"wait4 max RSS: process {gib(sides[0].tree_max_rss):.2f}, ranks' tree "
             f"{gib(sides[RANKS].tree_max_rss):.2f} GiB")
    took = f"both runs {time.time() - started:.0f}s"
    return [
        Row(benchmark=f"trainer peak memory per rank, {shape.label}, {RANKS} ranks",
            measure="GiB peak resident (VmHWM): largest rank (vrl) vs one process",
            vrl=gib(largest), baseline=gib(single), ratio=single / largest,
            goal=f">= {1 / GOAL:.2f} (rank <= {GOAL:g}x the process's peak)",
            met=largest <= GOAL * single, command=command,
            note=(f"rank/process {largest / single:.2f}; largest: rank {largest_rank} "
                  f"({'writer' if largest_rank == 0 else 'follower'}); writer {gib(writer):.2f} "
                  f"GiB, follower {gib(follower):.2f} GiB; {per_param}; {setting}; {check}; {took}")),
        Row(benchmark=f"trainer peak memory, follower rank, {shape.label}, {RANKS} ranks",
            measure="GiB peak resident (VmHWM): rank 1 (vrl) vs one process",
            vrl=gib(follower), baseline=gib(single), ratio=single / follower, goal="-", met=None,
            command=command,
            note=f"rank/process {follower / single:.2f}; the follower holds no unsharded copy "
                 f"with audits off; {setting}"),
    ]


if __name__ == "__main__":
    sys.exit(cli(results, __doc__))
