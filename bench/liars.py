"""Lying groups a live trainer trains, out of those sent, for four liars (issue 41, row a):
with every trained group replayed before its step (`--verify every`, the default since issue
41) against the sampled intake audits alone (`--verify sampled`, the rule before), measured in
the same run.

    python -m bench.liars [--quick] [--json PATH]

Each trial is a real trainer (`trainer.loop.Trainer` at TrainerConfig's defaults but for
--verify: audits on, 32 groups a step, a publish after every step, a window of 2 versions;
one torch thread, v0 evaluated on EVAL_ROWS held-out rows) on a folder bucket in a temporary
folder, started from the demo's warm-started v0 (bench.trl_time_to_accuracy.shared_start,
built once and cached), and one volunteer id, the liar, that writes real shards into that
bucket. Its honest groups are made as `vrl volunteer` makes them (`sampling.sample` with
each group's committed draw keys, for the prompt its number draws from the version's pool,
rewards computed): every group sampled is sent, reward variance or not, with the weights of
the version it is labelled with (the trainer's held copy of that published version, the very
weights a volunteer downloads and the replay uses). A lying group is an honest one with one
completion's first token swapped for another ordinary token (one its draw did not select)
and that completion's reward recomputed, kept only if its rewards still vary, so that a step
would learn from it (the numbers of the samples it could not forge go unsent); it is never
sampled.

The bench drives the trainer's loop itself, one iteration at a time as `Trainer._run` does
(the intake's round, the batch's verification, the optimizer step, the ledger's `trained`
records, a publish every --publish-every steps; not the metrics lines, the manifest quota's
bookkeeping or the idle wait), so that the liar acts between iterations: it sends a shard
once the trainer took (or rejected) the one before, and while it waits for the outcome of
its lies and the trainer lacks groups for a step, it sends one usable honest group at a time
(a shard of the groups it sampled up to one with reward variance), so a step starts as soon
as the batch is full and takes every group waiting. A liar stops once it is denied. Which
groups were trained is read from the trainer's ledger objects (`ledger/vN.jsonl`, written
with each publish, and once more at the end): a lying group counts if its shard and line
have the outcome `trained` (the rows also count the other fates of the lies: `rejected`,
`stale`, and `dropped`: no outcome, withdrawn or never read once the liar was denied; and
the batches the verification refused before a step, where a lie got past the intake's audits).

The liars (sizes: FULL, 5 trials each; --quick: QUICK, 1 trial):
1. doses: `honest_run` honest groups in shards of `honest_shard`, then one shard of `dose`
   lying groups, its outcome awaited; again, up to `doses` times (the issue's liar went back
   to honest groups after each catch; a forgery now denies at once).
2. burst: `honest_run` honest groups, then `burst` one-group lying shards, each sent as soon
   as the trainer took the one before.
3. farm: `farm` honest groups in shards of `farm_shard` (its audit rate falls to about
   audit_full_groups / farm), then up to `big_shards` shards of `big_shard` groups, each with
   `big_lies` lying groups among honest ones, each shard's outcome awaited.
4. stale: `honest_run` honest groups; then, up to `stale_doses` times: `stale_dose` lying
   groups made from groups sampled under the current version u (numbered in order, held
   back), honest shards until the trainer published u + max_staleness, then the lies sent
   under u, the oldest version of the window, right after that publish (so they reach the
   next step: the batch takes the newest versions first).

Figure: lying groups trained under --verify every, summed over the trials (goal 0); baseline:
the same under --verify sampled. The ratio is (baseline + 1) / (vrl + 1): counts where fewer
is better, so baseline over vrl as for times, each plus one so that it stays finite when vrl
trains none (a lower bound then) and is 1 when both are 0. The audit draws come from the
operating system's random generator, so the baseline varies from run to run.
"""

from __future__ import annotations

import copy
import sys
import tempfile
import time
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from bench.common import Row, cli

COMMAND = "python -m bench.liars"
LIAR = "liar"
EVAL_ROWS = 10
"""Held-out rows v0 is evaluated on when a trial's trainer starts (the evaluation is not measured)."""
MAX_ROUNDS = 5000
"""Loop iterations a trial waits for one outcome before it fails: far above what one takes."""
LOG_TAIL = 40
"""The trainer's last log lines a trial keeps, printed if it fails."""
SAMPLE_BATCH = 8
"""Groups the liar samples per call while it looks for lying groups."""


@dataclass(frozen=True)
class Sizes:
    """How much each liar sends; the fields are named as in the module's docstring."""

    trials: int
    """Trials per liar and per --verify setting."""
    honest_run: int
    """Honest groups before the lies (liars 1, 2 and 4), and between doses (liar 1)."""
    honest_shard: int
    doses: int
    dose: int
    burst: int
    farm: int
    farm_shard: int
    big_shards: int
    big_shard: int
    big_lies: int
    stale_doses: int
    stale_dose: int


FULL = Sizes(trials=5, honest_run=100, honest_shard=5, doses=10, dose=10, burst=20, farm=1000,
             farm_shard=16, big_shards=5, big_shard=64, big_lies=8, stale_doses=5, stale_dose=4)
QUICK = Sizes(trials=1, honest_run=40, honest_shard=5, doses=2, dose=5, burst=6, farm=200,
              farm_shard=16, big_shards=2, big_shard=32, big_lies=4, stale_doses=2, stale_dose=4)


class Liar:
    """One volunteer id (`vid`) that samples honest groups as `vrl volunteer` does and forges
    lies."""

    def __init__(self, trainer, vid: str = LIAR):
        from volunteer_rl.model.policy import Policy

        self.t, self.vid = trainer, vid
        p = trainer.policy
        self.policy = Policy(copy.deepcopy(p.model).eval(), p.tokenizer, p.prompt_format, p.device)
        self.loaded: int | None = None
        self.seq = 0  # its next group number
        self.shards = 0
        self.lies: set[tuple[str, int]] = set()
        """(shard key, line) of every lying group sent."""
        self.honest_groups = 0

    def _load(self, version: int) -> None:
        """The published weights of `version`, as the trainer holds them for its replays."""
        import torch

        if self.loaded != version:
            weights = self.t.held.window.versions[version]
            with torch.no_grad():
                for name, param in self.policy.model.named_parameters():
                    param.copy_(weights[name])
            self.loaded = version

    def sample(self, n: int) -> list:
        """Its next `n` groups, numbered in order, under the version just published."""
        from volunteer_rl.model.policy import encode_prompts
        from volunteer_rl.model.sampling import sample
        from volunteer_rl.protocol.draws import group_keys, pool_prompt
        from volunteer_rl.protocol.grants import grant_secret, seq_nonce
        from volunteer_rl.protocol.shards import Completion, Group
        from volunteer_rl.task.base import completion_reward

        m, task, pol = self.t.manifest, self.t.task, self.policy
        self._load(m.version)
        seqs = range(self.seq, self.seq + n)
        # Its numbers as the trainer grants them for this version (protocol.grants): the bench
        # holds the trainer, so it deals the nonces itself instead of asking in the bucket.
        secret = grant_secret(self.t.publisher.key)
        nonce = {q: seq_nonce(secret, m.run_id, self.vid, m.version, q) for q in seqs}
        rows = [self.t.problems[pool_prompt(m.prompt_pool, m.run_id, m.version, self.vid, s, nonce[s])]
                for s in seqs]
        s = m.sampling
        out = sample(pol, encode_prompts(pol, [task.prompt(r) for r in rows], task.instruction),
                     s.k, s.temperature, s.max_new_tokens,
                     draw_keys=[group_keys(m.run_id, m.version, self.vid, q, r.id, s.k, nonce[q])
                                for q, r in zip(seqs, rows)])
        self.seq += n
        return [Group(r.id, m.version, self.vid, q, [
                    Completion(x.token_ids, x.logprobs, x.text, completion_reward(
                        task, r, x.token_ids, pol.decode_all, pol.eos_id, pol.special_ids))
                    for x in xs]) for q, r, xs in zip(seqs, rows, out)]

    def forged(self, group):
        """`group` with one completion's first token swapped for another ordinary token (not
        the one its draw selected), its reward recomputed; None if its rewards no longer vary."""
        from volunteer_rl.protocol.shards import Completion, Group
        from volunteer_rl.task.base import completion_reward

        pol = self.policy
        completions = list(group.completions)
        j = next((i for i, c in enumerate(completions) if len(c.token_ids) >= 2), None)
        if j is None:
            return None
        tokens = list(completions[j].token_ids)
        swap = (tokens[0] + 1) % len(pol.tokenizer)
        while swap == tokens[0] or swap == pol.eos_id or swap in pol.special_ids:
            swap = (swap + 1) % len(pol.tokenizer)
        tokens[0] = swap
        reward = completion_reward(self.t.task, self.t.problems[group.prompt_id], tokens,
                                   pol.decode_all, pol.eos_id, pol.special_ids)
        completions[j] = Completion(tokens, completions[j].logprobs, "", reward)
        if len({c.reward for c in completions}) < 2:
            return None
        return Group(group.prompt_id, group.policy_version, group.volunteer_id, group.seq, completions)

    def make_lies(self, n: int) -> list:
        """`n` lying groups of the current version, made from groups it sampled (the numbers of
        those it could not forge go unsent)."""
        lies: list = []
        while len(lies) < n:
            lies += [f for f in map(self.forged, self.sample(SAMPLE_BATCH)) if f is not None]
        return lies[:n]

    def send(self, groups: list, lying: set[int] = frozenset()) -> str:
        """Write `groups` (all of one version) as one shard; `lying`: the lines that lie."""
        from volunteer_rl.protocol import layout
        from volunteer_rl.protocol.shards import encode_shard, new_shard_name

        key = layout.shard_key(groups[0].policy_version, self.vid, new_shard_name(self.shards))
        self.shards += 1
        self.t.storage.write(key, encode_shard(groups))
        self.lies.update((key, line) for line in lying)
        self.honest_groups += len(groups) - len(lying)
        return key

    def honest(self, n: int) -> str:
        return self.send(self.sample(n))

    def one_usable(self) -> str:
        """A shard of the groups it samples up to the first whose rewards vary."""
        groups = []
        while not groups or len({c.reward for c in groups[-1].completions}) < 2:
            groups += self.sample(1)
        return self.send(groups)


STEPPED, REFUSED, WAITING = "stepped", "refused", "waiting"


class Trial:
    """A trainer on a fresh folder bucket, its loop driven one iteration at a time, and a liar."""

    def __init__(self, root: Path, model: Path, verify: str, **settings):
        """`settings`: further TrainerConfig fields (their defaults otherwise)."""
        from volunteer_rl.config import TrainerConfig
        from volunteer_rl.trainer.groups import IngestStats
        from volunteer_rl.trainer.loop import Trainer

        cfg = TrainerConfig(bucket=str(root / "bucket"), model=str(model), verify=verify,
                            eval_every=0, dashboard_every=0, threads=1, work_dir=str(root / "work"),
                            signing_key=str(root / "signing-key.pem"), **settings)
        self.log: deque[str] = deque(maxlen=LOG_TAIL)
        self.t = Trainer(cfg, log=self.log.append)
        self.t.held_out = self.t.held_out[:EVAL_ROWS]
        self.t.start()
        self.liar = Liar(self.t)
        self.buffer: list = []
        self.stats = IngestStats()
        self.unpublished = 0
        self.caught_before_step = 0
        """Batches the verification refused (a group failed its replay before the step)."""
        self.outcomes: dict[tuple[str, int], str] = {}
        """(shard key, line) -> outcome, of every group the ledger objects name; `rejected`
        under line -1 for a rejected shard."""

    @property
    def denied(self) -> bool:
        return self.t.fleet.is_denied(LIAR)

    def round(self) -> str:
        """One iteration of Trainer._run's loop: STEPPED, REFUSED (the batch failed its
        verification or its step) or WAITING (too few fresh groups for a step)."""
        from volunteer_rl.trainer.groups import IngestStats
        from volunteer_rl.trainer.records import record_groups

        t, role = self.t, self.t.role
        self.buffer, batch, _, _ = role.intake_round(self.buffer, self.stats, t.window())
        if batch is None:
            return WAITING
        batch, passed = role.verified(batch, self.stats)
        if batch is None:
            self.buffer = passed + self.buffer
            self.caught_before_step += 1
            return REFUSED
        result = t.learner.step(batch, t.prompt_ids, t.version)
        if not result.applied:
            self.buffer = t.refuse_step(role.own(batch) + self.buffer, batch, result, self.stats)
            return REFUSED
        t.learner.steps += 1
        record_groups(t.ledger, role.own(batch), "trained", t.learner.steps)
        self.stats = IngestStats()
        self.unpublished += 1
        if self.unpublished >= t.cfg.publish_every:
            self.publish()
        return STEPPED

    def publish(self) -> None:
        """Publish the next version, and read back the ledger records it committed."""
        from volunteer_rl.protocol.ledger import read_ledger

        self.t.publish_next(buffered=self.buffer)
        self.unpublished = 0
        self.note(read_ledger(self.t.storage, self.t.version))

    def note(self, records: list[dict]) -> None:
        for rec in records:
            if rec["outcome"] == "rejected":
                self.outcomes[rec["key"], -1] = "rejected"
            for line in rec["lines"]:
                self.outcomes[rec["key"], line] = rec["outcome"]

    def settled(self, key: str) -> bool:
        """Nothing more can happen to `key`'s groups: each has an outcome, its shard was
        rejected or withdrawn, or its version left the window."""
        from volunteer_rl.protocol import layout

        return (self.t.ledger.finished(key) or key in self.t.ingest.withdrawn
                or layout.rollout_author(key)[0] < self.t.window().low)

    def until(self, done: Callable[[], bool], feed: bool) -> None:
        """Loop iterations until `done()` or the liar is denied. While the trainer waits for
        groups: with `feed` the liar sends one usable honest group; without, the trainer
        waits --poll-seconds, as its loop does."""
        for _ in range(MAX_ROUNDS):
            if self.denied or done():
                return
            if self.round() == WAITING and not done():
                if feed:
                    self.liar.one_usable()
                else:
                    time.sleep(self.t.cfg.poll_seconds)
        raise RuntimeError(f"no outcome after {MAX_ROUNDS} iterations of the trainer's loop")

    def taken(self, key: str) -> None:
        """Wait until the trainer took `key` (or settled it)."""
        self.until(lambda: key in self.t.ingest.taken or self.settled(key), feed=False)

    def settle(self, keys: list[str]) -> None:
        """Wait for the outcome of every shard of `keys`, feeding the trainer meanwhile."""
        self.until(lambda: all(self.settled(k) for k in keys), feed=True)

    def honest_run(self, groups: int, shard: int) -> None:
        for _ in range(-(-groups // shard)):
            if self.denied:
                return
            self.taken(self.liar.honest(shard))

    def stop(self) -> None:
        """Publish what is left, note the outcomes no publish committed, stop the trainer's
        helpers."""
        from volunteer_rl.trainer.ranks import leave

        if self.unpublished:
            self.publish()
        t = self.t
        self.note(t.ledger.pending)  # the records no publish committed: rejections since the last step
        t.rewards.close()
        t.reporters.close()
        t.retention.close(None)
        leave(t.ranks)

    def close(self) -> dict:
        """Stop; what became of the lies."""
        self.stop()
        t = self.t
        fate = Counter()
        for key, line in self.liar.lies:
            fate[self.outcomes.get((key, -1)) or self.outcomes.get((key, line), "dropped")] += 1
        lying_shards = {key for key, _ in self.liar.lies}
        honest_rejected = sum(1 for key, line in self.outcomes if line == -1 and key not in lying_shards)
        return {"sent": len(self.liar.lies), "trained": fate["trained"], "fate": dict(fate),
                "denied": self.denied, "honest_groups": self.liar.honest_groups,
                "honest_shards_rejected": honest_rejected, "steps": t.learner.steps,
                "caught_before_step": self.caught_before_step,
                "version": t.version}


def doses(trial: Trial, s: Sizes) -> None:
    for _ in range(s.doses):
        trial.honest_run(s.honest_run, s.honest_shard)
        if trial.denied:
            return
        lies = trial.liar.make_lies(s.dose)
        trial.settle([trial.liar.send(lies, set(range(len(lies))))])


def burst(trial: Trial, s: Sizes) -> None:
    trial.honest_run(s.honest_run, s.honest_shard)
    keys = []
    for _ in range(s.burst):
        if trial.denied:
            return
        keys.append(trial.liar.send(trial.liar.make_lies(1), {0}))
        trial.taken(keys[-1])
    trial.settle(keys)


def farm(trial: Trial, s: Sizes) -> None:
    trial.honest_run(s.farm, s.farm_shard)
    for _ in range(s.big_shards):
        if trial.denied:
            return
        groups = trial.liar.sample(s.big_shard)
        lying: set[int] = set()
        for i, g in enumerate(groups):
            f = trial.liar.forged(g) if len(lying) < s.big_lies else None
            if f is not None:
                groups[i] = f
                lying.add(i)
        trial.settle([trial.liar.send(groups, lying)])


def stale(trial: Trial, s: Sizes) -> None:
    trial.honest_run(s.honest_run, s.honest_shard)
    lag = trial.t.cfg.max_staleness
    for _ in range(s.stale_doses):
        if trial.denied:
            return
        u = trial.t.version
        lies = trial.liar.make_lies(s.stale_dose)  # numbered now, under u; held back
        while trial.t.version < u + lag and not trial.denied:
            trial.taken(trial.liar.honest(s.honest_shard))
        if trial.denied:
            return
        trial.settle([trial.liar.send(lies, set(range(len(lies))))])


LIARS: dict[str, tuple[Callable[[Trial, Sizes], None], Callable[[Sizes], str]]] = {
    "doses": (doses, lambda s: f"small doses after honest runs: {s.honest_run} honest groups in "
              f"shards of {s.honest_shard}, then a shard of {s.dose} lying groups, up to {s.doses} times"),
    "burst": (burst, lambda s: f"a burst after a long honest run: {s.honest_run} honest groups, "
              f"then {s.burst} one-group lying shards, each once the last was taken"),
    "farm": (farm, lambda s: f"big shards after farming: {s.farm} honest groups in shards of "
             f"{s.farm_shard}, then up to {s.big_shards} shards of {s.big_shard} groups with "
             f"{s.big_lies} lying ones each"),
    "stale": (stale, lambda s: f"lies only in groups of an older version: {s.honest_run} honest "
              f"groups, then up to {s.stale_doses} times {s.stale_dose} lying groups sampled under "
              f"version u, held back and sent under u once u + max_staleness (2) is published"),
}


def trial(strategy: str, verify: str, s: Sizes, model: Path) -> dict:
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="vrl-liars-") as tmp:
        t = Trial(Path(tmp), model, verify)
        try:
            LIARS[strategy][0](t, s)
        except Exception:
            print("\n".join(["the trainer's last lines:", *t.log]), flush=True)
            raise
        finally:
            out = t.close()
    out["seconds"] = time.time() - started
    print(f"{strategy:6} {verify:8} {out}", flush=True)
    return out


def side(ts: list[dict]) -> str:
    fate = sum((Counter(t["fate"]) for t in ts), Counter())
    return (f"{sum(t['trained'] for t in ts)} of {sum(t['sent'] for t in ts)} lying groups "
            f"trained ({', '.join(f'{k} {v}' for k, v in sorted(fate.items()))}; batches refused "
            f"before a step {sum(t['caught_before_step'] for t in ts)}), denied in "
            f"{sum(t['denied'] for t in ts)}/{len(ts)}, after {sum(t['honest_groups'] for t in ts):,} "
            f"honest groups ({sum(t['honest_shards_rejected'] for t in ts)} honest shards rejected), "
            f"{sum(t['seconds'] for t in ts):.0f} s")


def shared_v0() -> Path:
    """The demo's v0 (900 warm-start steps, bench.trl_time_to_accuracy.shared_start: built once
    and cached), with torch set to the one thread the trials run on."""
    import torch

    from bench.trl_time_to_accuracy import shared_start

    torch.set_num_threads(1)
    return shared_start()


def results(quick: bool) -> list[Row]:
    s = QUICK if quick else FULL
    model = shared_v0()
    rows = []
    for name, (_, describe) in LIARS.items():
        runs = {v: [trial(name, v, s, model) for _ in range(s.trials)] for v in ("every", "sampled")}
        vrl = sum(t["trained"] for t in runs["every"])
        base = sum(t["trained"] for t in runs["sampled"])
        rows.append(Row(
            f"lying groups trained, liar: {name}", "lying groups trained (of those sent)", vrl, base,
            (base + 1) / (vrl + 1), "0", vrl == 0, COMMAND + (" --quick" if quick else ""),
            f"{describe(s)}; {s.trials} trial(s) per side, a live trainer at the defaults "
            f"(32 groups a step, a publish per step) from the demo's v0, one torch thread; "
            f"--verify every: {side(runs['every'])}; baseline --verify sampled: "
            f"{side(runs['sampled'])}; ratio (baseline + 1) / (vrl + 1)"))
    return rows


if __name__ == "__main__":
    sys.exit(cli(results, __doc__))
