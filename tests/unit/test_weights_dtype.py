"""`--weights-dtype bf16`: the checkpoint carries bf16 weights and says so, volunteers upcast
them exactly, and the trainer audits against those weights, not its fp32 master."""

import json

import pytest
import torch
from conftest import one_thread
from safetensors import safe_open

from helpers.honest_groups import drawn_prompt, nonce, secret_of

from volunteer_rl.config import PACKAGE_DATA, TrainerConfig
from volunteer_rl.model.chain import fetch_weights
from volunteer_rl.model.checkpoint import fetch_checkpoint
from volunteer_rl.model.hashing import CheckpointError
from volunteer_rl.model.policy import encode_prompts, load_policy
from volunteer_rl.model.sampling import sample
from volunteer_rl.protocol import layout
from volunteer_rl.protocol.draws import group_keys
from volunteer_rl.protocol.manifest import Manifest
from volunteer_rl.protocol.shards import SHARD_GROUPS_LIMIT, Completion, Group, encode_shard
from volunteer_rl.task.reward import completion_reward
from volunteer_rl.trainer.groups import IngestStats
from volunteer_rl.trainer.loop import Trainer
from volunteer_rl.trainer.step import audit_groups
from volunteer_rl.model.chain import swap_weights


@pytest.fixture(scope="module")
def bf16_trainer(template, tmp_path_factory):
    """A trainer that published v0 with bf16 weights, started from the template's
    warm-started model (its own warm start took 35 s of the suite in CI)."""
    root = tmp_path_factory.mktemp("bf16")
    eval_csv = root / "eval10.csv"
    eval_csv.write_text("".join((PACKAGE_DATA / "eval.csv").read_text().splitlines(True)[:11]))
    cfg = TrainerConfig(bucket=str(root / "bucket"), model=str(template.model(root / "model")),
                        eval_every=0, eval_dataset=str(eval_csv), work_dir=str(root / "work"),
                        weights_dtype="bf16", signing_key=str(root / "key.pem"))
    trainer = Trainer(cfg, log=lambda m: None)
    with one_thread():  # v0's eval on one torch thread: conftest.one_thread says why
        trainer.start()
    return trainer, root


def test_bf16_checkpoint_round_trip(bf16_trainer, tmp_path):
    trainer, root = bf16_trainer
    m = trainer.manifest
    assert m.weights_dtype == "bfloat16"
    assert json.loads(m.to_json())["weights_dtype"] == "bfloat16"  # signed with the rest
    assert m.max_shard_groups == SHARD_GROUPS_LIMIT == trainer.ingest.rules.max_groups
    folder = fetch_checkpoint(trainer.storage, m, tmp_path / "ckpt")
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    fp32_bytes = sum(p.numel() * 4 for p in trainer.policy.model.parameters())
    assert m.files["model.safetensors"].size < 0.55 * fp32_bytes  # about half

    master = trainer.policy.model.state_dict()
    rounded = {k: v.to(torch.bfloat16).float() for k, v in master.items()}
    # A volunteer's first load (from_pretrained) and its in-place swap both give the master
    # rounded to bf16, held in fp32; the trainer's published copy holds the same values.
    volunteer = load_policy(folder)
    for k, v in volunteer.model.state_dict().items():
        assert v.dtype == torch.float32 and torch.equal(v, rounded[k]), k
    with torch.no_grad():
        for p in volunteer.model.parameters():
            p.zero_()
    swap_weights(trainer.storage, m, volunteer)
    for k, v in volunteer.model.state_dict().items():
        assert torch.equal(v, rounded[k]), k
    for k, v in trainer.published_policy.model.state_dict().items():
        assert torch.equal(v, rounded[k]), k
    assert any(not torch.equal(master[k], rounded[k]) for k in master)  # rounding did something


def test_older_manifests_mean_fp32(bf16_trainer):
    trainer, _ = bf16_trainer
    raw = json.loads(trainer.manifest.to_json())
    del raw["weights_dtype"]
    assert Manifest.from_raw(raw).weights_dtype == "float32"


def test_a_tampered_buffer_is_refused_before_any_weight_moves(bf16_trainer, tmp_path):
    trainer, root = bf16_trainer
    m = trainer.manifest
    key = f"{m.checkpoint}/model.safetensors"
    path = root / "bucket" / key
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.chmod(0o644)
    original = path.read_bytes()
    path.write_bytes(bytes(data))
    try:
        with pytest.raises(CheckpointError):
            fetch_weights(trainer.storage, m)
    finally:
        path.write_bytes(original)


def test_an_honest_bf16_volunteer_passes_the_audit(bf16_trainer, tmp_path):
    trainer, _ = bf16_trainer
    cfg = trainer.cfg
    volunteer = load_policy(fetch_checkpoint(trainer.storage, trainer.manifest, tmp_path / "v"))
    problems = [trainer.problems[drawn_prompt(trainer, 0, "honest", i)] for i in range(64)]
    secret = secret_of(trainer)
    keys = [group_keys(trainer.run_id, 0, "honest", i, p.id, cfg.k,
                       nonce(secret, trainer.run_id, "honest", 0, i)) for i, p in enumerate(problems)]
    out = sample(volunteer, encode_prompts(volunteer, [p["natural_language"] for p in problems]),
                 cfg.k, cfg.temperature, cfg.max_new_tokens, draw_keys=keys)
    groups = [Group(p.id, 0, "honest", i, [
        Completion(x.token_ids, x.logprobs, x.text,
                   completion_reward(x.token_ids, p["python_expression"], volunteer.decode_all,
                                     volunteer.eos_id, volunteer.special_ids))
        for x in samples]) for i, (p, samples) in enumerate(zip(problems, out))]
    # The real intake: rewards recomputed, every group of a new volunteer's shard replayed.
    trainer.storage.create(layout.shard_key(0, "honest", "s1"), encode_shard(groups))
    stats = IngestStats()
    trainer.ingest.poll(trainer.window(), stats)
    assert stats.shards == 1 and not stats.rejected and stats.audit.audited == 1, stats

    # Every group scored under the published (bf16) weights matches closely; under the fp32
    # master the gap is larger: that copy is the one the audit must not use.
    from volunteer_rl.trainer.checks import score_group
    ids = trainer.prompt_ids
    sg = [score_group(g, "k", i, trainer.ingest.rules) for i, g in enumerate(groups)]
    run = trainer.run_id
    assert audit_groups(trainer.published_policy, sg, ids, run, cfg.temperature, 1e-4, 1e-3) is None
    gap = audit_groups(trainer.policy, sg, ids, run, cfg.temperature, 1e-4, 1e-3)
    assert gap is not None  # the master's logprobs are measurably different


def test_a_bf16_trainer_resumes_with_its_fp32_master(bf16_trainer):
    trainer, _ = bf16_trainer
    again = Trainer(trainer.cfg, log=lambda m: None)
    again.start()  # resumes v0: bf16 checkpoint, then the master from state/v000000
    assert again.version == 0
    master = trainer.policy.model.state_dict()
    for k, v in again.policy.model.state_dict().items():
        assert torch.equal(v, master[k]), k
    for k, v in again.published_policy.model.state_dict().items():
        assert torch.equal(v, master[k].to(torch.bfloat16).float()), k
