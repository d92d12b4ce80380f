"""A volunteer: follow the manifest, sample groups with the newest weights, upload shards.

Everything it needs comes from the bucket: the manifest (polled, its signature checked
against the trainer's key), the dataset and the checkpoint files it names (each checked
against the manifest's sha256). It samples only the group numbers the trainer granted it,
each with the version it was granted for (numbering.py, protocol.grants). All it writes is
its own shards and asks for numbers, under rollouts/<version>/<its id>/, each one written
once, and its heartbeat volunteers/<its id>.json, overwritten every --heartbeat-seconds from a
thread of its own (heartbeat.py).

A manifest whose signature it does not accept is fatal before the first one was accepted (a
volunteer must not work for a foreign trainer) and, later, refused with a warning while it
keeps polling: it never loads what such a manifest names. A validly signed manifest that is
behind the newest one it accepted from the bucket (a lower version of the run, or an older
run: signing.behind), remembered across restarts in <work_dir>/newest-manifests.json, is
refused the same way but is never fatal: the trainer is the right one, someone just put an
old manifest back, and the volunteer keeps the version it holds.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

from volunteer_rl.config import VolunteerConfig, parse_rate
from volunteer_rl.model.chain import Held, fetch_weights, fetched_text, onto_version
from volunteer_rl.model.checkpoint import fetch_checkpoint
from volunteer_rl.model.devices import (MODEL_PROMPTS, pick_device, sampling_prompts,
                                        set_sampling_threads)
from volunteer_rl.model.hashing import CheckpointError, sha256_bytes
from volunteer_rl.model.policy import Policy, load_policy
from volunteer_rl.model.vetting import WEIGHTS_FILE, CheckpointRefused
from volunteer_rl.progress import Every
from volunteer_rl.protocol import jsonbounds, layout
from volunteer_rl.protocol.fleet import MAX_SUMMARY_BYTES
from volunteer_rl.protocol.manifest import (ADAPTER_FILE, Manifest, ManifestError, poll_manifest,
                                            read_manifest)
from volunteer_rl.protocol.shards import MAX_GROUP_SEQ, Group
from volunteer_rl.protocol.signing import Rollback, SignatureError, reader_trust
from volunteer_rl.stopping import Stopped, StopSignal
from volunteer_rl.storage import open_storage
from volunteer_rl.storage.base import Storage, StorageError, Transient, is_missing
from volunteer_rl.storage.pace import Paced, paced
from volunteer_rl.task.base import Row, Task
from volunteer_rl.task.dataset import DatasetError, load_rows
from volunteer_rl.task.registry import for_manifest
from volunteer_rl.volunteer.batch import sample_batch
from volunteer_rl.volunteer.heartbeat import (Heartbeat, Tally, heartbeat_payload, host_facts,
                                              upload_summary)
from volunteer_rl.volunteer.host import HostControls, owed_due
from volunteer_rl.volunteer.identity import claim_id, default_volunteer_id  # noqa: F401 (its old home)
from volunteer_rl.volunteer.numbering import Batch, GroupNumbers
from volunteer_rl.volunteer.quota import Allowance
from volunteer_rl.volunteer.shard_writer import ShardWriter


OUTAGE_MAX_WAIT = 60.0
"""Longest wait between two polls of a bucket that does not answer."""
ASK_BATCHES = 1
"""Batches of numbers one ask is for. One, asked for as a batch starts: the grant comes while
that batch is sampled, bound to the trainer's newest version then, so it is sampled at most a
batch later; a second batch granted with it went stale when the trainer published once a batch."""
STOP_WAIT_SECONDS = 30.0
"""Longest a stopping volunteer waits for the grant of its ask ahead (Volunteer._finish)."""
LOAD_ERRORS = (CheckpointError, StorageError, DatasetError, OSError, ValueError)
"""What loading a version can fail with that is the bucket's or the link's, not a bug: said in
one line, and the version tried again later (or, once stopping, left)."""
UNPUBLISHED_LINE_SECONDS = 60.0
"""While nothing is published, the "waiting for the trainer's first version" line comes at
once and then once a minute: a trainer's warm start takes minutes, and a line every status
interval from each volunteer beside it buried the trainer's progress (vrl demo)."""


class Volunteer:
    def __init__(self, cfg: VolunteerConfig, log: Callable[[str], None] = print,
                 stop: StopSignal | None = None):
        self.cfg = cfg
        self.log = log
        # Set by SIGINT/SIGTERM once handlers are installed (the CLI does that first of all).
        # Loading a version is abortable: it writes nothing to the bucket, and a stop cuts it
        # short. The batch being sampled, and the numbers granted ahead of it, are sampled and
        # uploaded with the partial shard: numbers granted and left unused would count as
        # missing (a second signal still ends the process at once, as a crash would).
        self.stop = stop or StopSignal(log)
        self.stop.then = "finishing the batches granted, uploading them and stopping"
        with self.stop.shielded():  # a line added to the work dir's ids file: never half of it
            self.claim = claim_id(Path(cfg.work_dir), cfg.volunteer_id, log)  # kept across restarts
        self.id = self.claim.id
        # Every read and write of this volunteer goes through here, the heartbeat thread's too:
        # --max-download-rate and --max-upload-rate cap them all (storage/pace.py).
        self.storage = paced(open_storage(cfg.bucket, cfg.endpoint_url),
                             parse_rate(cfg.max_download_rate), parse_rate(cfg.max_upload_rate))
        self.trust = reader_trust(self.storage.uri, cfg.endpoint_url, cfg.work_dir, cfg.trust_key,
                                  cfg.allow_unsigned, log)
        self.device = pick_device(cfg.device)
        self.host = host_facts(str(self.device))
        self.work = Path(cfg.work_dir) / self.id
        self.policy: Policy | None = None
        self.task: Task | None = None  # the manifest's task, from this machine's packages
        self.problems: list[Row] = []
        self.held: Held | None = None  # the weights file of the version loaded, verified
        self.model_root: str | None = None  # the weights file the model holds (a LoRA run's base)
        self.weights_buffer: memoryview | None = None  # reused by every fetch
        self.threads = 0  # torch threads in force for sampling (set_sampling_threads)
        self.manifest: Manifest | None = None
        self.last_manifest_ok = 0.0
        self.warned: dict[str, str] = {}
        self.outage_wait = 0.0  # seconds to the next poll while the bucket is unreachable
        self.manifest_etag: str | None = None
        self.latest: Manifest | None = None  # newest manifest read, loaded or not
        # The manifest's quota and --max-groups-per-version: how much of a version to sample.
        self.allowance = Allowance(cfg.max_groups_per_version, cfg.prompts_per_batch or MODEL_PROMPTS,
                                   cfg.cap_patience_seconds, log)
        self.tally = Tally(started_at=time.time())
        self.summary = Every()  # the upload summary line's interval
        self.unpublished = Every(UNPUBLISHED_LINE_SECONDS)
        self.last_summary = (self.tally.started_at, 0, 0)  # (time, shards, groups) at the last one
        self.numbers = GroupNumbers(self.work / "group-numbers.json", self.storage, self.id,
                                    self.trust, log)
        self.manifests: dict[int, Manifest] = {}
        """The manifests of the window's versions read so far: the grants name their versions."""
        self.heartbeat = Heartbeat(self.storage, self.id, cfg.heartbeat_seconds,
                                   self._heartbeat_payload, log)
        self.sampling: int | None = None  # the version of the batch being sampled, if any
        self.writer: ShardWriter | None = None
        self.host_controls = HostControls(cfg.cpu_share, cfg.pause_when_busy, cfg.run_on_battery,
                                          self.stop, log, self._follow, self._owed_due,
                                          self._flush, cfg.poll_seconds)

    # -- following the manifest ---------------------------------------------------------------

    def poll(self) -> Manifest | None:
        """The newest manifest (the one already held when unchanged); None if none is readable.

        An unreachable bucket is ridden out (`_outage`)."""
        try:
            m, self.manifest_etag = poll_manifest(self.storage, self.manifest_etag, trust=self.trust)
        except Rollback as exc:
            # As for an unreadable manifest: keep what we hold (generating for the grace
            # period), never load what this one names, and read it in full again next time
            # (an etag kept here would make its 304s look like a fresh manifest).
            self.manifest_etag = None
            keeping = f"; keeping v{self.manifest.version}" if self.manifest is not None else ""
            self._warn("manifest", f"{exc}; refused (nothing it names is loaded){keeping}, still polling")
            return None
        except SignatureError as exc:
            if self.latest is None:
                raise  # never accepted one: this bucket's trainer is not the one we trust
            self.manifest_etag = None
            self._warn("manifest", f"{exc}; refused (nothing it names is loaded), still polling")
            return None
        except ManifestError as exc:
            if isinstance(exc.__context__, Transient):  # poll_manifest's word for "unreachable"
                return self._outage(exc)
            self.manifest_etag = None  # read it in full again next time
            self._warn("manifest", f"{exc}; waiting for a valid one")
            return None
        self.warned.pop("manifest", None)
        self.outage_wait = 0.0
        if m is not None:
            self.latest = m
        if self.manifest_etag is None:  # nothing published yet
            return None
        self.last_manifest_ok = time.time()
        return self.latest

    def _nothing_published(self) -> bool:
        """The last poll found no manifest: the bucket answered, nothing there was refused."""
        return (self.latest is None and self.manifest_etag is None and not self.outage_wait
                and "manifest" not in self.warned)

    def _outage(self, exc: Exception) -> None:
        """The bucket did not answer (storage/retry.py gave up): say so, with the wait before
        the next poll, which doubles from --poll-seconds to OUTAGE_MAX_WAIT while it lasts."""
        if not self.stop.is_set():  # else the retry's wait was cut short by the stop
            self.outage_wait = min(OUTAGE_MAX_WAIT, max(self.cfg.poll_seconds, 2 * self.outage_wait))
            self.log(f"warning: {exc}; polling again in {self.outage_wait:.0f}s")
        return None

    def _load_dataset(self, m: Manifest, task: Task) -> list[Row]:
        data = self.storage.read(m.dataset.key, max_bytes=m.dataset.size)
        if sha256_bytes(data) != m.dataset.sha256:
            raise StorageError(f"{m.dataset.key}: sha256 does not match manifest.json")
        path = self.work / "dataset.csv"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return load_rows(path, task)

    def switch(self, m: Manifest) -> None:
        """Move to the manifest's version: swap weights in place when only they changed.

        The weights come into memory (chain.fetch_weights: the patches after the version
        held, or the keyframe and the patches after it, whichever is fewer bytes), are checked
        piece by piece against the manifest, and only then copied into the model; a swap
        writes nothing to disk. A LoRA version's weights file is its base's, held after the
        first fetch and copied into the model once; its adapter is fetched, checked and held
        unmerged beside it (chain.onto_version). The buffer then holds this version's weights
        file, for the next version's patches. Weights published in bf16 (`m.weights_dtype`)
        are upcast into the fp32 model exactly: the volunteer computes in fp32 with the
        bf16-rounded values, as the trainer's audit does.

        Either way the checkpoint is checked before any of it is downloaded (its file names,
        config.json, the weights' size: vetting.check_checkpoint) and a full load checks
        the folder again (load_policy). Nothing changes until the new version has loaded: on
        any error the volunteer keeps the model, dataset and manifest it holds.

        The manifest's task must be installed here, from the package and version it names
        (task.registry.for_manifest): a TaskError, raised before anything is fetched, stops
        the volunteer with one line saying what to install. Nothing of a task ever comes from
        the bucket but its dataset's rows."""
        old = self.manifest
        task = self.task if old is not None and old.task == m.task else for_manifest(m.task)[0]
        same_shape = (old is not None and old.run_id == m.run_id and self.policy is not None
                      and all(old.files.get(n) == e for n, e in m.files.items()
                              if n not in (WEIGHTS_FILE, ADAPTER_FILE)))
        folder = self.work / "checkpoint"
        try:
            fetched = fetch_weights(self.storage, m, self.held, self.log, self.weights_buffer)
        except BaseException:
            self.held = None  # a failed fetch may leave garbage in the buffer it patched
            raise
        # The buffer now holds m's weights file, verified, whatever happens next.
        self.weights_buffer = fetched.buf
        self.held = Held(m.run_id, m.version, m.files[WEIGHTS_FILE].root, fetched.buf)
        if same_shape:
            self._check_pool(m, self.problems)
            holds, self.model_root = self.model_root, None  # unknown while the model changes
            self.policy, self.model_root = onto_version(self.storage, m, self.policy, fetched.buf,
                                                         holds)
        else:
            fetch_checkpoint(self.storage, m, folder, require_model=True, weights=fetched.buf)
            new_data = old is None or old.dataset != m.dataset or old.task != m.task
            problems = self._load_dataset(m, task) if new_data else self.problems
            self._check_pool(m, problems)
            policy = load_policy(folder, self.device)
            self.policy, self.model_root = onto_version(self.storage, m, policy, fetched.buf,
                                                         m.files[WEIGHTS_FILE].root)
            if new_data:
                self.problems, self.task = problems, task
            self.policy.model.eval()
            self.allowance.batch = sampling_prompts(self.policy, self.cfg.prompts_per_batch)
            threads = set_sampling_threads(self.policy, self.cfg.threads)
            if threads != self.threads:
                how = "--threads" if self.cfg.threads > 0 else "auto"
                self.log(f"sampling with {threads} torch thread{'s' * (threads != 1)} ({how})")
                self.threads = threads
        self.manifest = m
        self.log(f"now on v{m.version} of {m.run_id} ({fetched_text(fetched, m)})")

    @staticmethod
    def _check_pool(m: Manifest, problems: list[Row]) -> None:
        """Every row of the manifest's prompt pool is a row of the dataset held."""
        if max(m.prompt_pool) >= len(problems):
            raise DatasetError(f"{m.dataset.key}: {len(problems)} rows, but the prompt pool "
                               f"of v{m.version} names row {max(m.prompt_pool)}")

    # -- the loop -----------------------------------------------------------------------------

    def _generate(self, batch: Batch) -> list[Group]:
        """One batch of granted numbers (all of the version in hand), sampled (volunteer.batch).
        Not abortable: a stop waits for this batch, whose numbers are granted (numbering.py);
        it is uploaded before the volunteer exits. A host-control pause holds between steps."""
        self.sampling = self.manifest.version
        try:
            return sample_batch(self.manifest, self.policy, self.task, self.problems, self.id,
                                batch, self.host_controls.between_steps)
        finally:
            self.sampling = None

    def _next_batch(self, m: Manifest | None) -> Batch | None:
        """The next granted numbers to sample, if their version is still in the window of the
        newest manifest `m` (grants of versions that left it are skipped, and said so)."""
        while True:
            batch = self.numbers.batch(self.allowance.batch)
            if batch is None:
                return None
            if m is None and time.time() - self.last_manifest_ok > self.cfg.manifest_grace_seconds:
                return None
            if m is None or batch.version >= layout.window(m.version, m.max_staleness).start:
                return batch
            self.log(f"numbers {batch.first}-{batch.grant.end - 1} were granted for "
                     f"v{batch.version}, which left the window before they were sampled; skipped")
            self.numbers.skip(batch)

    def _manifest_of(self, version: int) -> Manifest | None:
        """The manifest of `version`: one polled, else its kept copy (checked like any)."""
        m = self.manifests.get(version)
        if m is not None:
            return m
        try:
            m = read_manifest(self.storage, version, trust=self.trust)
        except (ManifestError, SignatureError) as exc:
            self._warn("manifest", f"{exc}; cannot sample the numbers granted for v{version} yet")
            return None
        if m is None or self.latest is None or m.run_id != self.latest.run_id:
            return None
        self.manifests[version] = m
        return m

    def _remember(self, m: Manifest) -> None:
        """Keep the manifests of the window's versions: grants name them."""
        low = layout.window(m.version, m.max_staleness).start
        self.manifests = {v: x for v, x in self.manifests.items() if v >= low and x.run_id == m.run_id}
        self.manifests[m.version] = m

    def _ask(self, m: Manifest | None) -> None:
        """Ask for numbers to sample with the newest version `m`, within its limits (room); at
        the manifest's quota, for numbers of the version after it (numbering: an ask ahead)."""
        if m is None or self.manifest is None or not self.usable(m):
            return
        if not self.host_controls.may_ask():
            return  # paused: nothing new (what is granted is sampled, host.owed_due)
        granted = sum(x.end - x.first for x in self.numbers.grants if x.version == m.version)
        room = self.allowance.room(m, granted, time.time())
        if room:
            self.numbers.ask(m.version, min(room, ASK_BATCHES * self.allowance.batch))
        elif self.allowance.quota_reached:
            # The trainer holds this ask until it publishes m.version + 1 and answers it then:
            # asked only once that version is seen, the grant was a trainer poll late each time
            # (the demo's volunteers waited for grants over a quarter of their time).
            self.numbers.ask(m.version + 1, ASK_BATCHES * self.allowance.batch)

    def try_switch(self, m: Manifest) -> bool:
        """Switch to `m`; on a bad or unreachable checkpoint say so once and report failure.

        A checkpoint that is gone was removed by retention after we read its manifest (the
        trainer has moved on): read the manifest again and go where it points now. A refused
        one (CheckpointRefused: a file no checkpoint may hold, a config asking for code or
        out of bounds) is like any bad checkpoint once a model is loaded; before that it is
        fatal: the bucket names nothing this volunteer will ever load."""
        while True:
            try:
                with self.stop.abortable():  # writes only local caches, fetched again next time
                    self.switch(m)
            except LOAD_ERRORS as exc:
                if isinstance(exc, CheckpointRefused) and self.policy is None:
                    raise
                now = self._moved_on(m) if is_missing(exc) else None
                if now is None:
                    self._warn("switch", f"cannot load v{m.version}: {exc}; will retry")
                    return False
                self.log(f"v{m.version} was removed from the bucket; the manifest now names v{now.version}")
                m = now
                continue
            self.warned.pop("switch", None)
            return True

    def _moved_on(self, m: Manifest) -> Manifest | None:
        """The manifest as it is now, if it names another version than `m`; else None."""
        now = self.poll()
        if now is None or (now.run_id, now.version) == (m.run_id, m.version):
            return None
        return now

    def _uploaded(self, groups: int) -> None:
        """Count an uploaded shard; say what was uploaded at the first one, then at most once
        per progress.STATUS_SECONDS (a line per shard is --log-shards)."""
        now = time.time()
        self.tally.uploaded(groups, now)
        if self.summary.due():
            t = self.tally
            since, shards, made = self.last_summary
            self.log(upload_summary(t.shards - shards, t.groups_uploaded - made, now - since,
                                    self.manifest.version, t.groups_uploaded))
            self.last_summary = (now, t.shards, t.groups_uploaded)

    def _heartbeat_payload(self, state: str, now: float) -> dict:
        """What the heartbeat thread writes: counters plus the version in use."""
        m = self.manifest
        return {**heartbeat_payload(self.id, state, self.host, self.tally, self.cfg.heartbeat_seconds,
                                    m.run_id if m else None, m.version if m else None, now),
                "waiting": self.allowance.waiting, "paused": self.host_controls.paused}

    def _warn(self, topic: str, message: str) -> None:
        """Log a problem once, not once per poll, until it changes or goes away."""
        if self.warned.get(topic) != message:
            self.log(f"warning: {message}")
            self.warned[topic] = message

    def usable(self, m: Manifest | None) -> bool:
        """May we generate with the weights we hold, given the newest manifest we could read?"""
        if self.manifest is None:
            return False
        if m is None:  # no fresh manifest: trust ours only for a grace period
            return time.time() - self.last_manifest_ok <= self.cfg.manifest_grace_seconds
        # Only the bottom of the window counts here: weights of a version above the manifest's
        # are not too old.
        return (m.run_id == self.manifest.run_id
                and self.manifest.version >= layout.window(m.version, m.max_staleness).start)

    def run(self) -> int:
        """Generate until stopped; returns the number of groups uploaded."""
        cfg = self.cfg
        if cfg.nice > 0 and hasattr(os, "nice"):  # POSIX only; elsewhere the OS decides
            os.nice(cfg.nice)
        started = time.time()
        self.log(f"volunteer {self.id} on {self.device}, bucket {self.storage.uri}")
        if isinstance(self.storage, Paced):
            self.log(self.storage.caps())
        if self.trust.key:
            self.log(f"manifests must be signed by {self.trust.key} ({self.trust.origin})")
        if self.trust.mark is not None and self.trust.mark.seen is not None:
            self.log(f"refusing manifests behind {self.trust.mark.seen}, the newest seen from this "
                     f"bucket ({self.trust.mark.path})")
        writer = ShardWriter(self.storage, self.id, cfg.shard_groups, cfg.shard_seconds,
                             self.log if cfg.log_shards else None, on_upload=self._uploaded)
        self.writer = writer
        self.heartbeat.start()
        try:
            while not self.stop.is_set():
                if cfg.max_seconds and time.time() - started >= cfg.max_seconds:
                    break
                self.host_controls.hold(until=started + cfg.max_seconds if cfg.max_seconds else None)
                m = self.poll()
                if m is None and self._nothing_published() and self.unpublished.due():
                    self.log(f"waiting for the trainer's first version: no {layout.MANIFEST} in "
                             f"{self.storage.uri} yet ({time.time() - started:.0f}s so far)")
                if m is not None:
                    self._remember(m)
                    if self.manifest is None or m.run_id != self.manifest.run_id:
                        writer.flush()  # its groups belong to the run we are leaving
                        if not self.try_switch(m):
                            self.stop.wait(max(cfg.poll_seconds, self.outage_wait))
                            continue
                    self.numbers.start_run(m.run_id)
                latest = m if self.manifest is not None else None  # None: none readable now
                batch = self._next_batch(m)
                if batch is None:
                    # No numbers granted to sample (or nothing published yet, or the bucket
                    # is away past the grace period): load the newest version while waiting
                    # (not while an ask for an older one may still be granted: it would load
                    # that one back), ask for numbers to sample with it and read the grants;
                    # at the manifest's quota what we hold goes out now.
                    if (latest is not None and latest.version != self.manifest.version
                            and not self.numbers.awaited(version=latest.version)):
                        writer.flush()  # its groups belong to the version we are leaving
                        self.try_switch(latest)
                    self._ask(latest)
                    self.numbers.refresh()
                    if latest is not None and self.usable(latest) and self.allowance.quota_reached:
                        writer.flush()
                    if self._next_batch(m) is None:
                        self.stop.wait(max(cfg.poll_seconds, self.outage_wait))
                    continue
                batch = self._on_its_version(batch, writer, self.try_switch)
                if batch is None:
                    self.stop.wait(max(cfg.poll_seconds, self.outage_wait))
                    continue
                if (self.numbers.pending() - batch.count < self.allowance.batch
                        and not self.host_controls.rests):
                    self._ask(latest)  # the next grant arrives while this batch is sampled
                self._sample(batch, writer)
                self.numbers.refresh()
            self._finish(writer)
        except Stopped:
            pass  # it cut short a load, which wrote nothing to the bucket
        finally:
            try:
                writer.flush()
            finally:
                self.heartbeat.stop()  # the last heartbeat says `stopped`, with final totals
        return writer.uploaded_groups

    def _follow(self) -> None:
        """While paused: read the manifest and the grants, as the loop would."""
        m = self.poll()
        if m is not None:
            self._remember(m)
        self.numbers.refresh()

    def _flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def _owed_due(self) -> int | None:
        """The version of numbers granted to us and not sampled yet (the batch in hand
        included) that a pause must sample now (host.owed_due); None."""
        m = self.latest
        return owed_due((self.sampling, self.numbers.oldest_owed()), m.version if m else None)

    def _sample(self, batch: Batch, writer: ShardWriter) -> None:
        """Sample `batch` (its version loaded) and hand its groups to the writer."""
        groups = self._generate(batch)
        self.numbers.sampled(batch)
        self.tally.generated(len(groups), sum(len(g.completions) for g in groups), time.time())
        writer.limit = self.manifest.max_shard_groups
        writer.add(groups, self.manifest.version)
        if self.host_controls.rests:  # with no ask ahead, no grant is in hand while it rests
            writer.flush()  # what it sampled goes out before the rest, not after
            self.host_controls.rest()

    def _finish(self, writer: ShardWriter) -> None:
        """Before exiting, sample the numbers granted and not sampled yet (the batch granted
        ahead, ASK_BATCHES), so that a stop leaves none to count as missing; not those whose
        version left the window, nor those of a version that cannot be loaded now. An ask
        ahead (at the quota) is waited for, as long as the quota says the trainer takes to
        publish (at most STOP_WAIT_SECONDS): granted after the volunteer left, it would count
        as missing."""
        self._await_ask_ahead()
        while (batch := self._next_batch(self.latest)) is not None:
            batch = self._on_its_version(batch, writer, self._switch_stopping)
            if batch is None:
                return
            self._sample(batch, writer)

    def _on_its_version(self, batch: Batch, writer: ShardWriter,
                        load: Callable[[Manifest], bool]) -> Batch | None:
        """`batch`, or if it is of another version than the one loaded, that version loaded
        with `load` (the shard in hand flushed first) and the batch taken again (its size may
        change); None when that version's manifest is gone or `load` failed."""
        if batch.version == self.manifest.version:
            return batch
        writer.flush()  # its groups belong to the version we are leaving
        target = self._manifest_of(batch.version)
        if target is None or not load(target):
            return None
        return self.numbers.batch(self.allowance.batch)

    def _switch_stopping(self, m: Manifest) -> bool:
        """Switch to `m` after the stop came (not abortable), to sample the numbers granted
        for it; a failure is said once and leaves them."""
        try:
            self.switch(m)
        except LOAD_ERRORS as exc:
            self.log(f"warning: cannot load v{m.version} to sample the numbers granted for it: "
                     f"{exc}; leaving them")
            return False
        return True

    def _await_ask_ahead(self) -> None:
        """Wait for the grant of an unanswered ask ahead (see _finish)."""
        m = self.latest
        if m is None or self.manifest is None or not self.numbers.asked_ahead(m.version):
            return
        wait = min(STOP_WAIT_SECONDS, m.quota.wait_seconds if m.quota else STOP_WAIT_SECONDS)
        self.log(f"waiting up to {wait:g}s for the numbers asked for v{m.version + 1}, "
                 "to sample them before stopping (a second signal stops now)")
        deadline = time.time() + wait
        while self.numbers.asked_ahead(m.version) and time.time() < deadline:
            time.sleep(min(self.cfg.poll_seconds, max(0.0, deadline - time.time())))
            self.numbers.refresh()

    def install_signal_handlers(self) -> None:
        """Ctrl-C and SIGTERM cut short a load, finish the batches granted, flush the partial
        shard, exit 0 (stopping.py). `vrl volunteer` installs them itself before it imports
        torch; this is for programs that build a Volunteer."""
        self.stop.install()
