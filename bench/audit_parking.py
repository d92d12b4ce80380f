"""The trainer's step rate while one id parks 1,024 max-size shards per version for audit
(issue 26, row c).

    python -m bench.audit_parking [--quick] [--json PATH]

Two runs, one after the other, each on a fresh local folder bucket, each for the budget (240 s;
40 s with --quick), with the machinery of bench.hostile_flood:

- alone: `vrl demo`'s processes with one volunteer (`demo.start_processes`: 1 trainer and 1
  honest `vrl volunteer`, 1 torch thread each, GRPO, 32 groups per step), started with
  `--model` on the shared v0 of bench.trl_time_to_accuracy and the trainer's evaluations off;
- parked: the same two processes, plus one hostile id (`parker-1`) whose writer, a process of
  its own at niceness 19 (the CPU the trainer and the volunteer leave, as if on a machine of
  its own), writes straight into the bucket folder under `rollouts/v<current>/parker-1/`.

**The parking writer.** In every version (read from manifest.json, as a volunteer reads it) it
writes up to SHARDS_PER_VERSION shards, each of the manifest's `max_shard_groups` groups (256)
at k = 8, then waits for the next version (a new version stops the old one's writing). Every
group passes every check the trainer makes before its replay: a fresh group number (`seq`:
the writer's numbers run on across versions, never reused, so never `seq_reused` or
`seq_order`), the prompt that number draws from the version's `prompt_pool` (schema 6), its
own version and volunteer id, 8 completions of which one is the prompt's own expression then
EOS (reward 1; a cut-off random one where the writer has no correct completion of that
prompt) and seven are 32 random non-EOS tokens, cut off at max_new_tokens (reward 0 under
any prompt), every reward as the trainer recomputes it. Its behavior logprobs are made up, so each shard fails its replay
(`logprob_mismatch` or a token the committed draw does not select): an id this new has every
shard drawn for audit (fewer than `--audit-full-groups` clean groups), so all its shards wait
for the audit budget (`--audit-share` of the trainer's time), unfetched, and each one the
budget admits is fetched, parsed, rescored and replayed up to its first failing group (the
first: trainer.audit replays in growing chunks) before it is refused. Which prompt and
which number a group gets is `parked_group` alone (see there).

Each shard is built without compressing at write time: the groups' completions are pre-built
as raw deflate blocks, and a shard is a gzip header, for each line a stored block with its
prompt id, version, id, number and correct completion plus one pre-built block of seven
random completions, an empty final block and the CRC-32. So the writer costs a checksum and a
file write per shard, not a gzip of 0.6 MB, and can keep up with the versions. The writer
stages each shard outside the bucket and renames it in (one atomic PUT); a janitor thread
deletes its folders of versions below the window. Both runs keep their bucket in /dev/shm
(RAM) where there is one: 1,024 shards of 0.5 MB per version is 300 MB/s, which an attacker
sends to the bucket's servers, not to the trainer's disk, and which this machine's disk could
not take (on disk the writer managed 130-700 shards per 1.5 s version).

**Measured.** Trainer optimizer steps per second (steps whose metrics line is stamped within
the budget after v0's manifest, over the budget), parked / alone, goal >= 0.9 (issue 26). Also
printed: the trainer's split of its time (`time/ingest`, `time/waiting_for_rollouts`,
`train/step_time`), audit seconds, shards audited and deferred per run, shards rejected by
reason, the ids denied, and the shards the writer wrote per version.
"""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import struct
import sys
import tempfile
import threading
import time
import zlib
from collections import Counter
from pathlib import Path

from bench.common import Row, cli, machine
from bench.hostile_flood import (
    JANITOR_MARGIN,
    describe,
    run_contender,
    run_until_stopped,
    watch_manifest,
)
from bench.trl_time_to_accuracy import FULL, QUICK, Plan, log, shared_start

COMMAND = "python -m bench.audit_parking"
CHILD = "--parking-child"
PARKER_ID = "parker-1"
SHARDS_PER_VERSION = 1024
"""Shards the parker writes per version: MAX_OBJECTS_PER_VOLUNTEER_VERSION, all the trainer
lists of one id in one version."""
RANDOM_SETS = 64
"""Distinct pre-built sets of seven random completions; line n uses set n % RANDOM_SETS, so
the groups of a shard differ in content as well as in prompt and number."""
WRITER_NICE = 19
GOAL = 0.9


# ---------------------------------------------------------------------------------------------
# One group: which prompt, which number.

def parked_group(n: int, version: int, volunteer: str, run_id: str,
                 pool: list[int], secret: bytes) -> tuple[int, int]:
    """(prompt id, seq) of the writer's n-th group (n = 0, 1, 2, ... across versions).

    The number is n itself: fresh, and growing with the versions, so the trainer refuses it
    neither as `seq_reused` nor as `seq_order`. The prompt is the one n draws from `version`'s
    pool with the nonce the trainer of `secret` would grant n for that version
    (protocol.grants), as an honest volunteer's. The writer deals its nonces itself (it is
    given the trainer's secret): asking for a quarter of a million numbers a version would
    take it thousands of polls (one grant of at most 512 a poll), and the row measures what
    parked shards cost the audits, not the grants."""
    from volunteer_rl.protocol.draws import pool_prompt
    from volunteer_rl.protocol.grants import seq_nonce

    return pool_prompt(pool, run_id, version, volunteer, n,
                       seq_nonce(secret, run_id, volunteer, version, n)), n


# ---------------------------------------------------------------------------------------------
# Pre-built pieces (before the clock).

def _deflate(data: bytes) -> bytes:
    """Raw deflate blocks of `data`, none final, ending on a byte boundary (Z_FULL_FLUSH: no
    reference back into earlier bytes), so such pieces can be joined into one stream."""
    c = zlib.compressobj(6, zlib.DEFLATED, -zlib.MAX_WBITS)
    return c.compress(data) + c.flush(zlib.Z_FULL_FLUSH)


def _stored(data: bytes) -> bytes:
    """One stored (uncompressed) deflate block, not final; the stream must be byte-aligned."""
    assert len(data) <= 0xFFFF
    return b"\x00" + struct.pack("<HH", len(data), len(data) ^ 0xFFFF) + data


GZIP_HEADER = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"
FINAL_BLOCK = b"\x03\x00"
"""An empty final block with fixed codes: ends the deflate stream."""


def _completion_json(ids: list[int], logprobs: list[float], text: str, reward: float) -> str:
    return json.dumps({"token_ids": ids, "logprobs": logprobs, "text": text, "reward": reward},
                      separators=(",", ":"))


def build_pieces(model_dir: Path, k: int, max_new_tokens: int, seed: int = 26) -> dict:
    """{"correct": {prompt id: its correct completion as JSON}, "sets": [[raw JSON of k - 1
    cut-off completions + the line's end, its deflate blocks as latin-1]]}; every reward
    checked with the trainer's own completion_reward."""
    from volunteer_rl.config import PACKAGE_DATA
    from volunteer_rl.model.policy import load_policy
    from volunteer_rl.task.dataset import load_csv
    from volunteer_rl.task.reward import completion_reward

    policy = load_policy(model_dir, "cpu")
    tok, eos, special = policy.tokenizer, policy.eos_id, policy.special_ids
    problems = load_csv(PACKAGE_DATA / "train.csv")
    rng = random.Random(seed)
    correct = {}
    for i, p in enumerate(problems):
        ids = tok.encode(p.expression, add_special_tokens=False) + [eos]
        if len(ids) > max_new_tokens or any(t in special for t in ids[:-1]):
            continue
        if completion_reward(ids, p.expression, policy.decode_all, eos, special) != 1.0:
            continue
        lps = [-round(rng.uniform(0.01, 3.0), 3) for _ in ids]
        correct[i] = _completion_json(ids, lps, tok.decode(ids, skip_special_tokens=True), 1.0)
    if not correct:
        raise SystemExit("no train.csv prompt has a correct completion within max_new_tokens")
    plain = [t for t in range(len(tok)) if t != eos and t not in special]
    sets = []
    for _ in range(RANDOM_SETS):
        comps = []
        for _ in range(k - 1):
            ids = [rng.choice(plain) for _ in range(max_new_tokens)]  # no EOS: cut off
            r = completion_reward(ids, problems[0].expression, policy.decode_all, eos, special)
            assert r == 0.0  # without EOS no prompt rewards it
            comps.append(_completion_json(ids, [-round(rng.uniform(0.01, 6.0), 3) for _ in ids],
                                          tok.decode(ids, skip_special_tokens=True), 0.0))
        raw = ("," + ",".join(comps) + "]}\n").encode()
        sets.append([raw.decode("latin-1"), _deflate(raw).decode("latin-1")])
    filler = [rng.choice(plain) for _ in range(max_new_tokens)]  # no EOS: reward 0
    return {"correct": {str(i): c for i, c in correct.items()}, "sets": sets,
            "filler": _completion_json(filler, [-1.0] * max_new_tokens,
                                       tok.decode(filler, skip_special_tokens=True), 0.0)}


class ShardMaker:
    """Shards of parked groups, assembled from the pre-built pieces (no compression)."""

    def __init__(self, pieces: dict, volunteer: str, groups: int, secret: bytes = b""):
        self.correct = {int(i): c for i, c in pieces["correct"].items()}
        self.filler = pieces["filler"]
        self.sets = [(raw.encode("latin-1"), blocks.encode("latin-1")) for raw, blocks in pieces["sets"]]
        self.volunteer, self.groups, self.secret = volunteer, groups, secret

    def shard(self, version: int, run_id: str, pool: list[int], first: int) -> bytes:
        """The gzip bytes of one shard holding the writer's groups first .. first + groups - 1,
        for `version` of `run_id`, whose prompt pool is `pool`."""
        parts, crc, size = [GZIP_HEADER], 0, 0
        for n in range(first, first + self.groups):
            prompt, seq = parked_group(n, version, self.volunteer, run_id, pool, self.secret)
            head = (f'{{"prompt_id":{prompt},"policy_version":{version},"volunteer_id":'
                    f'"{self.volunteer}","seq":{seq},"completions":['
                    f'{self.correct.get(prompt, self.filler)}').encode()
            raw, blocks = self.sets[n % len(self.sets)]
            parts += [_stored(head), blocks]
            crc = zlib.crc32(raw, zlib.crc32(head, crc))
            size += len(head) + len(raw)
        parts += [FINAL_BLOCK, struct.pack("<II", crc, size & 0xFFFFFFFF)]
        return b"".join(parts)


def self_check(model_dir: Path, pieces: dict, k: int, max_new_tokens: int, groups: int) -> int:
    """Run one parked shard through the trainer's own check_shard (schema, version, volunteer,
    prompt, sizes, EOS, every reward): it must pass everything before the replay. Returns its
    compressed size."""
    from volunteer_rl.config import PACKAGE_DATA
    from volunteer_rl.model.policy import load_policy
    from volunteer_rl.protocol import layout
    from volunteer_rl.task.base import in_process
    from volunteer_rl.task.calculator_task import CalculatorTask
    from volunteer_rl.task.dataset import load_rows
    from volunteer_rl.trainer.checks import Rules, check_shard
    from volunteer_rl.trainer.groups import Window

    policy = load_policy(model_dir, "cpu")
    task = CalculatorTask()
    rules = Rules(load_rows(PACKAGE_DATA / "train.csv", task), len(policy.tokenizer), k,
                  max_new_tokens, policy.decode_all, policy.eos_id, policy.special_ids,
                  max_groups=groups, run_id="run-check", rewards=in_process(task))
    pool = list(range(0, 2560, 10))  # a pool of 256 rows, as a trainer publishes
    data = ShardMaker(pieces, PARKER_ID, groups).shard(1, "run-check", pool, groups)
    key = layout.shard_key(1, PARKER_ID, _name(1))
    scored = check_shard(data, key, rules, Window(1, 2, {0, 1}, {0: tuple(pool), 1: tuple(pool)}))
    assert len(scored) == groups and [g.seq for g in scored] == list(range(groups, 2 * groups))
    assert all(sorted(g.rewards) in ([0.0] * k, [0.0] * (k - 1) + [1.0]) for g in scored)
    assert sum(max(g.rewards) for g in scored) > groups / 2  # most have a correct completion
    return len(data)


def _name(n: int) -> str:
    """A shard name in the volunteers' form (shards.new_shard_name), sorting in write order."""
    return f"{int(time.time() * 1000):013d}-{n:06d}-{random.getrandbits(32):08x}"


# ---------------------------------------------------------------------------------------------
# The writer's process.

def parking_child(spec: dict) -> int:
    """The parker's writer, a manifest watcher and a janitor, until spec["stop_file"] exists;
    then run.json (shards per version, bytes, CPU seconds) into spec["out"]."""
    os.nice(spec["nice"])
    bucket, vid = Path(spec["bucket"]), spec["ids"][0]
    from volunteer_rl.protocol.layout import SHARD_SUFFIX

    pieces = json.loads(Path(spec["payloads"]["pieces"]).read_text())
    from volunteer_rl.protocol.grants import grant_secret
    from volunteer_rl.protocol.signing import parse_private_key

    while not Path(spec["trainer_key"]).exists() and not Path(spec["stop_file"]).exists():
        time.sleep(0.1)  # the trainer writes it as it starts
    key = parse_private_key(Path(spec["trainer_key"]).read_bytes(), spec["trainer_key"])
    maker = ShardMaker(pieces, vid, spec["payloads"]["groups"], grant_secret(key))
    staging = Path(spec["out"]) / "staging"  # same file system as the bucket, outside it
    staging.mkdir()
    stop, state = threading.Event(), {"version": None, "manifest": None}
    numbers = [0]  # the writer's next group number: numbers run on across versions
    per_version: Counter = Counter()
    counts, written_bytes, janitor = Counter(), Counter(), Counter()

    def watch() -> None:
        watch_manifest(bucket, spec["stop_file"], stop, state)

    def clean() -> None:
        while not stop.wait(1.0):
            v = state["version"]
            if v is None:
                continue
            for old in range(janitor["next"], max(0, v - spec["max_staleness"] - JANITOR_MARGIN)):
                folder = bucket / "rollouts" / f"v{old:06d}" / vid
                if folder.is_dir():
                    janitor["files"] += sum(len(f) for _, _, f in os.walk(folder))
                    shutil.rmtree(folder, ignore_errors=True)
                janitor["next"] = old + 1

    def write() -> None:
        while not stop.is_set():
            m = state["manifest"]
            if m is None or per_version[m["version"]] >= SHARDS_PER_VERSION:
                time.sleep(0.02)  # no manifest yet, or this version's shards all written
                continue
            v, run_id, pool = m["version"], m["run_id"], m["prompt_pool"]
            n = per_version[v]
            data = maker.shard(v, run_id, pool, numbers[0])
            numbers[0] += maker.groups
            folder = bucket / "rollouts" / f"v{v:06d}" / vid
            tmp = staging / "shard"
            try:
                folder.mkdir(parents=True, exist_ok=True)
                tmp.write_bytes(data)
                os.replace(tmp, folder / (_name(n) + SHARD_SUFFIX))
            except OSError:  # the janitor removed the folder of a version that just ended
                counts["failed"] += 1
                per_version[v] += 1
                continue
            per_version[v] += 1
            counts["parked"] += 1
            written_bytes[vid] += len(data)

    errors: list[str] = []

    def guarded(fn):
        def run():
            try:
                fn()
            except BaseException as exc:  # a writer that dies must fail the run, not shrink it
                errors.append(f"{fn.__name__}: {exc!r}")
                stop.set()
        return threading.Thread(target=run, daemon=True)

    threads = [guarded(f) for f in (watch, clean, write)]
    started, first_write = run_until_stopped(threads, stop, state)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    (Path(spec["out"]) / "run.json").write_text(json.dumps({
        "counts": {vid: dict(counts)}, "bytes": dict(written_bytes),
        "per_version": {str(v): n for v, n in sorted(per_version.items())},
        "cpu_user": usage.ru_utime, "cpu_system": usage.ru_stime,
        "wall": time.time() - started, "writing": time.time() - (first_write or time.time()),
        "janitor_deleted": janitor["files"], "errors": errors}))
    return 1 if errors else 0


# ---------------------------------------------------------------------------------------------
# The runs.

def audit_figures(bucket: Path, budget: float) -> dict:
    """Audit totals of the steps within the budget, and when the parker was denied."""
    v0 = json.loads((bucket / "manifests" / "v000000.json").read_text())["created_at"]
    out = Counter()
    by_volunteer = Counter()
    for path in sorted((bucket / "metrics").glob("v*.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("kind") != "step" or rec["time"] - v0 > budget:
                continue
            for k in ("audit/shards", "audit/skipped", "audit/deferred", "audit/seconds"):
                out[k] += rec.get(k) or 0
            by_volunteer.update(rec.get("audit/by_volunteer") or {})
    denied_at = None
    try:
        entry = json.loads((bucket / "denylist.json").read_text())["volunteers"].get(PARKER_ID)
        if isinstance(entry, dict) and isinstance(entry.get("since"), (int, float)):
            denied_at = entry["since"] - v0
    except (OSError, ValueError, KeyError, AttributeError):
        pass
    return {**out, "by_volunteer": dict(by_volunteer), "denied_at": denied_at}


def results(quick: bool) -> list[Row]:
    from volunteer_rl.config import TrainerConfig
    from volunteer_rl.protocol.shards import SHARD_GROUPS_LIMIT
    from volunteer_rl.task.calculator_task import CalculatorTask

    plan = QUICK if quick else FULL
    cfg = TrainerConfig(bucket="").with_task_defaults(CalculatorTask())
    k, tokens, groups = cfg.k, cfg.max_new_tokens, SHARD_GROUPS_LIMIT
    log(f"machine: {machine()}")
    model_dir = shared_start()
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None  # see the module's doc: the writes are RAM's
    with tempfile.TemporaryDirectory(prefix="vrl-parking-bench-", dir=shm) as tmp:
        work = Path(tmp)
        started = time.time()
        pieces = build_pieces(model_dir, k, tokens)
        size = self_check(model_dir, pieces, k, tokens, groups)
        (work / "pieces.json").write_text(json.dumps(pieces))
        payloads = {"pieces": str(work / "pieces.json"), "groups": groups}
        log(f"pieces built in {time.time() - started:.0f}s: {len(pieces['correct']):,} prompts with a "
            f"correct completion; a parked shard of {groups} groups is {size:,} bytes and passes check_shard")
        log(f"alone: 1 trainer + 1 honest volunteer, {plan.budget:.0f}s")
        alone = run_contender("alone", model_dir, plan, work / "alone", None)
        alone["audit"] = audit_figures(work / "alone" / "bucket", plan.budget)
        describe(alone, plan.budget)
        log(f"parked: the same + {PARKER_ID} writing {SHARDS_PER_VERSION} shards of {groups} groups per "
            f"version at niceness {WRITER_NICE}, {plan.budget:.0f}s")
        parked = run_contender("parked", model_dir, plan, work / "parked", payloads, WRITER_NICE,
                               child="bench.audit_parking", child_flag=CHILD, ids=(PARKER_ID,))
        parked["audit"] = audit_figures(work / "parked" / "bucket", plan.budget)
        describe(parked, plan.budget)
        for run in (alone, parked):
            log(f"{run['name']} audits: {run['audit']}")
        log(f"parker shards per version: {parked['flood'].get('per_version')}")
    return [_row(alone, parked, plan, quick, cfg, size, groups)]


def _row(alone: dict, parked: dict, plan: Plan, quick: bool, cfg, size: int, groups: int) -> Row:
    rate_a = alone["bucket"]["steps"] / plan.budget
    rate_p = parked["bucket"]["steps"] / plan.budget
    ratio = rate_p / rate_a if rate_a else 0.0
    pb, ab, f = parked["bucket"], alone["bucket"], parked["flood"]
    pa, aa = parked["audit"], alone["audit"]
    pt, at = pb["totals"], ab["totals"]
    per_version = list(f.get("per_version", {}).values())
    full = sum(1 for n in per_version if n >= SHARDS_PER_VERSION)
    denied = PARKER_ID in pb["denied"]
    when = f" at {pa['denied_at']:.0f} s" if denied and pa.get("denied_at") is not None else ""
    note = (f"alone: `vrl demo`'s trainer + 1 honest volunteer (1 thread each, 32 groups/step); parked: the same + "
            f"one new id writing up to {SHARDS_PER_VERSION} shards of {groups} (max_shard_groups) "
            f"groups x k={cfg.k} per version ({size:,} bytes each, real prompts, true rewards, fresh seqs, "
            f"made-up logprobs), writer at niceness {WRITER_NICE}: {sum(per_version):,} shards in "
            f"{len(per_version)} versions ({full} with all {SHARDS_PER_VERSION}); trainer defaults (audit share "
            f"{cfg.audit_share:.0%}, full audit below {cfg.audit_full_groups} clean groups, deny after "
            f"{cfg.deny_after}): parker's shards audited {pa['by_volunteer'].get(PARKER_ID, 0)}, "
            f"audits deferred {pa.get('audit/deferred', 0):,.0f} times (alone {aa.get('audit/deferred', 0):,.0f}), "
            f"audit {pa.get('audit/seconds', 0):.0f} s (alone {aa.get('audit/seconds', 0):.0f} s), rejected "
            + (", ".join(f"{k} {v}" for k, v in sorted(pb["rejected"].items())) or "none")
            + f", parker {'denied' + when if denied else 'not denied'}; trainer in ingest "
            f"{pt.get('time/ingest', 0):.0f} s (alone {at.get('time/ingest', 0):.0f} s), waiting for rollouts "
            f"{pt.get('time/waiting_for_rollouts', 0):.0f} s ({at.get('time/waiting_for_rollouts', 0):.0f} s), "
            f"steps {pt.get('train/step_time', 0):.0f} s ({at.get('train/step_time', 0):.0f} s); "
            f"{plan.budget:.0f} s each")
    return Row(benchmark="trainer with one id parking 1,024 max-size shards per version for audit",
               measure="optimizer steps/s (1 honest volunteer)", vrl=rate_p, baseline=rate_a, ratio=ratio,
               goal=f">= {GOAL}", met=ratio >= GOAL, command=COMMAND + (" --quick" if quick else ""),
               note=note)


if __name__ == "__main__":
    if sys.argv[1:2] == [CHILD]:
        sys.exit(parking_child(json.loads(sys.argv[2])))
    sys.exit(cli(results, __doc__))
