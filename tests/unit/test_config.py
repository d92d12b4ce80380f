"""The settings dataclasses: each rule refuses with a ConfigError naming its flag, and the
CLI's flags carry the fields' defaults and docstrings, not copies of them."""
from __future__ import annotations

import math
from dataclasses import MISSING, fields

import pytest
import typer

from volunteer_rl.config import (LORA_LR_FACTOR, LR, TrainerConfig, VolunteerConfig, check, flag,
                                 range_text)
from volunteer_rl.demo import DemoSettings
from volunteer_rl.errors import ConfigError
from volunteer_rl.protocol.manifest import MAX_POOL
from volunteer_rl_cli.main import app
from volunteer_rl_cli.options import field_doc, first_sentence

T, V, D = TrainerConfig, VolunteerConfig, DemoSettings
REQUIRED = {T: {"bucket": "b"}, V: {"bucket": "b"}, D: {}}

# (settings class, field, a value the rule refuses, the one-line message, an edge it accepts)
RULES = [
    (T, "algo", "ppo", "--algo: use reinforce or grpo, not 'ppo'", "reinforce"),
    (T, "weights_dtype", "fp16", "--weights-dtype: use fp32 or bf16, not 'fp16'", "bf16"),
    (T, "lr", 0.0, "--lr: must be more than 0, not 0.0", 1e-9),
    (T, "k", 0, "--k: must be at least 1, not 0", 1),
    (T, "temperature", -1.0, "--temperature: must be more than 0, not -1.0", 0.01),
    (T, "max_new_tokens", 0, "--max-new-tokens: must be at least 1, not 0", 1),
    (T, "max_staleness", -1, "--max-staleness: must be at least 0, not -1", 0),
    (T, "groups_per_step", 0, "--groups-per-step: must be at least 1, not 0", 1),
    (T, "publish_every", 0, "--publish-every: must be at least 1, not 0", 1),
    (T, "publish_min_seconds", -1.0, "--publish-min-seconds: must be at least 0, not -1.0", 0.0),
    (T, "keyframe_every", 0, "--keyframe-every: must be at least 1, not 0", 1),
    (T, "keyframe_every", 257, "--keyframe-every: must be at most 256, not 257", 256),
    (T, "patch_max_fraction", 0.0, "--patch-max-fraction: must be more than 0, not 0.0", 1e-6),
    (T, "patch_max_fraction", 1.5, "--patch-max-fraction: must be at most 1, not 1.5", 1.0),
    (T, "keep_versions", 0, "--keep-versions: must be at least 1, not 0", 1),
    (T, "gc_every", -1, "--gc-every: must be at least 0, not -1", 0),
    (T, "eval_samples", 0, "--eval-samples: must be at least 1, not 0", 1),
    (T, "micro_batch", 0, "--micro-batch: must be at least 1, not 0", 1),
    (T, "dashboard_every", -1.0, "--dashboard-every: must be at least 0, not -1.0", 0.0),
    (T, "audit_tolerance", -0.1, "--audit-tolerance: must be at least 0, not -0.1", 0.0),
    (T, "replay_tolerance", -1e-9, "--replay-tolerance: must be at least 0, not -1e-09", 0.0),
    (T, "audit_share", 0.0, "--audit-share: must be more than 0, not 0.0", 1e-6),
    (T, "audit_share", 1.5, "--audit-share: must be at most 1, not 1.5", 1.0),
    (T, "audit_full_groups", 0, "--audit-full-groups: must be at least 1, not 0", 1),
    (T, "audit_floor", 0.0, "--audit-floor: must be more than 0, not 0.0", 1e-6),
    (T, "audit_floor", 2.0, "--audit-floor: must be at most 1, not 2.0", 1.0),
    (T, "audit_cover_floor", -0.5, "--audit-cover-floor: must be at least 0, not -0.5", 0.0),
    (T, "audit_cover_floor", 1.5, "--audit-cover-floor: must be at most 1, not 1.5", 1.0),
    (T, "lora_rank", -1, "--lora-rank: must be at least 0, not -1", 0),
    (T, "lora_rank", 1025, "--lora-rank: must be at most 1024, not 1025", 1024),
    (T, "lora_alpha", 0.0, "--lora-alpha: must be more than 0, not 0.0", 1e-6),
    (T, "prompt_pool", 0, "--prompt-pool: must be at least 1, not 0", 1),
    (T, "prompt_pool", 4097, "--prompt-pool: must be at most 4096, not 4097", MAX_POOL),
    (T, "quota_headroom", -0.5, "--quota-headroom: must be at least 0, not -0.5", 0.0),
    (T, "quota_headroom", 101.0, "--quota-headroom: must be at most 100, not 101.0", 100.0),
    (V, "prompts_per_batch", -1, "--prompts-per-batch: must be at least 0, not -1", 0),
    (V, "shard_groups", 0, "--shard-groups: must be at least 1, not 0", 1),
    (V, "heartbeat_seconds", -0.5, "--heartbeat-seconds: must be at least 0, not -0.5", 0.0),
    (V, "nice", -1, "--nice: must be at least 0, not -1", 0),
    (V, "cpu_share", 0.0, "--cpu-share: must be more than 0, not 0.0", 0.01),
    (V, "cpu_share", 1.5, "--cpu-share: must be at most 1, not 1.5", 1.0),
    (V, "pause_when_busy", -0.1, "--pause-when-busy: must be at least 0, not -0.1", 0.0),
    (V, "pause_when_busy", 1.1, "--pause-when-busy: must be at most 1, not 1.1", 1.0),
    (V, "nice", 20, "--nice: must be at most 19, not 20", 19),
    # issue 27: every number has a range
    (T, "eval_every", -1, "--eval-every: must be at least 0, not -1", 0),
    (T, "eval_prompts", 0, "--eval-prompts: must be at least 1, not 0", 1),
    (T, "warm_start_steps", -1, "--warm-start-steps: must be at least 0, not -1", 0),
    (T, "warm_start_max_passes", -1.0, "--warm-start-max-passes: must be at least 0, not -1.0",
     0.0),
    (T, "warm_start_threads", -1, "--warm-start-threads: must be at least 0, not -1", 0),
    (T, "seed", -1, "--seed: must be at least 0, not -1", 0),
    (T, "max_steps", -5, "--max-steps: must be at least 0, not -5", 0),
    (T, "max_seconds", -1.0, "--max-seconds: must be at least 0, not -1.0", 0.0),
    (T, "poll_seconds", 0.0, "--poll-seconds: must be more than 0, not 0.0", 1e-3),
    (T, "threads", -3, "--threads: must be at least 0, not -3", 0),
    (T, "rank_timeout", 0.0, "--rank-timeout: must be more than 0, not 0.0", 1e-3),
    (T, "shard_reward_seconds", 0.0, "--shard-reward-seconds: must be more than 0, not 0.0", 1e-3),
    (T, "poll_reward_seconds", -1.0, "--poll-reward-seconds: must be more than 0, not -1.0", 1e-3),
    (T, "reward_share", 0.0, "--reward-share: must be more than 0, not 0.0", 1e-3),
    (T, "reward_share", 1.5, "--reward-share: must be at most 1, not 1.5", 1.0),
    (T, "deny_after", -1, "--deny-after: must be at least 0, not -1", 0),
    (T, "deny_rate", 5.0, "--deny-rate: must be at most 1, not 5.0", 1.0),
    (T, "deny_rate", -0.5, "--deny-rate: must be at least 0, not -0.5", 0.0),
    (T, "missing_bound", 1.5, "--missing-bound: must be at most 1, not 1.5", 1.0),
    (T, "missing_bound", -0.1, "--missing-bound: must be at least 0, not -0.1", 0.0),
    (V, "shard_seconds", -1.0, "--shard-seconds: must be at least 0, not -1.0", 0.0),
    (V, "poll_seconds", -1.0, "--poll-seconds: must be more than 0, not -1.0", 1e-3),
    (V, "max_groups_per_version", -1, "--max-groups-per-version: must be at least 0, not -1", 0),
    (V, "cap_patience_seconds", -1.0, "--cap-patience-seconds: must be at least 0, not -1.0", 0.0),
    (V, "manifest_grace_seconds", -1.0, "--manifest-grace-seconds: must be at least 0, not -1.0",
     0.0),
    (V, "max_seconds", -1.0, "--max-seconds: must be at least 0, not -1.0", 0.0),
    (V, "threads", -1, "--threads: must be at least 0, not -1", 0),
    # issue 39: log levels and report_to
    (T, "log_level", "loud", "--log-level: use debug or info or warning or error, not 'loud'",
     "error"),
    (V, "log_level", "INFO", "--log-level: use debug or info or warning or error, not 'INFO'",
     "debug"),
    (T, "report_to", "tensorboard,mlflow", "--report-to: use none or a comma-separated list "
     "of tensorboard, wandb, not 'tensorboard,mlflow'", "tensorboard,wandb"),
    # issue 41: every trained group replayed, or the sampled audits alone
    (T, "verify", "all", "--verify: use every or sampled, not 'all'", "sampled"),
    # issue 43: bandwidth caps, bytes per second with a unit
    (V, "max_download_rate", "8Mb", "--max-download-rate: use bytes per second such as 500k, "
     "2M, 1.5MB or 10MiB, or 0 for no cap, not '8Mb': a lowercase b is bits, write B for bytes",
     "1"),
    (V, "max_upload_rate", "-1", "--max-upload-rate: use bytes per second such as 500k, 2M, "
     "1.5MB or 10MiB, or 0 for no cap, not '-1'", "0"),
    (D, "volunteers", 0, "--volunteers: must be at least 1, not 0", 1),
    (D, "rl_seconds", -5.0, "--rl-seconds: must be more than 0, not -5.0", 0.5),
    (D, "threads", -1, "--threads: must be at least 0, not -1", 0),
    (D, "warm_start_threads", -1, "--warm-start-threads: must be at least 0, not -1", 0),
    (D, "groups_per_version", -1, "--groups-per-version: must be at least 0, not -1", 0),
]


@pytest.mark.parametrize("cls,name,bad,message,edge", RULES,
                         ids=[f"{c.__name__}.{n}={b!r}" for c, n, b, _, _ in RULES])
def test_each_rule_refuses_in_one_line_naming_its_flag(cls, name, bad, message, edge):
    with pytest.raises(ConfigError) as e:
        cls(**REQUIRED[cls], **{name: bad})
    assert str(e.value) == message
    assert cls(**REQUIRED[cls], **{name: edge})  # the edge of the range is allowed
    with pytest.raises(ConfigError, match=f"^{message}$"):
        check(cls, name, bad)  # the same rule, for code that takes one setting on its own


def test_every_rule_is_tested():
    ruled = {(c, f.name) for c in (T, V, D) for f in fields(c) if f.metadata}
    assert ruled == {(c, n) for c, n, *_ in RULES}


def test_nan_is_refused_wherever_a_number_has_a_bound():
    with pytest.raises(ConfigError, match=r"^--lr: must be more than 0, not nan$"):
        T(bucket="b", lr=math.nan)
    with pytest.raises(ConfigError, match=r"^--heartbeat-seconds: must be at least 0, not nan$"):
        V(bucket="b", heartbeat_seconds=math.nan)


def test_defaults_pass_their_own_rules_and_flags_are_spelled_as_typed():
    assert T(bucket="") and V(bucket="") and DemoSettings()
    assert flag("volunteer_id") == "--id" and flag("max_new_tokens") == "--max-new-tokens"


def test_demo_takes_the_trainers_defaults_and_rules():
    d, t = DemoSettings(), T(bucket="b")
    assert (d.warm_start_steps, d.algo, d.lora_rank, d.groups_per_step) == \
        (t.warm_start_steps, t.algo, t.lora_rank, t.groups_per_step)
    # --lr's default depends on --lora-rank: the demo passes none, the trainer resolves it
    assert d.lr is None and t.lr == LR and T(bucket="b", lora_rank=8).lr == LR * LORA_LR_FACTOR
    with pytest.raises(ConfigError, match=r"^--algo: use reinforce or grpo, not 'ppo'$"):
        DemoSettings(algo="ppo")


def test_every_setting_has_a_docstring_whose_first_sentence_is_the_help():
    for cls in (T, V, DemoSettings):
        for f in fields(cls):
            help_ = first_sentence(field_doc(cls, f.name))
            assert help_.endswith((".", "...")) and "\n" not in help_, (cls, f.name, help_)
    assert first_sentence("One (0: off). Two.\n  Three.") == "One (0: off)."
    assert first_sentence("Upload once it holds this many groups...") == \
        "Upload once it holds this many groups..."


# --- the flags of `vrl trainer` and `vrl volunteer` are the dataclasses' fields --------------

NOT_FLAGS = {T: {"eval_prompts", "eval_samples"},
             V: {"cap_patience_seconds", "manifest_grace_seconds"}}
SHARED = {"bucket", "endpoint_url", "device"}  # one option on every command, from TrainerConfig


@pytest.mark.parametrize("command,cls", [("trainer", T), ("volunteer", V)])
def test_defaults_and_help_shown_in_help_are_the_dataclass_defaults(command, cls):
    click_command = typer.main.get_command(app).commands[command]
    # hidden: the volunteer's --seed; print_service: an action (print a unit, exit), no setting
    params = {p.name: p for p in click_command.params
              if p.name not in ("ctx", "config", "print_service") and not p.hidden}
    assert set(params) == {f.name for f in fields(cls)} - NOT_FLAGS[cls]
    for f in fields(cls):
        if f.name not in params:
            continue
        p = params[f.name]
        assert p.opts[0] == flag(f.name)
        assert p.required == (f.default is MISSING)
        if f.default is not MISSING:
            assert p.default == f.default and type(p.default) is type(f.default), f.name
        assert p.help == first_sentence(field_doc(T if f.name in SHARED else cls, f.name))
        # The setting's own rules check the flag, and its metavar shows them.
        assert p.callback.setting == (T if f.name in SHARED else cls, f.name)
        assert (range_text(cls, f.name) or "") in (p.metavar or ""), f.name
