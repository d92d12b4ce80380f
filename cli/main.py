"""`vrl`: thin typer commands over the volunteer_rl library.

Heavy imports (torch, transformers, fsspec) happen inside the commands, so `vrl --help` is
instant. Known errors become one line on stderr and exit code 1, never a traceback.
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import Annotated, Optional

import typer

app = typer.Typer(
    help="Reinforcement learning with volunteers' machines as generators and a bucket as the "
         "only rendezvous.\n\nQuick start: `vrl demo`.",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)

# Shared option aliases: every command spells these the same way.
Bucket = Annotated[str, typer.Option("--bucket", "-b", help="Bucket URI: a folder, file://, s3://bucket/prefix, gs://bucket/prefix.")]
Endpoint = Annotated[Optional[str], typer.Option("--endpoint-url", envvar="VRL_ENDPOINT_URL", help="S3-compatible endpoint (MinIO, R2, a test server).")]
Threads = Annotated[int, typer.Option("--threads", help="torch CPU threads (0: torch's default).")]
Device = Annotated[str, typer.Option("--device", help="cuda, mps, cpu or auto.")]
TrustKey = Annotated[Optional[str], typer.Option("--trust-key", envvar="VRL_TRUST_KEY", help="The trainer's public key (ed25519:...) or a file holding it; without it the key of the first manifest seen is pinned for this bucket.")]
AllowUnsigned = Annotated[bool, typer.Option("--allow-unsigned", help="Accept manifests without a signature (an older trainer).")]
SigningKey = Annotated[Optional[str], typer.Option("--signing-key", help="The trainer's Ed25519 private key (PEM), created if missing (default: WORK_DIR/signing-key.pem). Keep it out of the bucket.")]


def _log(msg: str) -> None:
    print(msg, flush=True)


@contextmanager
def _clean_errors():
    """Map the library's known errors to one line naming the object or flag."""
    from volunteer_rl.model.checkpoint import CheckpointError
    from volunteer_rl.protocol.fleet import DenylistError
    from volunteer_rl.protocol.manifest import ManifestError
    from volunteer_rl.protocol.signing import SignatureError
    from volunteer_rl.storage.base import StorageError
    from volunteer_rl.task.calculator import DatasetError

    known = (CheckpointError, DenylistError, ManifestError, SignatureError, StorageError,
             DatasetError, ValueError)
    try:
        yield
    except Exception as exc:
        # TrainerError only if the trainer was imported: importing it means importing torch,
        # seconds that commands like `vrl status` have no use for.
        trainer = sys.modules.get("volunteer_rl.trainer.loop")
        if not isinstance(exc, known + ((trainer.TrainerError,) if trainer else ())):
            raise
        print(f"error: {exc}", file=sys.stderr)
        raise typer.Exit(1)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        raise typer.Exit(130)


@app.command()
def trainer(
    bucket: Bucket,
    endpoint_url: Endpoint = None,
    model: Annotated[str, typer.Option(help="`tiny` (built offline) or a local Hugging Face model folder.")] = "tiny",
    dataset: Annotated[Optional[str], typer.Option(help="Train CSV with columns python_expression,natural_language.")] = None,
    eval_dataset: Annotated[Optional[str], typer.Option(help="Held-out CSV of the same schema.")] = None,
    algo: Annotated[str, typer.Option(help="reinforce or grpo.")] = "grpo",
    lr: Annotated[float, typer.Option(help="RL learning rate.")] = 3e-4,
    k: Annotated[int, typer.Option("-k", "--k", help="Completions per prompt.")] = 8,
    temperature: Annotated[float, typer.Option(help="Sampling temperature for volunteers.")] = 1.0,
    max_new_tokens: Annotated[int, typer.Option(help="Generated tokens per completion, at most.")] = 32,
    max_staleness: Annotated[int, typer.Option(help="Versions a group may lag the trainer and still be used.")] = 2,
    groups_per_step: Annotated[int, typer.Option(help="Prompt groups per optimizer step.")] = 32,
    publish_every: Annotated[int, typer.Option(help="Optimizer steps per published version.")] = 1,
    keep_versions: Annotated[int, typer.Option(min=1, help="Retention keeps the newest N versions (and the staleness window).")] = 10,
    gc_every: Annotated[int, typer.Option(min=0, help="Retention pass after every M publishes, as `vrl gc` (0: off).")] = 0,
    eval_every: Annotated[int, typer.Option(help="Versions between held-out evals (0: off).")] = 10,
    warm_start_steps: Annotated[int, typer.Option(help="Supervised steps before v0 for --model tiny.")] = 900,
    max_steps: Annotated[int, typer.Option(help="Stop after this many steps (0: never).")] = 0,
    max_seconds: Annotated[float, typer.Option(help="Stop after this many seconds of RL (0: never).")] = 0.0,
    seed: Annotated[int, typer.Option(help="Random seed.")] = 0,
    poll_seconds: Annotated[float, typer.Option(help="Seconds between rollout listings while waiting.")] = 0.2,
    threads: Threads = 0,
    device: Device = "auto",
    work_dir: Annotated[str, typer.Option(help="Local scratch folder; its state/ holds the optimizer between publishes.")] = ".vrl/trainer",
    signing_key: SigningKey = None,
    allow_unsigned: Annotated[bool, typer.Option("--allow-unsigned", help="Resume a bucket whose manifest is unsigned (an older trainer).")] = False,
    weights_dtype: Annotated[str, typer.Option(help="dtype of the published weights: fp32, or bf16 (half the bytes per version; the trainer keeps fp32 master weights).")] = "fp32",
    audit_tolerance: Annotated[float, typer.Option(help="Max gap (nats) between claimed and recomputed behavior logprobs (0: no audit).")] = 0.05,
    deny_after: Annotated[int, typer.Option(help="Rejected shards before a volunteer is denied (0: never).")] = 5,
    deny_rate: Annotated[float, typer.Option(help="...if at least this share of its shards was rejected.")] = 0.5,
    log_shards: Annotated[bool, typer.Option("--log-shards", help="One log line per shard taken.")] = False,
    dashboard_every: Annotated[float, typer.Option(min=0, metavar="SECONDS", help="Write dashboard/ (HTML + plots) every SECONDS, but never sooner than 50x the last write took (at most 2 % of the trainer's time), and at the last publish (0: off).")] = 60.0,
):
    """Run the central trainer: publish v0 on an empty bucket (or resume), learn from fresh
    rollout shards, publish a new version every --publish-every steps. Ctrl-C or SIGTERM,
    also to a trainer started in the background (`vrl trainer ... &`), finishes the current
    step, publishes the steps not yet published (without the final evaluation), writes their
    metrics, fleet.json and dashboard/, and exits 0; before the first step it stops at once,
    leaving no half-made version. A second signal while stopping exits at once.

    Example: vrl trainer --bucket s3://my-bucket/run1 --algo grpo --max-staleness 2
    """
    from volunteer_rl.config import TrainerConfig
    from volunteer_rl.trainer.stopping import Stopped, StopSignal

    cfg = TrainerConfig(**{k_: v for k_, v in locals().items() if k_ in TrainerConfig.__dataclass_fields__})
    if algo not in ("reinforce", "grpo"):
        raise typer.BadParameter("use reinforce or grpo", param_hint="--algo")
    if weights_dtype not in ("fp32", "bf16"):
        raise typer.BadParameter("use fp32 or bf16", param_hint="--weights-dtype")
    # Handlers first (the library's, as Trainer.install_signal_handlers would install them):
    # importing torch takes seconds, and a signal then must stop the process too.
    stop = StopSignal(_log).install()
    trainer_ = None
    with _clean_errors():
        try:
            with stop.abortable():
                from volunteer_rl.trainer.loop import Trainer

                trainer_ = Trainer(cfg, log=_log, stop=stop)
            trainer_.start()
            manifest = trainer_.run()
        except Stopped as exc:
            published = getattr(trainer_, "manifest", None)
            _log(f"trainer stopped by signal {exc.signum} before its first step; "
                 + (f"the bucket stands at v{published.version}" if published else "nothing published"))
            return
        _log(f"trainer stopped at v{manifest.version}")


@app.command()
def volunteer(
    bucket: Bucket,
    endpoint_url: Endpoint = None,
    id: Annotated[Optional[str], typer.Option("--id", help="Volunteer id (default: hostname + random suffix).")] = None,
    prompts_per_batch: Annotated[int, typer.Option(help="Prompts per batched generate call.")] = 16,
    shard_groups: Annotated[int, typer.Option(help="Upload a shard every this many groups...")] = 32,
    shard_seconds: Annotated[float, typer.Option(help="...or every this many seconds.")] = 20.0,
    max_groups_per_version: Annotated[int, typer.Option(help="Groups per published version, at most (0: no cap).")] = 0,
    poll_seconds: Annotated[float, typer.Option(help="Seconds between manifest polls while idle.")] = 1.0,
    max_seconds: Annotated[float, typer.Option(help="Stop after this many seconds (0: until Ctrl-C).")] = 0.0,
    heartbeat_seconds: Annotated[float, typer.Option(min=0, help="Seconds between heartbeats (volunteers/ID.json; 0: none).")] = 30.0,
    seed: Annotated[Optional[int], typer.Option(help="Seed for prompt choice and sampling.")] = None,
    threads: Annotated[int, typer.Option("--threads", help="torch CPU threads for sampling (0: auto, 1 for a model under 5 M parameters on the CPU, else torch's default).")] = 0,
    curriculum: Annotated[bool, typer.Option(help="Prefer prompts likely to have reward variance (off: uniform).")] = True,
    nice: Annotated[int, typer.Option(min=0, max=19, help="Lower CPU priority by this much (POSIX niceness; 0: unchanged).")] = 10,
    device: Device = "auto",
    work_dir: Annotated[str, typer.Option(help="Local cache for dataset and checkpoints.")] = ".vrl/volunteer",
    trust_key: TrustKey = None,
    allow_unsigned: AllowUnsigned = False,
):
    """Donate compute: follow the bucket's manifest, sample rollouts with the newest weights,
    upload shards. Ctrl-C or SIGTERM uploads the partial shard and exits 0.

    Example: vrl volunteer --bucket s3://my-bucket/run1 --endpoint-url https://minio.example.org
    """
    from volunteer_rl.config import VolunteerConfig

    cfg = VolunteerConfig(bucket=bucket, endpoint_url=endpoint_url, volunteer_id=id,
                          prompts_per_batch=prompts_per_batch, shard_groups=shard_groups,
                          shard_seconds=shard_seconds, max_seconds=max_seconds, seed=seed,
                          max_groups_per_version=max_groups_per_version, poll_seconds=poll_seconds,
                          threads=threads, nice=nice, curriculum=curriculum, device=device, work_dir=work_dir,
                          trust_key=trust_key, allow_unsigned=allow_unsigned,
                          heartbeat_seconds=heartbeat_seconds)
    with _clean_errors():
        from volunteer_rl.volunteer.loop import Volunteer

        v = Volunteer(cfg, log=_log)
        v.install_signal_handlers()
        groups = v.run()
        _log(f"volunteer {v.id} stopped after uploading {groups} groups")


volunteers_app = typer.Typer(help="See and edit the denylist of volunteers (denylist.json).",
                              no_args_is_help=True)
app.add_typer(volunteers_app, name="volunteers")


@volunteers_app.command("list")
def volunteers_list(bucket: Bucket, endpoint_url: Endpoint = None):
    """Print the denied volunteers, why and since when.

    Example: vrl volunteers list --bucket s3://my-bucket/run1
    """
    with _clean_errors():
        from volunteer_rl.protocol.fleet import read_denylist
        from volunteer_rl.storage.base import open_storage

        entries, _ = read_denylist(open_storage(bucket, endpoint_url))
        if not entries:
            print("no volunteer is denied")
        for vid, e in sorted(entries.items()):
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(e.get("since", 0)))
            print(f"{vid}\tdenied {since} UTC by {e.get('by', '?')}: {e.get('reason', '')}")


def _edit_denylist(bucket: str, endpoint_url: str | None, volunteer_id: str, deny: bool,
                   reason: str = "") -> bool:
    """Add or remove one id with a compare-and-swap; True if the list changed."""
    from volunteer_rl.protocol.fleet import update_denylist
    from volunteer_rl.protocol.layout import is_safe_name
    from volunteer_rl.storage.base import open_storage

    if not is_safe_name(volunteer_id):
        raise typer.BadParameter(f"{volunteer_id!r} is not a volunteer id", param_hint="ID")
    changed = []

    def change(entries: dict) -> bool:
        if deny and volunteer_id not in entries:
            entries[volunteer_id] = {"since": time.time(), "by": "operator", "reason": reason}
        elif not deny and volunteer_id in entries:
            del entries[volunteer_id]
        else:
            return False
        changed.append(True)
        return True

    update_denylist(open_storage(bucket, endpoint_url), change)
    return bool(changed)


@volunteers_app.command("allow")
def volunteers_allow(volunteer_id: Annotated[str, typer.Argument(metavar="ID")], bucket: Bucket,
                     endpoint_url: Endpoint = None):
    """Lift a denial: the trainer reads this volunteer's shards again, counts reset.

    Example: vrl volunteers allow laptop-3f2a --bucket s3://my-bucket/run1
    """
    with _clean_errors():
        changed = _edit_denylist(bucket, endpoint_url, volunteer_id, deny=False)
    print(f"{volunteer_id}: {'allowed again' if changed else 'was not denied'}")


@volunteers_app.command("deny")
def volunteers_deny(volunteer_id: Annotated[str, typer.Argument(metavar="ID")], bucket: Bucket,
                    endpoint_url: Endpoint = None,
                    reason: Annotated[str, typer.Option(help="Why, for the record.")] = "denied by an operator"):
    """Stop the trainer from reading a volunteer's shards until `vrl volunteers allow`.

    Example: vrl volunteers deny laptop-3f2a --bucket s3://my-bucket/run1 --reason "spam"
    """
    with _clean_errors():
        changed = _edit_denylist(bucket, endpoint_url, volunteer_id, deny=True, reason=reason)
    print(f"{volunteer_id}: {'denied' if changed else 'was already denied'}")


@app.command("eval")
def eval_(
    bucket: Bucket,
    endpoint_url: Endpoint = None,
    version: Annotated[Optional[int], typer.Option(help="Published version (default: the current one).")] = None,
    dataset: Annotated[Optional[str], typer.Option(help="CSV to evaluate on (default: the shipped held-out split).")] = None,
    samples: Annotated[int, typer.Option(help="Samples per prompt for the sampled accuracy.")] = 4,
    device: Device = "auto",
    work_dir: Annotated[str, typer.Option(help="Local cache for checkpoints.")] = ".vrl/eval",
    trust_key: TrustKey = None,
    allow_unsigned: AllowUnsigned = False,
):
    """Held-out accuracy of a published version, greedy and at its sampling temperature.

    Example: vrl eval --bucket ./bucket --version 0
    """
    with _clean_errors():
        from volunteer_rl.config import PACKAGE_DATA
        from volunteer_rl.model.policy import pick_device
        from volunteer_rl.protocol.signing import reader_trust
        from volunteer_rl.storage.base import open_storage
        from volunteer_rl.task.calculator import load_csv
        from volunteer_rl.trainer.evaluate import greedy_and_sampled, load_version

        problems = load_csv(dataset or PACKAGE_DATA / "eval.csv")
        storage = open_storage(bucket, endpoint_url)
        trust = reader_trust(storage.uri, endpoint_url, work_dir, trust_key, allow_unsigned, _log)
        m, policy = load_version(storage, version, work_dir, pick_device(device), trust=trust)
        res = greedy_and_sampled(policy, problems, m.sampling.temperature, samples,
                                 m.sampling.max_new_tokens)
        _log(f"v{m.version}: greedy {res['eval/accuracy_greedy']:.1%}, sampled "
             f"(T={m.sampling.temperature}) {res['eval/accuracy_sampled']:.1%} on {len(problems)} prompts")


@app.command()
def status(
    bucket: Bucket,
    endpoint_url: Endpoint = None,
    json_: Annotated[bool, typer.Option("--json", help="Print one JSON document (for scripts) instead of tables.")] = False,
    watch: Annotated[bool, typer.Option("--watch", help="Redraw in place every --interval seconds until Ctrl-C.")] = False,
    interval: Annotated[float, typer.Option(min=0.5, help="Seconds between redraws with --watch.")] = 5.0,
):
    """The fleet and the trainer at a glance: each volunteer's state (producing, idle,
    stale-version, offline) from its heartbeat, its rate, totals and acceptance by the
    trainer; the trainer's version, step, reward and held-out accuracy trend.

    Example: vrl status --bucket s3://my-bucket/run1 --watch
    """
    with _clean_errors():
        from volunteer_rl.observe.status import read_status, render
        from volunteer_rl.observe.status import watch as watch_status
        from volunteer_rl.storage.base import open_storage

        storage = open_storage(bucket, endpoint_url)
        if json_:
            import json

            print(json.dumps(read_status(storage), indent=1, sort_keys=True))
            return
        from rich.console import Console

        console = Console()
        if watch:
            watch_status(storage, interval, console)
        else:
            console.print(render(read_status(storage)))


@app.command()
def dashboard(bucket: Bucket, endpoint_url: Endpoint = None):
    """Write dashboard/index.html and its plots (held-out accuracy and reward against version
    and time, fleet throughput, staleness) into the bucket, from all of metrics/ and the
    fleet's heartbeats. Open dashboard/index.html of a folder bucket in a browser.

    Example: vrl dashboard --bucket ./bucket
    """
    with _clean_errors():
        from volunteer_rl.observe.dashboard import read_history, write_dashboard
        from volunteer_rl.storage.base import open_storage

        storage = open_storage(bucket, endpoint_url)
        keys = write_dashboard(storage, read_history(storage))
        _log(f"wrote {len(keys)} objects; open {storage.uri.rstrip('/')}/{keys[-1]}")


GC_REPORTED_FAILURES = 20  # `vrl gc` names this many objects it could not delete, then counts


@app.command()
def gc(
    bucket: Bucket,
    endpoint_url: Endpoint = None,
    keep_versions: Annotated[int, typer.Option(min=1, help="Keep the newest N versions (the staleness window is always kept).")] = 10,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show what would be removed; delete nothing.")] = False,
    trust_key: Annotated[Optional[str], typer.Option("--trust-key", envvar="VRL_TRUST_KEY", help="The trainer's public key (ed25519:... or a file); without it any validly signed manifest is accepted.")] = None,
    allow_unsigned: Annotated[bool, typer.Option("--allow-unsigned", help="Accept an unsigned manifest (an older trainer).")] = False,
):
    """Retention: delete checkpoints and rollout shards of versions older than the newest
    --keep-versions and the staleness window. The manifest's version, manifest.json,
    manifests/, metrics/ and datasets/ are never deleted. Run it with the trainer's
    credentials; it is safe while the trainer runs.

    Example: vrl gc --bucket s3://my-bucket/run1 --keep-versions 20 --dry-run
    """
    with _clean_errors():
        from volunteer_rl.protocol.signing import Trust, resolve_trust_key
        from volunteer_rl.storage.base import open_storage
        from volunteer_rl.trainer.retention import collect, summary_lines

        # Without --trust-key any validly signed manifest will do: gc runs with the
        # trainer's credentials, and whoever can replace the manifest can delete anyway.
        trust = Trust(resolve_trust_key(trust_key), allow_unsigned)
        plan, outcome = collect(open_storage(bucket, endpoint_url), keep_versions, dry_run,
                                trust=trust)
    for line in summary_lines(plan, outcome, dry_run):
        _log(line)
    for _, message in outcome.failed[:GC_REPORTED_FAILURES]:
        print(f"error: could not delete {message}", file=sys.stderr)
    if outcome.failed:
        more = len(outcome.failed) - GC_REPORTED_FAILURES
        print(f"error: {len(outcome.failed)} objects could not be deleted"
              + (f" ({more} not shown)" if more > 0 else "") + "; run vrl gc again to retry",
              file=sys.stderr)
        raise typer.Exit(1)


@app.command("public-key")
def public_key(
    signing_key: SigningKey = None,
    work_dir: Annotated[str, typer.Option(help="The trainer's --work-dir.")] = ".vrl/trainer",
):
    """Print the trainer's manifest signing key (public half), creating the key pair if there
    is none yet, so it can be handed to volunteers before the trainer starts.

    Example: vrl public-key --work-dir .vrl/trainer
    """
    with _clean_errors():
        from volunteer_rl.protocol.signing import key_path, load_or_create_key, public_key_text

        key, _ = load_or_create_key(key_path(signing_key, work_dir))
        print(public_key_text(key))


@app.command()
def demo(
    bucket: Annotated[Optional[str], typer.Option("--bucket", "-b", help="Local folder for the bucket (default: a new folder under runs/).")] = None,
    volunteers: Annotated[int, typer.Option(help="Volunteer processes to start.")] = 2,
    rl_seconds: Annotated[float, typer.Option(help="Seconds of RL after v0 is published.")] = 300.0,
    warm_start_steps: Annotated[int, typer.Option(help="Supervised steps before v0.")] = 900,
    algo: Annotated[str, typer.Option(help="reinforce or grpo.")] = "grpo",
    lr: Annotated[float, typer.Option(help="RL learning rate.")] = 3e-4,
):
    """The embedded default: a trainer and volunteers as separate processes on a local folder
    bucket; ends with held-out accuracy of v0 and of the last version.

    Example: vrl demo --volunteers 2 --rl-seconds 300
    """
    with _clean_errors():
        from volunteer_rl.demo import DemoSettings, run_demo

        run_demo(DemoSettings(bucket=bucket, volunteers=volunteers, rl_seconds=rl_seconds,
                              warm_start_steps=warm_start_steps, algo=algo, lr=lr))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
