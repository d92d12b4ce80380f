"""The trainer's step rate while hostile writers flood its bucket (issue 13).

    python -m bench.hostile_flood [--quick] [--json PATH]

Three runs, one after the other, each on a fresh local folder bucket, each with the two cores to
itself for the budget (240 s; 40 s with --quick):

- baseline: `vrl demo`'s processes with one volunteer (`demo.start_processes`: 1 trainer and
  1 honest `vrl volunteer`, 1 torch thread each, GRPO, 32 groups per step, the volunteer at
  niceness 10 and 48 groups per version), started with `--model` on the shared v0 of
  bench.trl_time_to_accuracy and the trainer's own evaluations off;
- flooded: the same two processes with the same settings, plus 3 hostile writers that write
  straight into the bucket folder for the whole run (no vrl code: plain Python threads in one
  process of their own, `flood_child`), once at each niceness of WRITERS_NICE: one row each.

The trainer keeps its defaults for everything the flood touches: `--deny-after 5`,
`--deny-rate 0.5`, audit on (tolerance 0.05), MAX_OBJECTS_PER_VOLUNTEER_VERSION objects per
volunteer and version considered.

**The writers.** One thread per hostile id (`hostile-1..3`), each writing under
`rollouts/v<current>/<its id>/` only (what the deployed IAM policies let a volunteer write),
`<current>` read from manifest.json as any volunteer reads it. Every object is pre-built bytes
written to a hidden temp name and renamed (one atomic PUT); names start with a sequence number,
so the trainer lists each writer's objects in the order written. In every new version each
writer first writes its heavy shapes once:

- `late_reward`: SHARD_GROUPS_LIMIT lines (the manifest's `max_shard_groups`: the most a
  shard may hold), each a well-formed group at the manifest's
  k = 8 x 32 tokens (512 numbers per line), every line a different group (drawn from
  DISTINCT_GROUPS) so the reward cache does not absorb the rescoring; the last line's reward is forged. The trainer decompresses,
  parses, checks and rescores every line before `reward_mismatch`;
- `late_audit`: the same with honest rewards and made-up behavior logprobs: everything passes
  until the audit forward pass (`logprob_mismatch`);
- `gzip_bomb`: 64 MiB + 1 of newlines in 65 KB (`too_large` at the decompression cap);
- `not_json`: a line at the line budget that is not JSON (`bad_json`);
- `duplicate`: the newest honest shard, re-labelled with the writer's id (a copy: refused).
  This one reads the honest volunteer's folder, which the IAM policies forbid: an insider's
  attack, kept because the issue lists it.

then, until the version changes, the cheapest objects there are: 1-byte objects with junk
names, every other one in a folder of its own (`bad_key`; the trainer's LIST walks every
folder). The two line-budget shapes name the version in every line, so they are pre-built
(before the clock) for versions 0..COSTLY_VERSIONS-1 only: they can only cost the trainer
anything until their writer is denied, which the defaults do after 5 rejections, at the
trainer's first poll. A janitor thread of the writers' process deletes the writers' folders of
versions below the window (the trainer never lists them again), so the disk does not fill.

**Measured.** Trainer optimizer steps per second of RL: steps whose metrics line
(metrics/vNNNNNN.jsonl, docs/PROTOCOL.md) is stamped within the budget after v0's manifest,
divided by the budget. Ratio flooded / baseline, goal >= 0.8. Also printed: the trainer's own
split of its time (`time/ingest`, `time/waiting_for_rollouts`, `train/step_time`,
`time/last_publish`), the CPU seconds of the trainer, the volunteer and the writers (from
/proc and the writers' own rusage), objects written per shape, shards rejected by reason,
volunteers denied, and the skip counts the trainer records (`ingest/over_cap`: volunteer
folders found over the cap, once per version; `ingest/denied_shards`: a denied volunteer's
folder, never listed, counts once per poll that skips it).
"""

from __future__ import annotations

import gzip
import json
import os
import random
import resource
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from bench.common import Row, cli, machine
from bench.trl_time_to_accuracy import FULL, QUICK, Plan, _pump, log, run_child, shared_start

COMMAND = "python -m bench.hostile_flood"
CHILD = "--flood-child"
HOSTILE_IDS = ("hostile-1", "hostile-2", "hostile-3")
HONEST_ID = "demo-1"  # the id demo.start_processes gives its first volunteer
COSTLY_VERSIONS = 3
"""Versions (0, 1, 2: the window at the trainer's first polls) the line-budget shapes are
pre-built for."""
DISTINCT_GROUPS = 1024
"""Distinct groups to draw a line-budget shard's SHARD_GROUPS_LIMIT lines from (repeated when
there are more lines than these): enough that rescoring is not all cache hits."""
WRITERS_NICE = (19, 0)
"""Niceness of the writers' process, one flooded run each. 19: the writers get the CPU the
trainer and the honest volunteer leave, as if they ran on machines of their own (an attacker's
CPU is not the trainer's), so the run measures what the flood costs through the bucket. 0: as
an attacker's process on the trainer's own machine would run, taking a core from the honest
volunteer (niceness 10, as in `vrl demo`), so that run measures the machine as much as vrl."""
JANITOR_MARGIN = 1
"""The janitor deletes versions below current - max_staleness - this."""


# ---------------------------------------------------------------------------------------------
# The hostile payloads, built before the clock.

def _groups(model_dir: Path, n: int, k: int, tokens: int, seed: int) -> list[dict]:
    """`n` well-formed groups of `k` completions of `tokens` random token ids each, rewards
    computed as the trainer computes them (the task is public), logprobs made up."""
    from volunteer_rl.config import PACKAGE_DATA
    from volunteer_rl.model.policy import load_policy
    from volunteer_rl.task.dataset import load_csv
    from volunteer_rl.task.reward import completion_reward

    policy = load_policy(model_dir, "cpu")
    tok = policy.tokenizer
    problems = load_csv(PACKAGE_DATA / "train.csv")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = problems[rng.randrange(len(problems))]
        comps = []
        for _ in range(k):
            ids = [rng.randrange(3, len(tok)) for _ in range(tokens)]
            text = tok.decode(ids, skip_special_tokens=True)
            comps.append({"token_ids": ids, "logprobs": [-rng.uniform(0.01, 6.0) for _ in ids],
                          "text": text,
                          "reward": completion_reward(ids, p.expression, policy.decode_all,
                                                      policy.eos_id, policy.special_ids)})
        out.append({"prompt_id": p.id, "policy_version": 0, "volunteer_id": "", "seq": len(out),
                    "completions": comps})
    return out


def _late_shard(pool: list[dict], volunteer: str, version: int, forge_last: bool) -> bytes:
    """SHARD_GROUPS_LIMIT lines of `pool`'s groups, spread over the pool; with `forge_last`,
    the last line's first reward flipped."""
    from volunteer_rl.protocol.shards import SHARD_GROUPS_LIMIT

    n = SHARD_GROUPS_LIMIT
    lines = []
    for i in range(n):
        g = pool[i * len(pool) // n]
        lines.append(json.dumps({**g, "policy_version": version, "volunteer_id": volunteer, "seq": i}))
    if forge_last:
        last = json.loads(lines[-1])
        last["completions"][0]["reward"] = 1.0 - last["completions"][0]["reward"]
        lines[-1] = json.dumps(last)
    return gzip.compress(("\n".join(lines) + "\n").encode(), compresslevel=6, mtime=0)


def build_payloads(model_dir: Path, out: Path, k: int, max_new_tokens: int) -> dict:
    """Every writer's pre-built bytes as files under `out`; returns their index for the spec."""
    from volunteer_rl.protocol.shards import MAX_DECOMPRESSED_BYTES, Budget

    out.mkdir(parents=True)
    pool = _groups(model_dir, DISTINCT_GROUPS, k, max_new_tokens, seed=13)
    shared = {
        "gzip_bomb": gzip.compress(b"\n" * (MAX_DECOMPRESSED_BYTES + 1), compresslevel=9, mtime=0),
        "not_json": gzip.compress(b"not json " * (Budget(k, max_new_tokens).line_bytes // 9) + b"\n",
                                  mtime=0),
    }
    index: dict = {"shared": {}, "costly": {}}
    for name, data in shared.items():
        (out / name).write_bytes(data)
        index["shared"][name] = str(out / name)
    for vid in HOSTILE_IDS:
        for v in range(COSTLY_VERSIONS):
            for shape, forge in (("late_reward", True), ("late_audit", False)):
                path = out / f"{vid}-{shape}-v{v}"
                path.write_bytes(_late_shard(pool, vid, v, forge))
                index["costly"][f"{vid}/{shape}/{v}"] = str(path)
    return index


# ---------------------------------------------------------------------------------------------
# The writers' process.

def watch_manifest(bucket: Path, stop_file: str, stop: threading.Event, state: dict) -> None:
    """Keep state["version"] and state["manifest"] (manifest.json parsed) current, as a
    volunteer polls it, until `stop` is set; set it once `stop_file` exists."""
    manifest, seen = bucket / "manifest.json", None
    while not stop.is_set():
        if os.path.exists(stop_file):
            stop.set()
            break
        try:
            st = manifest.stat()
            if (st.st_mtime_ns, st.st_size) != seen:
                m = json.loads(manifest.read_bytes())
                state["manifest"], state["version"] = m, int(m["version"])
                seen = (st.st_mtime_ns, st.st_size)
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.02)


def run_until_stopped(threads: list[threading.Thread], stop: threading.Event,
                      state: dict) -> tuple[float, float | None]:
    """Start `threads`, wait until `stop` is set, join them; (when they started, when the
    first version was seen: writing began)."""
    started, first_write = time.time(), None
    for t in threads:
        t.start()
    while not stop.wait(0.05):
        if first_write is None and state["version"] is not None:
            first_write = time.time()
    for t in threads:
        t.join(timeout=10)
    return started, first_write


def flood_child(spec: dict) -> None:
    """3 writer threads, a manifest watcher and a janitor, until spec["stop_file"] exists;
    then run.json (objects per shape, bytes, CPU seconds) into spec["out"]."""
    if spec["nice"]:
        os.nice(spec["nice"])
    bucket, ids = Path(spec["bucket"]), spec["ids"]
    shared = {name: Path(p).read_bytes() for name, p in spec["payloads"]["shared"].items()}
    costly = {key: Path(p).read_bytes() for key, p in spec["payloads"]["costly"].items()}
    stop, state = threading.Event(), {"version": None}
    lock = threading.Lock()
    counts = {vid: Counter() for vid in ids}
    written_bytes = Counter()
    janitor = Counter()
    dup: dict[str, tuple[int, str, bytes]] = {}  # writer id -> (version, honest key, bytes)

    def watch() -> None:
        watch_manifest(bucket, spec["stop_file"], stop, state)

    def copy_honest() -> None:
        """The newest honest shard of the current version, re-labelled for each writer."""
        last = None
        while not stop.wait(0.5):
            v = state["version"]
            folder = bucket / "rollouts" / f"v{v:06d}" / spec["honest_id"] if v is not None else None
            try:
                names = sorted(n for n in os.listdir(folder) if n.endswith(".jsonl.gz")) if folder else []
            except OSError:
                names = []
            if not names or (v, names[-1]) == last:
                continue
            last = (v, names[-1])
            try:
                rows = [json.loads(line) for line in gzip.decompress((folder / names[-1]).read_bytes()).splitlines()]
            except (OSError, ValueError):
                continue
            for vid in ids:
                data = gzip.compress("".join(json.dumps({**r, "volunteer_id": vid}) + "\n" for r in rows).encode(),
                                     compresslevel=6, mtime=0)
                with lock:
                    dup[vid] = (v, names[-1], data)

    def clean() -> None:
        """Delete the writers' folders of versions the trainer will never list again."""
        while not stop.wait(1.0):
            v = state["version"]
            if v is None:
                continue
            low = v - spec["max_staleness"] - JANITOR_MARGIN
            for old in range(max(0, janitor["next"]), max(0, low)):
                for vid in ids:
                    folder = bucket / "rollouts" / f"v{old:06d}" / vid
                    if folder.is_dir():
                        janitor["files"] += sum(len(f) for _, _, f in os.walk(folder))
                        shutil.rmtree(folder, ignore_errors=True)
                janitor["next"] = old + 1

    def put(folder: Path, name: str, data: bytes, vid: str, shape: str) -> None:
        path = folder / name
        tmp = folder / f".tmp-{name.replace('/', '-')}"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError:  # the janitor removed the folder of a version that just ended
            counts[vid]["failed"] += 1
            return
        counts[vid][shape] += 1
        written_bytes[vid] += len(data)

    def write(vid: str) -> None:
        seq, mine = 0, None
        while not stop.is_set():
            v = state["version"]
            if v is None:  # no manifest yet: nothing to write against
                time.sleep(0.02)
                continue
            folder = bucket / "rollouts" / f"v{v:06d}" / vid
            if v != mine:  # a new version: the heavy shapes once
                mine = v
                heavy = [(s, costly[f"{vid}/{s}/{v}"]) for s in ("late_reward", "late_audit")
                         if f"{vid}/{s}/{v}" in costly]  # pre-built for versions < COSTLY_VERSIONS
                heavy += [("gzip_bomb", shared["gzip_bomb"]), ("not_json", shared["not_json"])]
                for shape, data in heavy:
                    seq += 1
                    put(folder, f"{seq:09d}-{shape}.jsonl.gz", data, vid, shape)
                with lock:
                    d = dup.pop(vid, None)
                if d is not None:  # into the honest shard's own version folder
                    seq += 1
                    put(bucket / "rollouts" / f"v{d[0]:06d}" / vid, f"{seq:09d}-dup.jsonl.gz", d[2], vid,
                        "duplicate")
            seq += 1
            if seq % 2:
                put(folder, f"{seq:09d}-junk.txt", b"x", vid, "junk_name")
            else:
                put(folder, f"{seq:09d}-d/x.jsonl.gz", b"x", vid, "junk_in_folder")

    errors: list[str] = []

    def guarded(fn, *args):
        def run():
            try:
                fn(*args)
            except BaseException as exc:  # a writer that dies must fail the run, not shrink the flood
                errors.append(f"{fn.__name__}{args}: {exc!r}")
                stop.set()
        return threading.Thread(target=run, daemon=True)

    threads = [guarded(f) for f in (watch, copy_honest, clean)] + [guarded(write, vid) for vid in ids]
    started, first_write = run_until_stopped(threads, stop, state)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    (Path(spec["out"]) / "run.json").write_text(json.dumps({
        "counts": {vid: dict(c) for vid, c in counts.items()}, "bytes": dict(written_bytes),
        "cpu_user": usage.ru_utime, "cpu_system": usage.ru_stime,
        "wall": time.time() - started, "writing": time.time() - (first_write or time.time()),
        "janitor_deleted": janitor["files"], "errors": errors}))
    return 1 if errors else 0


# ---------------------------------------------------------------------------------------------
# The runs.

def _cpu_seconds(pid: int) -> float | None:
    """user + system CPU seconds of a live process, from /proc (None once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """The last CPU reading of each process, taken every half second until stopped."""

    def __init__(self, procs: dict[str, int]):
        self.procs, self.seconds = procs, {name: 0.0 for name in procs}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            for name, pid in self.procs.items():
                s = _cpu_seconds(pid)
                if s is not None:
                    self.seconds[name] = s
            if self.done.wait(0.5):
                return

    def stop(self) -> dict[str, float]:
        self.done.set()
        self.thread.join()
        return self.seconds


def run_contender(name: str, model: Path, plan: Plan, work: Path, payloads: dict | None,
                  writers_nice: int = 0, child: str = "bench.hostile_flood", child_flag: str = CHILD,
                  ids: tuple[str, ...] = HOSTILE_IDS) -> dict:
    """One run: the demo's trainer and one volunteer on a fresh folder bucket for the plan's
    budget, with the hostile writers alongside if `payloads`: `python -m <child> <child_flag>
    <spec>` writing as `ids` (bench.audit_parking brings its own writer). Returns what the
    bucket and the processes tell about it."""
    from volunteer_rl.config import PACKAGE_DATA
    from volunteer_rl.demo import DemoSettings, start_processes, stop

    bucket = work / "bucket"
    bucket.mkdir(parents=True)
    tiny_eval = work / "eval-4.csv"  # makes the trainer's own v0/final evaluations ~free
    lines = (PACKAGE_DATA / "eval.csv").read_text().splitlines(keepends=True)
    tiny_eval.write_text("".join(lines[:5]))
    settings = DemoSettings(bucket=str(bucket), volunteers=1, rl_seconds=plan.budget, extra_trainer_args=(
        "--model", str(model), "--eval-every", "0", "--eval-dataset", str(tiny_eval)))
    load_before = os.getloadavg()[0]
    trainer, volunteers = start_processes(settings, bucket)
    cpu = CpuMeter({"trainer": trainer.pid, "volunteer": volunteers[0].pid})
    tail: list[str] = []
    pumps = [_pump(p, name, tail, lambda line: line.startswith(("denied", "error", "warning")))
             for p in (trainer, *volunteers)]
    flood: dict = {}
    flood_thread = None
    if payloads is not None:
        out = work / "flood"
        out.mkdir()
        spec = {"bucket": str(bucket), "ids": list(ids), "honest_id": HONEST_ID,
                "payloads": payloads, "stop_file": str(work / "stop"), "out": str(out),
                "nice": writers_nice, "max_staleness": 2,
                # the demo trainer's signing key: a writer that must pass the prompt rule deals
                # itself the nonces the trainer would grant (protocol.grants)
                "trainer_key": str(work / "work" / "trainer" / "signing-key.pem")}

        def run_flood():
            try:
                flood.update(run_child(child, child_flag, spec, "writers", lambda line: True,
                                       plan, "the hostile writers"))
            except BaseException as exc:  # reported after the run
                flood["error"] = repr(exc)

        flood_thread = threading.Thread(target=run_flood, daemon=True)
        flood_thread.start()
    try:
        code = trainer.wait(timeout=plan.budget + 900)
    finally:
        (work / "stop").touch()
        seconds = cpu.stop()
        stop([*volunteers, trainer])
        if flood_thread is not None:
            flood_thread.join(timeout=120)
        for t in pumps:
            t.join(timeout=5)
    if code != 0:
        raise SystemExit(f"{name}: vrl trainer failed:\n" + "\n".join(tail))
    if "error" in flood:
        raise SystemExit(f"{name}: the hostile writers failed: {flood['error']}")
    return {"name": name, "bucket": read_bucket(bucket, plan.budget), "cpu": seconds, "flood": flood,
            "load": (load_before, os.getloadavg()[0])}


def read_bucket(bucket: Path, budget: float) -> dict:
    """Steps, time split and intake counts from the trainer's metrics; denials; quarantine."""
    v0 = json.loads((bucket / "manifests" / "v000000.json").read_text())["created_at"]
    steps, late = [], 0
    for path in sorted((bucket / "metrics").glob("v*.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("kind") != "step":
                continue
            if rec["time"] - v0 <= budget:
                steps.append(rec)
            else:
                late += 1
    rejected, by_id, totals = Counter(), Counter(), Counter()
    for s in steps:
        rejected.update(s.get("ingest/rejected", {}))
        for vid, (acc, rej) in s.get("ingest/by_volunteer", {}).items():
            by_id[vid] += rej
        for k in ("time/ingest", "time/waiting_for_rollouts", "train/step_time", "time/last_publish",
                  "time/dashboard", "ingest/over_cap", "ingest/denied_shards", "ingest/shards",
                  "rollout/groups"):
            totals[k] += s.get(k) or 0
    try:
        denied = sorted(json.loads((bucket / "denylist.json").read_text())["volunteers"])
    except (OSError, ValueError, KeyError):
        denied = []
    quarantined = Counter(p.parent.name for p in (bucket / "quarantine").rglob("*.json")) \
        if (bucket / "quarantine").is_dir() else Counter()
    return {"steps": len(steps), "late_steps": late, "rejected": dict(rejected),
            "rejected_by_id": dict(by_id), "totals": dict(totals), "denied": denied,
            "quarantined": dict(quarantined),
            "first_step": min((s["time"] - v0 for s in steps), default=None)}


def describe(run: dict, budget: float) -> None:
    b, cpu = run["bucket"], run["cpu"]
    t = b["totals"]
    log(f"{run['name']}: {b['steps']} steps in {budget:.0f}s = {b['steps'] / budget:.3f}/s "
        f"({b['late_steps']} more after the budget); first step {b['first_step'] or 0:.1f}s after v0")
    log(f"  trainer time: ingest {t.get('time/ingest', 0):.1f}s, waiting for rollouts "
        f"{t.get('time/waiting_for_rollouts', 0):.1f}s, steps {t.get('train/step_time', 0):.1f}s, "
        f"publish {t.get('time/last_publish', 0):.1f}s")
    log(f"  CPU seconds: trainer {cpu['trainer']:.1f}, volunteer {cpu['volunteer']:.1f}; load avg "
        f"{run['load'][0]:.1f} -> {run['load'][1]:.1f}")
    log(f"  shards accepted {t.get('ingest/shards', 0):.0f}; rejected by reason {b['rejected']}; "
        f"rejected by id {b['rejected_by_id']}; quarantine records by id {b['quarantined']}; "
        f"denied {b['denied']}")
    log(f"  skips: folders over the per-version cap {t.get('ingest/over_cap', 0):.0f}, "
        f"denied volunteer {t.get('ingest/denied_shards', 0):.0f} (folders per poll)")
    f = run["flood"]
    if f:
        per_shape = Counter()
        for c in f["counts"].values():
            per_shape.update(c)
        total = sum(per_shape.values())
        log(f"  writers: {total:,} objects ({sum(f['bytes'].values()) / 1e6:.0f} MB) in "
            f"{f['writing']:.0f}s = {total / max(f['writing'], 1e-9):,.0f}/s; by shape {dict(per_shape)}")
        log(f"  writers' CPU: {f['cpu_user']:.1f}s user + {f['cpu_system']:.1f}s system = "
            f"{(f['cpu_user'] + f['cpu_system']) / max(f['wall'], 1e-9):.2f} cores over {f['wall']:.0f}s; "
            f"janitor deleted {f['janitor_deleted']:,} files below the window")


def results(quick: bool) -> list[Row]:
    plan = QUICK if quick else FULL
    log(f"machine: {machine()}")
    model_dir = shared_start()
    with tempfile.TemporaryDirectory(prefix="vrl-flood-bench-") as tmp:
        work = Path(tmp)
        started = time.time()
        payloads = build_payloads(model_dir, work / "payloads", k=8, max_new_tokens=32)
        log(f"payloads built in {time.time() - started:.0f}s")
        log(f"baseline: 1 trainer + 1 honest volunteer, {plan.budget:.0f}s")
        base = run_contender("baseline", model_dir, plan, work / "baseline", None)
        describe(base, plan.budget)
        runs = []
        for nice in WRITERS_NICE:
            log(f"flooded: the same + {len(HOSTILE_IDS)} hostile writers at niceness {nice}, {plan.budget:.0f}s")
            flooded = run_contender(f"flooded-nice{nice}", model_dir, plan, work / f"flooded-nice{nice}",
                                    payloads, nice)
            describe(flooded, plan.budget)
            runs.append((nice, flooded))
    return [_row(base, flooded, nice, plan, quick) for nice, flooded in runs]


def _row(base: dict, flooded: dict, nice: int, plan: Plan, quick: bool) -> Row:
    rate_b = base["bucket"]["steps"] / plan.budget
    rate_f = flooded["bucket"]["steps"] / plan.budget
    ratio = rate_f / rate_b if rate_b else 0.0
    f, fb = flooded["flood"], flooded["bucket"]
    written = sum(sum(c.values()) for c in f["counts"].values())
    hostile_rejected = sum(n for vid, n in fb["rejected_by_id"].items() if vid in HOSTILE_IDS)
    cores = (f["cpu_user"] + f["cpu_system"]) / max(f["wall"], 1e-9)
    ft, bt = fb["totals"], base["bucket"]["totals"]
    from volunteer_rl.config import TrainerConfig
    from volunteer_rl.trainer.listing import MAX_OBJECTS_PER_VOLUNTEER_VERSION

    d = TrainerConfig(bucket="")
    where = (f"niceness {nice}: the CPU the trainer and volunteer leave, as on machines of their own" if nice > 0
             else "niceness 0 on the trainer's machine: a core taken from the volunteer at niceness 10")
    note = (f"baseline `vrl demo`'s trainer + 1 honest volunteer (1 thread each, 32 groups/step); flooded: "
            f"the same + 3 hostile writer threads (one process, {where}) writing pre-built objects into the "
            f"folder bucket as fast as they can, {written:,} objects = {written / max(f['writing'], 1e-9):,.0f}/s, "
            f"{cores:.2f} cores; trainer CPU {flooded['cpu'].get('trainer', 0):.0f} s (baseline "
            f"{base['cpu'].get('trainer', 0):.0f} s), volunteer CPU {flooded['cpu'].get('volunteer', 0):.0f} s "
            f"(baseline {base['cpu'].get('volunteer', 0):.0f} s); trainer defaults (deny after {d.deny_after} at "
            f"{d.deny_rate:.0%}, audit on, {MAX_OBJECTS_PER_VOLUNTEER_VERSION} objects/volunteer/version): "
            f"{hostile_rejected} rejected ("
            + ", ".join(f"{k} {v}" for k, v in sorted(fb["rejected"].items()))
            + f"), {len([x for x in fb['denied'] if x in HOSTILE_IDS])}/3 denied, skipped unlisted "
            f"{ft.get('ingest/denied_shards', 0):,.0f} denied folders (per poll), "
            f"{ft.get('ingest/over_cap', 0):,.0f} folders over the cap (per version); "
            f"first step {fb['first_step'] or 0:.0f} s after v0 (baseline {base['bucket']['first_step'] or 0:.0f} s); "
            f"trainer in ingest {ft.get('time/ingest', 0):.0f} s (baseline {bt.get('time/ingest', 0):.0f} s), "
            f"waiting for rollouts {ft.get('time/waiting_for_rollouts', 0):.0f} s "
            f"({bt.get('time/waiting_for_rollouts', 0):.0f} s); {plan.budget:.0f} s each")
    return Row(benchmark=f"trainer under a flood of 3 hostile writers (niceness {nice})",
               measure="optimizer steps/s (1 honest volunteer)", vrl=rate_f, baseline=rate_b,
               ratio=ratio, goal=">= 0.8", met=ratio >= 0.8,
               command=COMMAND + (" --quick" if quick else ""), note=note)


if __name__ == "__main__":
    if sys.argv[1:2] == [CHILD]:
        sys.exit(flood_child(json.loads(sys.argv[2])))
    sys.exit(cli(results, __doc__))
