"""Signed manifests with real `vrl` processes on a folder bucket.

The trainer publishes v0 and three more versions (trained on a hand-made shard whose groups
have reward variance, so no warm start is needed); a volunteer given the wrong key refuses to
run, one given the right key follows the manifest and uploads shards. ~40 s on 2 cores.
"""
from __future__ import annotations

import json
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from conftest import PICKED
from helpers.grants import Numbers, deal, wait_for_ask
from helpers.vrlproc import Proc, one_line_error, run_vrl, wait_for
from volunteer_rl.config import PACKAGE_DATA
from volunteer_rl.launch import vrl_command, vrl_env
from volunteer_rl.protocol import layout
from volunteer_rl.protocol.draws import pool_prompt
from volunteer_rl.protocol.manifest import read_manifest
from volunteer_rl.protocol.shards import Completion, Group, encode_shard
from volunteer_rl.protocol.signing import Ed25519PrivateKey, Trust, public_key_text
from volunteer_rl.storage import open_storage
from volunteer_rl.task.dataset import load_csv

STEPS = 3
K = 4
FOREIGN = public_key_text(Ed25519PrivateKey.generate())


def useful_shard(bucket: Path, groups: int) -> None:
    """Groups of v0 with two right and two wrong answers each, tokenized with v0's tokenizer."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(bucket / layout.checkpoint_key(0, "tokenizer.json")))
    eos = tok.token_to_id("<eos>")
    problems = load_csv(PACKAGE_DATA / "train.csv")
    wait_for(lambda: (bucket / layout.manifest_history_key(0)).exists(), 30, "v0's manifest copy")
    storage = open_storage(str(bucket))
    m = read_manifest(storage, 0, trust=Trust())  # the run this test started
    # the prompts numbers granted for v0 draw from its pool; numbers drawing a long
    # expression, or a prompt drawn before, are skipped: a second group of one prompt would
    # have the first's content (the completions are made from the prompt alone), which the
    # trainer takes only once, and the run would wait for good for its last step
    drawn = ((n, problems[pool_prompt(m.prompt_pool, m.run_id, 0, "handmade", n, x)])
             for n, x in Numbers(storage, "handmade", m.run_id).take(64, 0))
    chosen, prompts = [], set()
    for n, p in drawn:
        if len(chosen) == groups:
            break
        if len(p.expression) < 40 and p.id not in prompts:
            chosen.append((n, p))
            prompts.add(p.id)

    def completion(text: str, right: bool) -> Completion:
        ids = tok.encode(text, add_special_tokens=False).ids + [eos]
        return Completion(ids, [-1.0] * len(ids), text, float(right))
    out = [Group(p.id, 0, "handmade", seq,
                 [completion(p.expression if i % 2 == 0 else f"{p.expression} + 1", i % 2 == 0)
                  for i in range(K)])
           for seq, p in chosen]
    key = layout.shard_key(0, "handmade", "0000000000001-000000-00000000")
    storage.create(key, encode_shard(out))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("signed")
    bucket = root / "bucket"
    eval_csv = root / "eval.csv"
    eval_csv.write_text("".join((PACKAGE_DATA / "eval.csv").read_text().splitlines(True)[:9]))
    trainer = Proc(["trainer", "--bucket", str(bucket), "--warm-start-steps", "0", "--k", str(K),
                    "--groups-per-step", "1", "--max-steps", str(STEPS), "--eval-every", "0",
                    "--eval-dataset", str(eval_csv), "--threads", "1", "--poll-seconds", "0.1",
                    "--audit-tolerance", "0",  # the handmade shards carry made-up logprobs
                    *PICKED,  # numbers drawing long expressions are left out
                    "--work-dir", str(root / "tw")], root / "trainer.log", root)
    # (Every wait below is a hang guard, sized for a busy machine.)
    # Volunteers start with the trainer (their imports overlap its set-up) and wait for v0.
    # The right key is only known once the trainer made it: that volunteer reads it from the
    # trainer's .pub file, as an operator would copy it.
    pub_file = root / "tw" / "signing-key.pem.pub"
    wait_for(pub_file.exists, 180, "the trainer's key")
    volunteer = ["volunteer", "--bucket", str(bucket), "--threads", "1", "--poll-seconds", "0.2",
                 "--prompts-per-batch", "4", "--shard-groups", "4", "--work-dir", str(root / "vw")]
    right = Proc([*volunteer, "--id", "trusting", "--trust-key", str(pub_file)],
                 root / "right.log", root)
    wrong = subprocess.Popen(  # stdout and stderr apart: the refusal must be one stderr line
        vrl_command(*volunteer, "--id", "foreign", "--trust-key", FOREIGN, "--max-seconds", "60"),
        cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=vrl_env())
    try:
        wait_for(lambda: (bucket / layout.MANIFEST).exists(), 240, "v0")
        useful_shard(bucket, STEPS)
        wrong_out, wrong_err = wrong.communicate(timeout=90)
        assert trainer.wait(300) == 0, trainer.text()[-3000:]
        # The trainer has exited: the grant a live one would give for its last version, once
        # the volunteer asked (so it read its grants and knows its place: it takes this one)
        wait_for_ask(bucket, "trusting")
        deal(bucket, root / "tw" / "signing-key.pem", read_manifest(open_storage(str(bucket)),
             trust=Trust()).run_id, "trusting", STEPS, None, first_block=64)
        wait_for(lambda: f"now on v{STEPS} " in right.text() and "uploaded" in right.text(), 240,
                 "the trusting volunteer to upload with the last version")
        right_code = right.terminate()
    finally:
        for p in (trainer, right):
            p.kill()
        if wrong.poll() is None:
            wrong.kill()
            wrong.wait()
    return {"root": root, "bucket": bucket, "key": pub_file.read_text().strip(),
            "trainer": trainer.text(), "right": right.text(), "right_code": right_code,
            "wrong": subprocess.CompletedProcess(wrong.args, wrong.returncode, wrong_out, wrong_err)}


def shards_of(bucket: Path, volunteer_id: str) -> list[Path]:
    return sorted((bucket / layout.ROLLOUTS).glob(f"v*/{volunteer_id}/*{layout.SHARD_SUFFIX}"))


def test_a_volunteer_given_the_wrong_key_refuses_to_run(run):
    err = one_line_error(run["wrong"])
    assert err == (f"error: manifest.json: signed by {run['key']}, not by the trusted key "
                   f"{FOREIGN} (--trust-key)")
    assert shards_of(run["bucket"], "foreign") == []
    assert "now on" not in run["wrong"].stdout and "uploaded" not in run["wrong"].stdout


def test_a_volunteer_given_the_right_key_runs(run):
    assert f"manifests must be signed by {run['key']} (--trust-key)" in run["right"]
    assert run["right_code"] == 0 and "warning" not in run["right"]
    assert len(shards_of(run["bucket"], "trusting")) >= 1


def test_every_version_is_signed_by_the_key_the_trainer_printed(run):
    assert f"public key {run['key']}" in run["trainer"]
    storage, trust = open_storage(str(run["bucket"])), Trust(run["key"])
    assert [read_manifest(storage, v, trust=trust).version for v in range(STEPS + 1)] == [0, 1, 2, 3]
    current = (run["bucket"] / layout.MANIFEST).read_bytes()
    assert current == (run["bucket"] / layout.manifest_history_key(STEPS)).read_bytes()
    assert json.loads(current)["signature"]["public_key"] == run["key"]


def test_the_private_key_stays_on_the_trainer_host(run):
    key_file = run["root"] / "tw" / "signing-key.pem"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    secret = b"".join(key_file.read_bytes().splitlines()[1:-1])  # the base64 body of the PEM
    files = [p for p in run["bucket"].rglob("*") if p.is_file()]
    assert len(files) > 10
    for p in files:
        data = p.read_bytes()
        assert not p.name.endswith(".pem") and b"PRIVATE KEY" not in data and secret not in data, p


def test_a_trainer_with_another_key_does_not_resume_the_run(run):
    bucket = run["root"] / "resume-copy"
    shutil.copytree(run["bucket"], bucket)
    work = run["root"] / "tw-other"
    err = one_line_error(run_vrl(["trainer", "--bucket", str(bucket), "--max-seconds", "1",
                                  "--work-dir", str(work)], cwd=run["root"]))
    # No key in that work dir: none is made for a bucket another key signs
    # (tests/integration/test_failed_starts.py has the whole line, and a key that differs).
    assert err.startswith(f"error: manifest.json of {bucket} is signed by {run['key']}, and "
                          f"there is no signing key at {work / 'signing-key.pem'}; ")
    assert not work.exists()
    assert sorted(p.name for p in (bucket / layout.MANIFESTS).iterdir()) == \
        sorted(p.name for p in (run["bucket"] / layout.MANIFESTS).iterdir())


def test_a_manifest_changed_in_the_bucket_is_refused_before_any_download(run):
    bucket = run["root"] / "tampered-copy"
    shutil.copytree(run["bucket"], bucket)
    path = bucket / layout.MANIFEST
    m = json.loads(path.read_text())
    path.write_text(path.read_text().replace(m["files"]["model.safetensors"]["root"], "0" * 64))
    work = run["root"] / "ew"
    err = one_line_error(run_vrl(["eval", "--bucket", str(bucket), "--trust-key", run["key"],
                                  "--work-dir", str(work)], cwd=run["root"]))
    assert err.startswith("error: manifest.json: signature does not verify")
    assert not list(work.rglob("*.safetensors"))
