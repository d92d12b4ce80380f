"""The real RL loop with sparse checkpoint patches, for each architecture family a user may
bring with `vrl trainer --model PATH`: Llama, Qwen3 (saved with a chat template), Gemma 3
(Gemma3TextConfig / Gemma3ForCausalLM) and GPT-2.

Each case saves a tiny random model of that family with `save_pretrained` (model and
tokenizer: an ordinary Hugging Face folder, no vrl.json), starts a real `vrl trainer` on it
and a real `vrl volunteer` on the same folder bucket, and lets them run VERSIONS versions.
What it proves, for every family:

1. the trainer learns from the volunteer's rollouts and exits 0 after VERSIONS versions;
2. every version from v1 on goes out as a patch (checkpoints/vN/weights.vrlpatch, no
   model.safetensors) that its manifest lists;
3. the volunteer follows by patches (`now on vN of RUN (1 patch, X MB)`) up to the last one;
4. every version's weights rebuild from the bucket bit for bit: the root of the rebuilt file's
   pieces equals the one the trainer computed from the bytes it serialized (manifest
   `files["model.safetensors"]`), both from the keyframe and patched forward from the
   version before;
5. every optimizer step trained on groups from the volunteer's shards, which are in the
   bucket under rollouts/vN/<its id>/, and the trainer's audits accepted them;
6. the prompt format is the folder's: with a chat template (qwen3) every checkpoint keeps the
   template (chat_template.jinja, also in the volunteer's copy) and says prompt_format
   "chat" (manifest and vrl.json), and prompts were chat-formatted: the trainer's audits,
   which replay every token under the trainer's own prompt, passed, and its evaluations
   find the model answering, which it does only when prompted in the format it learned in.

Set-up, not under test: a random model earns no reward, so every group would have zero
reward variance and the trainer would never step (trainer/ingest.py drops zero-variance
groups before a step; its own warm start only runs for `--model tiny`). Each model is
therefore warm-started in-process (trainer.warmstart.warm_start, a second or two) on a
16-row dataset of one-operator problems from the tokenizer's own corpus, which a tiny model
memorizes: greedy it answers them all, sampled at T=1 about a third of the time, so most
groups have reward variance.
"""
from __future__ import annotations

import copy
import csv
import json
import re

import pytest
import torch

from helpers.chain_checks import assert_rebuilds_bit_for_bit, published_manifests
from helpers.vrlproc import Proc, wait_for
from test_hostile_bucket import tiny_policy, tokenizer  # noqa: F401  (tokenizer: a fixture)
from volunteer_rl.model.policy import format_prompt, load_policy
from volunteer_rl.protocol import layout, metrics
from volunteer_rl.protocol.manifest import KEYFRAME_FILE, PATCH_FILE
from volunteer_rl.task.calculator_task import CalculatorTask
from volunteer_rl.task.dataset import load_csv
from volunteer_rl.task.calculator_generate import generate_problems
from volunteer_rl.trainer.warmstart import warm_start

VERSIONS = 8
GROUPS_PER_STEP = 2
VOLUNTEER = "follower"
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                 "<|assistant|>")
ARCHITECTURES = {"llama": False, "qwen3": True, "gemma3": False, "gpt2": False}
"""Family -> saved with a chat template."""

TRAINER_FLAGS = [
    # Patches on: bf16 weights. With fp32 every word changes at every step, so every version
    # would be a keyframe. At the default --lr (3e-4) and --patch-max-fraction (0.5) these
    # models' versions are patches from v1 on: 15-34 % of the weights file in the runs this
    # test was written on, as embedding rows of tokens no sample used get no gradient and
    # stay the same, and a warm-started weight's bf16 spacing is often wider than one step.
    "--weights-dtype", "bf16",
    # No keyframe on cadence within the run: every version from v1 on can be a patch.
    "--keyframe-every", "20",
    "--max-steps", str(VERSIONS),  # --publish-every is 1: a version per step; then exit 0
    # A version per step, never held: the volunteer's grant of 8 numbers (a block) takes 4
    # steps of 2 groups, and a publish waits while the version it would push out of the
    # window has numbers granted and not received; a window of 5 versions holds the grant.
    "--max-staleness", "4",
    "--groups-per-step", str(GROUPS_PER_STEP),  # a step as soon as one shard of groups is in
    # Small groups keep the volunteer fast; the answers ("26 + 398") take under 12 tokens.
    "-k", "4", "--max-new-tokens", "12",
    # No periodic evaluation (v0 and the last version are still evaluated, on the 16 rows
    # of --eval-dataset), no dashboard: neither is under test and both cost time.
    "--eval-every", "0", "--dashboard-every", "0",
    "--threads", "1", "--poll-seconds", "0.05",  # one core each; react to shards at once
]
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
"""Also for what --threads does not cover: the trainer's start (v0's evaluation) and the
volunteer's loading. Two processes with torch's default of one thread per core each, on 2
cores, spin against each other (and against anything else running)."""
VOLUNTEER_FLAGS = ["--id", VOLUNTEER, "--threads", "1", "--prompts-per-batch", "4",
                   "--shard-groups", "4", "--shard-seconds", "1", "--poll-seconds", "0.05"]


def write_dataset(path) -> None:
    """16 one-operator problems of the tokenizer's own corpus (generate_problems(200, seed=3),
    as the `tokenizer` fixture), so numbers and words are mostly one token each."""
    easy = [p for p in generate_problems(200, seed=3)
            if sum(p.expression.count(op) for op in "+-*/") == 1][:16]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["python_expression", "natural_language"])
        w.writerows([p.expression, p.prompt] for p in easy)


def save_model(arch: str, tok, chat: bool, dataset, folder) -> None:
    """A tiny random `arch` model, warm-started on `dataset` with the prompts the trainer
    will use, saved as an ordinary Hugging Face folder."""
    if chat:
        tok = copy.deepcopy(tok)  # the fixture's tokenizer is shared by the other cases
        tok.chat_template = CHAT_TEMPLATE
    policy = tiny_policy(arch, tok)
    policy.prompt_format = "chat" if chat else "plain"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # several threads on a busy 2-core machine ran it ~50x slower
    try:
        torch.manual_seed(0)
        problems = load_csv(dataset)
        warm_start(policy, [p.prompt for p in problems], [p.expression for p in problems], 150,
                   batch_size=16, lr=3e-3, log=lambda m: None,
                   instruction=CalculatorTask.instruction)  # what the trainer's prompts say
    finally:
        torch.set_num_threads(threads)
    policy.model.save_pretrained(folder)
    tok.save_pretrained(folder)


def run_loop(tmp_path, bucket, model, dataset, trainer_flags: list[str], versions: int,
             timeout: float = 120) -> tuple[Proc, Proc]:
    """A real `vrl trainer` on the model folder and a real `vrl volunteer`, one folder bucket,
    until the trainer exits 0 (its flags end it after `versions` versions) and the volunteer
    says it is on the last one; both processes, stopped, their logs still readable."""
    trainer = Proc(["trainer", "--bucket", str(bucket), "--model", str(model),
                    "--dataset", str(dataset), "--eval-dataset", str(dataset), *trainer_flags,
                    "--work-dir", str(tmp_path / "tw")],
                   tmp_path / "trainer.log", tmp_path, ONE_THREAD)
    vol = Proc(["volunteer", "--bucket", str(bucket), *VOLUNTEER_FLAGS,
                "--work-dir", str(tmp_path / "vw")], tmp_path / "vol.log", tmp_path, ONE_THREAD)
    try:
        assert trainer.wait(timeout) == 0, trainer.text()[-3000:]
        wait_for(lambda: f"now on v{versions} " in vol.text(), 120, f"the volunteer on v{versions}")
        assert vol.terminate() == 0, vol.text()[-3000:]
    finally:
        for p in (trainer, vol):
            p.kill()
    return trainer, vol


LIVE_IN_THE_SUITE = ("qwen3", "gpt2")
"""The families whose live loop runs in the default suite: one replayed as prefix trees and
one with padded rows (model.replay_forward.TREE_MODEL_TYPES), chat and plain prompts. Llama's
and Gemma 3's loops (about 40 s each) run with `-m slow`; every family is still built, checked
and loaded in the suite (test_hostile_bucket)."""


@pytest.mark.parametrize("arch", [a if a in LIVE_IN_THE_SUITE else pytest.param(a, marks=pytest.mark.slow)
                                  for a in ARCHITECTURES])
def test_the_loop_runs_with_patches_for_each_architecture(arch, tokenizer, tmp_path):  # noqa: F811
    chat = ARCHITECTURES[arch]
    dataset, model, bucket = tmp_path / "train.csv", tmp_path / "model", tmp_path / "bucket"
    write_dataset(dataset)
    save_model(arch, tokenizer, chat, dataset, model)
    bucket.mkdir()  # only the trainer makes a folder bucket; a volunteer may start first
    assert not (model / "vrl.json").exists()  # no hint of ours: the format comes from the folder

    trainer, vol = run_loop(tmp_path, bucket, model, dataset, TRAINER_FLAGS, VERSIONS)
    storage, ms = published_manifests(bucket, VERSIONS)
    assert json.loads((bucket / layout.MANIFEST).read_text())["version"] == VERSIONS
    run_id = ms[0].run_id
    assert all(m.run_id == run_id for m in ms)

    # 2. Versions after v1 are patches: listed by their manifest, in the bucket as a patch
    # file, with no whole weights file.
    patched = []
    for m in ms:
        folder = bucket / m.checkpoint
        listed = any(p.version == m.version for p in m.weights.patches)
        assert listed == (folder / PATCH_FILE).exists(), m.version
        assert (folder / KEYFRAME_FILE).exists() == (m.weights.keyframe.version == m.version)
        if listed and not (folder / KEYFRAME_FILE).exists():
            patched.append(m.version)
    # Every one of them, in fact (see TRAINER_FLAGS); the task asks at least one after v1.
    assert patched == list(range(1, VERSIONS + 1)), [(m.version, m.weights) for m in ms]
    size = ms[-1].files[KEYFRAME_FILE].size
    assert all(p.size <= 0.5 * size for m in ms for p in m.weights.patches)

    # 3. The volunteer followed by patches, up to the last version.
    vol_log = vol.text()
    arrivals = re.findall(r"^now on v(\d+) of (\S+) \((.*)\)$", vol_log, re.M)
    assert arrivals and {r for _, r, _ in arrivals} == {run_id}, vol_log[-2000:]
    assert arrivals[0][2].startswith("keyframe v0, ")
    assert int(arrivals[-1][0]) == VERSIONS
    by_patch = [int(v) for v, _, how in arrivals[1:]
                if re.fullmatch(r"\d+ patch(es)?, [\d.]+ MB", how)]
    assert by_patch, arrivals
    assert "warning" not in vol_log and "Traceback" not in vol_log

    # 4. Every version rebuilds bit for bit: from its keyframe, and patched forward from the
    # version before, as the volunteer did.
    assert_rebuilds_bit_for_bit(storage, ms)

    # 5. Every step trained on the volunteer's shards, which are in the bucket, and its
    # shards passed the trainer's audit.
    records = [json.loads(line) for v in range(VERSIONS + 1)
               for line in storage.read(layout.metrics_key(v)).decode().splitlines()]
    steps = [r for r in records if r[metrics.KIND] == metrics.STEP_LINE]
    assert [r[metrics.STEP] for r in steps] == list(range(1, VERSIONS + 1))
    trained = sum(n for r in steps for n in r[metrics.SOURCES].values())
    assert trained == VERSIONS * GROUPS_PER_STEP
    for key in {key for r in steps for key in r[metrics.SOURCES]}:
        assert layout.parse_shard_key(key)[1] == VOLUNTEER and storage.exists(key), key
    audited = sum(r["audit/shards"] for r in steps)
    rejected = [r["ingest/rejected"] for r in steps if r["ingest/rejected"]]
    assert audited >= 1 and not rejected, (audited, rejected)
    trainer_log = trainer.text()
    assert len(re.findall(r"^step \d+ v\d+ reward ", trainer_log, re.M)) == VERSIONS
    assert "warning" not in trainer_log

    # 6. The prompt format is the folder's: chat from a chat template, else plain; a chat
    # template is published with every version and reaches the volunteer.
    fmt = "chat" if chat else "plain"
    assert {m.prompt_format for m in ms} == {fmt}
    for m in ms:  # what the trainer wrote into each checkpoint for readers (save_policy)
        assert json.loads((bucket / m.checkpoint / "vrl.json").read_text()) == {
            "prompt_format": fmt}
    # The model learned its answers under that format only (greedy, the qwen3 one answers
    # all 16 prompts in chat form and none in plain form), so the trainer's evaluations of
    # v0 and the last version, which prompt the way volunteers do, find it answering.
    evals = [r for r in records if r[metrics.KIND] == metrics.EVAL_LINE]
    assert [r[metrics.VERSION] for r in evals] == [0, VERSIONS]
    assert all(r[metrics.ACCURACY_GREEDY] >= 0.5 for r in evals), evals
    fetched = tmp_path / "vw" / VOLUNTEER / "checkpoint"
    if chat:
        for m in ms:
            assert "chat_template.jinja" in m.files
            assert (bucket / m.checkpoint / "chat_template.jinja").read_text() == CHAT_TEMPLATE
        assert (fetched / "chat_template.jinja").read_text() == CHAT_TEMPLATE
        loaded = load_policy(fetched)
        assert loaded.prompt_format == "chat"
        assert format_prompt(loaded, "add 1 and 2", CalculatorTask.instruction).startswith("<|user|>Write the arithmetic")
    else:
        assert not (fetched / "chat_template.jinja").exists()
