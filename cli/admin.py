"""`vrl gc` (retention by hand) and `vrl public-key`: the operator's chores."""

from __future__ import annotations

import sys
from typing import Optional

import typer

from volunteer_rl.config import TrainerConfig, VolunteerConfig
from volunteer_rl.errors import ConfigError
from volunteer_rl_cli.config_file import config_option
from volunteer_rl_cli.options import (
    ALLOW_UNSIGNED,
    BUCKET,
    ENDPOINT_URL,
    KEEP_VERSIONS,
    SIGNING_KEY,
    TRAINER_WORK_DIR,
    log,
    option,
)

app = typer.Typer()

GC_REPORTED_FAILURES = 20  # `vrl gc` names this many objects it could not delete, then counts

# gc runs with the trainer's credentials, and whoever can replace the manifest can delete
# anyway: without --trust-key any validly signed manifest will do, and no key is pinned.
GC_TRUST_KEY = option(
    VolunteerConfig, "trust_key",
    help="The trainer's public key (ed25519:... or a file); without it any validly signed "
         "manifest is accepted.")


@app.command()
def gc(
    config: Optional[str] = config_option(TrainerConfig, VolunteerConfig),
    bucket: str = BUCKET,
    endpoint_url: Optional[str] = ENDPOINT_URL,
    keep_versions: int = KEEP_VERSIONS,
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Show what would be removed; delete nothing."),
    trust_key: Optional[str] = GC_TRUST_KEY,
    allow_unsigned: bool = ALLOW_UNSIGNED,
):
    """Retention: delete old versions' checkpoints and rollout shards.

    It deletes those of the versions older than both the newest --keep-versions and the
    staleness window. The manifest's version, manifest.json, manifests/, metrics/ and
    datasets/ are never deleted. Run it with the trainer's credentials; it is safe while the
    trainer runs.

    Example: vrl gc --bucket s3://my-bucket/run1 --keep-versions 20 --dry-run
    """
    from volunteer_rl.protocol.printable import printable
    from volunteer_rl.protocol.signing import Trust, resolve_trust_key
    from volunteer_rl.storage import open_storage
    from volunteer_rl.trainer.retention import collect
    from volunteer_rl.trainer.retention_report import summary_lines

    trust = Trust(resolve_trust_key(trust_key), allow_unsigned)
    storage = open_storage(bucket, endpoint_url, create=False)
    plan, outcome = collect(storage, keep_versions, dry_run, trust=trust)
    for line in summary_lines(plan, outcome, dry_run):
        log(line)
    for _, message in outcome.failed[:GC_REPORTED_FAILURES]:
        print(f"error: could not delete {printable(message)}", file=sys.stderr)  # keys: volunteers
    if outcome.failed:
        more = len(outcome.failed) - GC_REPORTED_FAILURES
        print(f"error: {len(outcome.failed)} objects could not be deleted"
              + (f" ({more} not shown)" if more > 0 else "") + "; run vrl gc again to retry",
              file=sys.stderr)
        raise typer.Exit(1)


@app.command("public-key")
def public_key(config: Optional[str] = config_option(TrainerConfig),
               bucket: Optional[str] = typer.Option(
                   None, "--bucket", "-b",
                   help="The run whose trainer key to print: the key in the trainer's default "
                        "--work-dir for this bucket."),
               endpoint_url: Optional[str] = ENDPOINT_URL,
               signing_key: Optional[str] = SIGNING_KEY,
               work_dir: Optional[str] = TRAINER_WORK_DIR):
    """Print the trainer's public key, for volunteers' --trust-key.

    The public half of the key that signs every manifest, as `ed25519:...`; the key pair is
    created if there is none yet, so it can be handed to volunteers before the trainer starts.
    With --bucket it is the key `vrl trainer --bucket` uses by default (one per bucket), and
    none is made for a bucket whose run another key signs.

    Example: vrl public-key --bucket s3://my-bucket/run1
    """
    from volunteer_rl.config import default_work_dir
    from volunteer_rl.protocol.signing import key_path, load_or_create_key, public_key_text

    if not (bucket or work_dir or signing_key):
        raise ConfigError("vrl public-key: give --bucket (the trainer keeps a key per bucket), "
                          "--work-dir or --signing-key")
    path = key_path(signing_key, work_dir or default_work_dir("trainer", bucket or ""))
    if bucket and not path.exists():
        from volunteer_rl.storage import open_storage
        from volunteer_rl.storage.uri import local_folder
        from volunteer_rl.trainer.preflight import refuse_new_key

        folder = local_folder(bucket)
        if folder is None or folder.expanduser().is_dir():  # a folder not made yet has no run
            refuse_new_key(open_storage(bucket, endpoint_url, create=False), path,
                           allow_unsigned=True)
    key, _ = load_or_create_key(path)
    print(public_key_text(key))
