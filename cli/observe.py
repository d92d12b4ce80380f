"""`vrl status`, `vrl dashboard`, `vrl eval` and `vrl export`: looking at a run from its
bucket."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from volunteer_rl.config import TrainerConfig
from volunteer_rl_cli.config_file import config_option
from volunteer_rl_cli.options import (
    ALLOW_UNSIGNED,
    BUCKET,
    DEVICE,
    ENDPOINT_URL,
    TRUST_KEY,
    log,
    option,
)

app = typer.Typer()


@app.command("eval")
def eval_(
    config: Optional[str] = config_option(TrainerConfig),
    bucket: str = BUCKET,
    endpoint_url: Optional[str] = ENDPOINT_URL,
    version: Optional[int] = typer.Option(
        None, min=0, help="Published version (default: the current one)."),
    dataset: Optional[str] = option(TrainerConfig, "eval_dataset", flags=("--dataset",)),
    samples: int = option(TrainerConfig, "eval_samples", flags=("--samples",)),
    device: str = DEVICE,
    work_dir: Optional[str] = typer.Option(
        None, help="Local cache of checkpoints, pinned keys and the newest manifest seen "
                   "(default: eval/<bucket>-<hash> in the per-user state folder, as the "
                   "volunteer's --work-dir)."),
    trust_key: Optional[str] = TRUST_KEY,
    allow_unsigned: bool = ALLOW_UNSIGNED,
):
    """Held-out accuracy of a published version.

    Greedy and at the version's sampling temperature, on the held-out rows of the task its
    manifest names (that task must be installed here).

    Example: vrl eval --bucket ./bucket --version 0
    """
    from volunteer_rl.config import default_work_dir
    from volunteer_rl.model.devices import pick_device
    from volunteer_rl.protocol.signing import reader_trust
    from volunteer_rl.storage import open_storage
    from volunteer_rl.trainer.evaluate import greedy_and_sampled, held_out, load_version

    storage = open_storage(bucket, endpoint_url, create=False)
    work_dir = work_dir or str(default_work_dir("eval", bucket))
    trust = reader_trust(storage.uri, endpoint_url, work_dir, trust_key, allow_unsigned, log)
    m, policy = load_version(storage, version, work_dir, pick_device(device), trust=trust)
    task, problems = held_out(m, dataset)
    log(f"evaluating v{m.version} of {m.run_id} on {len(problems)} {task.name} prompts")
    res = greedy_and_sampled(policy, task, problems, m.sampling.temperature, samples,
                             m.sampling.max_new_tokens, log=log, label=f"eval v{m.version}")
    log(f"v{m.version}: greedy {res['eval/accuracy_greedy']:.1%}, sampled "
        f"(T={m.sampling.temperature}) {res['eval/accuracy_sampled']:.1%} "
        f"on {len(problems)} prompts")


@app.command()
def export(
    dest: Path = typer.Argument(..., help="Folder to write the version into (new or empty)."),
    config: Optional[str] = config_option(TrainerConfig),
    bucket: str = BUCKET,
    endpoint_url: Optional[str] = ENDPOINT_URL,
    version: Optional[int] = typer.Option(
        None, min=0, help="Published version (default: the current one)."),
    adapter: bool = typer.Option(
        False, "--adapter", help="A LoRA version as PEFT's adapter folder, its base in "
                                 "DEST/base, instead of whole weights with the adapter merged."),
    work_dir: Optional[str] = typer.Option(
        None, help="Local cache of checkpoints, pinned keys and the newest manifest seen "
                   "(default: eval/<bucket>-<hash> in the per-user state folder, as vrl eval's)."),
    trust_key: Optional[str] = TRUST_KEY,
    allow_unsigned: bool = ALLOW_UNSIGNED,
):
    """Write a published version as a Hugging Face folder.

    Whole (the default): its weights as volunteers run them, in fp32, for
    transformers.AutoModelForCausalLM.from_pretrained(DEST). With --adapter, a LoRA version
    as PEFT's adapter folder (adapter_model.safetensors and adapter_config.json) and its base
    model in DEST/base, for peft.PeftModel.from_pretrained(base_model, DEST). Every file is
    checked as a volunteer checks it.

    \b
    Examples:
      vrl export --bucket ./bucket ./v12
      vrl export --bucket s3://bucket/run1 --version 40 --adapter ./v40-adapter
    """
    from volunteer_rl.config import default_work_dir
    from volunteer_rl.protocol.signing import reader_trust
    from volunteer_rl.storage import open_storage
    from volunteer_rl.trainer.export import export_version

    storage = open_storage(bucket, endpoint_url, create=False)
    work_dir = work_dir or str(default_work_dir("eval", bucket))
    trust = reader_trust(storage.uri, endpoint_url, work_dir, trust_key, allow_unsigned, log)
    m = export_version(storage, version, dest, Path(work_dir), trust=trust, adapter=adapter)
    what = "its adapter for PEFT, the base in base/" if adapter else "whole, in fp32"
    log(f"exported v{m.version} of {m.run_id} to {dest} ({what})")


@app.command()
def status(
    config: Optional[str] = config_option(TrainerConfig),
    bucket: str = BUCKET,
    endpoint_url: Optional[str] = ENDPOINT_URL,
    json_: bool = typer.Option(
        False, "--json", help="Print one JSON document (for scripts) instead of tables."),
    watch: bool = typer.Option(
        False, "--watch", help="Redraw in place every --interval seconds until Ctrl-C."),
    interval: float = typer.Option(5.0, min=0.5, help="Seconds between redraws with --watch."),
):
    """The fleet and the trainer at a glance.

    Each volunteer's state (producing, idle, stale-version, offline) from its heartbeat, its
    rate, totals and acceptance by the trainer; the trainer's version, step, reward and
    held-out accuracy trend.

    Example: vrl status --bucket s3://my-bucket/run1 --watch
    """
    from volunteer_rl.observe.status import read_status, render
    from volunteer_rl.observe.status import watch as watch_status
    from volunteer_rl.storage import open_storage

    storage = open_storage(bucket, endpoint_url, create=False)
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
def dashboard(config: Optional[str] = config_option(TrainerConfig), bucket: str = BUCKET,
              endpoint_url: Optional[str] = ENDPOINT_URL):
    """Write a page and plots for people into the bucket's dashboard/.

    dashboard/index.html and its plots (held-out accuracy and reward against version and
    time, fleet throughput, staleness), from all of metrics/ and the fleet's heartbeats. Open
    dashboard/index.html of a folder bucket in a browser.

    Example: vrl dashboard --bucket ./bucket
    """
    from volunteer_rl.observe.dashboard import read_history, write_dashboard
    from volunteer_rl.storage import open_storage

    storage = open_storage(bucket, endpoint_url, create=False)
    keys = write_dashboard(storage, read_history(storage))
    log(f"wrote {len(keys)} objects; open {storage.uri.rstrip('/')}/{keys[-1]}")
