"""A hostile bucket (a stolen signing key, a compromised trainer host): what a reader refuses.

A signed manifest may still name anything. Readers take only the files a checkpoint may hold
(no code, no pickle, no paths), check config.json before they fetch the weights (no auto_map,
no kernels, bounded dimensions, a model that fits MAX_MODEL_FP32_BYTES, weights of the size it
describes), and load with remote code off, local files only, safetensors only. Everything here
is real: tiny random transformers models saved with save_pretrained / save_policy, a folder
bucket, signed manifests, and `vrl` processes.
"""
from __future__ import annotations

import json
import resource
import time
from pathlib import Path

import pytest
import torch

from helpers.vrlproc import one_line_error, run_vrl
from volunteer_rl.config import PACKAGE_DATA, VolunteerConfig
from volunteer_rl.model.chain import fetch_weights, keyframe_weights
from volunteer_rl.model.checkpoint import fetch_checkpoint, publish_checkpoint
from volunteer_rl.model.hashing import sha256_bytes
from volunteer_rl.model.policy import Policy, load_policy
from volunteer_rl.model.tiny import build_tokenizer
from volunteer_rl.model.vetting import (
    CHECKPOINT_FILES,
    MAX_MODEL_FP32_BYTES,
    CheckpointRefused,
    check_model_config,
    check_model_folder,
)
from volunteer_rl.model.weights import save_policy
from volunteer_rl.protocol import layout
from volunteer_rl.protocol.manifest import (
    TaskRef,
    PIECE_BYTES,
    FileEntry,
    Keyframe,
    Manifest,
    ManifestError,
    Sampling,
    Weights,
    WeightsEntry,
    pieces_root,
    read_manifest,
    write_manifest,
)
from volunteer_rl.protocol.signing import Ed25519PrivateKey, Trust, public_key_text, sign
from volunteer_rl.storage import open_storage
from volunteer_rl.storage.base import StorageError
from volunteer_rl.task.calculator_generate import generate_problems

KEY = Ed25519PrivateKey.generate()  # the trainer's key, stolen: every manifest here is signed
PUB = public_key_text(KEY)


# --- tiny real models ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer():
    problems = generate_problems(200, seed=3)
    return build_tokenizer([p.prompt for p in problems] + [p.expression for p in problems],
                           vocab_size=300)


def tiny_config(arch: str, vocab: int):
    """A tiny random config of each architecture family a volunteer meets."""
    from transformers import Gemma3TextConfig, GPT2Config, LlamaConfig, Qwen3Config

    small = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return {"llama": lambda: LlamaConfig(**small),
            "qwen3": lambda: Qwen3Config(**small, head_dim=8),
            "gemma3": lambda: Gemma3TextConfig(**small, head_dim=8, sliding_window=16),
            "gpt2": lambda: GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2, n_head=4,
                                       n_positions=128)}[arch]()


def tiny_policy(arch: str, tokenizer, **overrides) -> Policy:
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, len(tokenizer))
    for k, v in overrides.items():
        setattr(config, k, v)
    config.pad_token_id, config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    config.bos_token_id = None
    torch.manual_seed(0)
    return Policy(AutoModelForCausalLM.from_config(config).eval(), tokenizer, "plain",
                  torch.device("cpu"))


@pytest.fixture(scope="module")
def llama(tokenizer, tmp_path_factory) -> Path:
    """A checkpoint folder as the trainer publishes it (save_policy)."""
    return save_policy(tiny_policy("llama", tokenizer), tmp_path_factory.mktemp("llama") / "ckpt")


# --- a signed folder bucket ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def dataset_csv(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "train.csv"
    path.write_text("".join((PACKAGE_DATA / "train.csv").read_text().splitlines(True)[:41]))
    return path


def put_files(storage, version: int, files: dict[str, bytes]) -> dict[str, FileEntry | WeightsEntry]:
    """Checkpoint objects written as a hostile trainer would: anything, past publish_checkpoint's
    own refusal. A name that is no key (`../x`) gets a manifest entry and no object. The
    weights file is listed by its root, as the protocol names it."""
    for name, data in files.items():
        if layout.is_safe_name(name):
            storage.create(layout.checkpoint_key(version, name), data)
    return {name: keyframe_weights(version, data)[0] if name == "model.safetensors"
            else FileEntry(sha256_bytes(data), len(data)) for name, data in files.items()}


def folder_files(folder: Path, **changes: bytes | None) -> dict[str, bytes]:
    """The folder's files, with some replaced, added or (None) left out."""
    files = {p.name: p.read_bytes() for p in sorted(folder.iterdir())}
    files.update(changes)
    return {k: v for k, v in files.items() if v is not None}


def with_config(folder: Path, **edits) -> bytes:
    raw = json.loads((folder / "config.json").read_text())
    raw.update(edits)
    return json.dumps(raw).encode()


def make_manifest(storage, version: int, files: dict[str, FileEntry], dataset_csv: Path,
                  **fields) -> Manifest:
    from volunteer_rl.trainer.publish import upload_dataset

    weights = files.get("model.safetensors")
    if weights is not None and "weights" not in fields:  # a keyframe, pieces of what is there
        try:
            data = storage.read(layout.checkpoint_key(version, "model.safetensors"))
            fields["weights"] = keyframe_weights(version, data)[1]
        except StorageError:  # not in the bucket: pieces of nothing, and their root
            pieces = ("0" * 64,) * -(-weights.size // PIECE_BYTES)
            root = pieces_root(PIECE_BYTES, weights.size, pieces)
            files = {**files, "model.safetensors": WeightsEntry(root, weights.size)}
            fields["weights"] = Weights(PIECE_BYTES, pieces, Keyframe(version, root, weights.size))
    return Manifest(task=TaskRef("calculator", "volunteer-rl", "0.1.0"), run_id="run-h", version=version, checkpoint=layout.checkpoint_prefix(version),
                    files=files, dataset=upload_dataset(storage, dataset_csv),
                    sampling=Sampling(2, 1.0, 8), max_staleness=2, **fields)


def publish(storage, version, files: dict[str, bytes], dataset_csv, etag=None, **fields):
    """A signed manifest for these checkpoint files, committed to the bucket; (manifest, etag)."""
    m = make_manifest(storage, version, put_files(storage, version, files), dataset_csv, **fields)
    return m, write_manifest(storage, m, etag, KEY)


def empty(folder: Path) -> bool:
    return not folder.exists() or not any(folder.iterdir())


# --- file names and sizes -----------------------------------------------------------------------

@pytest.mark.parametrize("name", ["modeling_evil.py", "pytorch_model.bin", "../x",
                                  "model.safetensors.index.json", "README.md"])
def test_a_manifest_listing_code_pickles_or_paths_is_refused_before_any_download(
        name, llama, dataset_csv, tmp_path):
    storage = open_storage(str(tmp_path / "bucket"))
    files = folder_files(llama, **{name: b"import os; os.system('echo owned')\n"})
    m = make_manifest(storage, 3, put_files(storage, 3, files), dataset_csv)
    dest = tmp_path / "dest"
    dest.mkdir()
    for fetch in (lambda: fetch_checkpoint(storage, m, dest, require_model=True),
                  lambda: fetch_checkpoint(storage, m, dest),  # the trainer's resume too
                  lambda: fetch_weights(storage, m)):  # a volunteer's swap
        with pytest.raises(CheckpointRefused) as e:
            fetch()
        assert str(e.value) == (
            f"manifest.json: v3 lists {name!r}, which is not a file a checkpoint may hold "
            f"(weights, configs and tokenizer files only: no code, no pickle, no paths); "
            f"refused before downloading the checkpoint")
        assert empty(dest)
    # A signed manifest with a path for a name does not even parse.
    if name == "../x":
        doc = sign(json.loads(m.to_json()), KEY)
        storage.write(layout.MANIFEST, json.dumps(doc).encode())
        with pytest.raises(ManifestError, match=r"unsafe file name '\.\./x'"):
            read_manifest(storage, trust=Trust(PUB))


def test_a_file_over_its_size_cap_is_refused_before_any_download(llama, dataset_csv, tmp_path):
    storage = open_storage(str(tmp_path / "bucket"))
    big = with_config(llama, padding="x" * CHECKPOINT_FILES["config.json"])
    m = make_manifest(storage, 0, put_files(storage, 0, folder_files(llama, **{"config.json": big})),
                      dataset_csv)
    with pytest.raises(CheckpointRefused) as e:
        fetch_checkpoint(storage, m, tmp_path / "dest", require_model=True)
    assert str(e.value) == (f"manifest.json: v0 lists 'config.json', which is {len(big):,} bytes, "
                            f"over the 1,048,576-byte limit for that file; refused before "
                            f"downloading the checkpoint")
    assert empty(tmp_path / "dest")


def test_the_trainer_does_not_publish_what_readers_refuse(llama, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for p in llama.iterdir():
        (src / p.name).write_bytes(p.read_bytes())
    (src / "modeling_evil.py").write_text("raise SystemExit")
    storage = open_storage(str(tmp_path / "bucket"))
    with pytest.raises(CheckpointRefused, match=r"modeling_evil\.py is not a file a checkpoint "
                       r"may hold .* readers refuse a checkpoint holding it, so v0 is not published"):
        publish_checkpoint(storage, 0, src)
    assert storage.list("checkpoints/") == []


# --- config.json, checked before the weights ------------------------------------------------------

@pytest.mark.parametrize("edits, says", [
    ({"auto_map": {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}},
     "auto_map asks transformers to run code shipped with the checkpoint; volunteer_rl never "
     "runs code or kernels from a checkpoint"),
    ({"attn_implementation": "kernels-community/flash-attn"}, "attn_implementation is "
     "'kernels-community/flash-attn', not one of batched_mm, eager, grouped_mm, sdpa"),
    ({"quantization_config": {"quant_method": "mxfp4"}}, "quantization_config asks for "
     "quantized weights"),
])
def test_a_config_asking_for_code_is_refused_before_the_weights_are_fetched(
        edits, says, llama, dataset_csv, tmp_path):
    storage = open_storage(str(tmp_path / "bucket"))
    files = put_files(storage, 0, folder_files(llama, **{"config.json": with_config(llama, **edits)}))
    # The weights are listed but not in the bucket: fetching them would fail otherwise.
    (tmp_path / "bucket" / layout.checkpoint_key(0, "model.safetensors")).unlink()
    m = make_manifest(storage, 0, files, dataset_csv)
    for fetch in (lambda: fetch_checkpoint(storage, m, tmp_path / "dest", require_model=True),
                  lambda: fetch_weights(storage, m)):
        with pytest.raises(CheckpointRefused) as e:
            fetch()
        assert str(e.value).startswith(f"checkpoints/v000000/config.json: {says}")
        assert "\n" not in str(e.value)
    assert empty(tmp_path / "dest")


def saved_config(config, folder: Path, **edits) -> bytes:
    """config.json as save_pretrained writes it, with some values changed."""
    config.save_pretrained(folder)
    raw = json.loads((folder / "config.json").read_text())
    for path, value in edits.items():
        *parents, key = path.split(".")
        node = raw
        for p in parents:
            node = node[p]
        node[key] = value
    return json.dumps(raw).encode()


def builds(monkeypatch) -> list[dict]:
    """The configs vetting builds a model of on the meta device from now on (it still builds
    them): what a check costs, counted instead of timed, which a busy machine would stretch."""
    import volunteer_rl.model.vetting as vetting

    built, build = [], vetting._model_shape

    def counted(raw):
        built.append(raw)
        return build(raw)
    monkeypatch.setattr(vetting, "_model_shape", counted)
    return built


@pytest.mark.parametrize("arch, edit, says", [
    ("llama", {"vocab_size": 10 ** 9}, "vocab_size is 1000000000, not an integer in 1..4,194,304"),
    ("llama", {"num_hidden_layers": 10 ** 6}, "num_hidden_layers is 1000000, not an integer in 1..512"),
    ("llama", {"hidden_size": True}, "hidden_size is True, not an integer in 1..65,536"),
    ("llama", {"intermediate_size": 64.0}, "intermediate_size is 64.0, not an integer"),
    ("llama", {"num_attention_heads": "4"}, "num_attention_heads is '4', not an integer"),
    ("qwen3", {"max_window_layers": 10 ** 7}, "max_window_layers is 10000000, over 512"),
    ("gpt2", {"n_positions": 1 << 30}, "n_positions is 1073741824, not an integer in 1..16,777,216"),
    ("gemma3mm", {"text_config.vocab_size": 10 ** 9}, "text_config.vocab_size is 1000000000"),
    ("gemma3mm", {"vision_config.num_hidden_layers": 10 ** 6},
     "vision_config.num_hidden_layers is 1000000"),
])
def test_out_of_bounds_dimensions_are_refused_before_allocation(arch, edit, says, tokenizer, tmp_path,
                                                                 monkeypatch):
    if arch == "gemma3mm":  # the multimodal Gemma 3: dimensions nested in sub-configs
        from transformers import Gemma3Config
        config = Gemma3Config()
    else:
        config = tiny_config(arch, len(tokenizer))
    data = saved_config(config, tmp_path, **edit)
    built = builds(monkeypatch)
    with pytest.raises(CheckpointRefused) as e:
        check_model_config(data, "checkpoints/v000007/config.json")
    assert built == []  # refused on the numbers, before any model is built
    assert str(e.value).startswith(f"checkpoints/v000007/config.json: {says}")


def test_a_model_too_big_is_refused_on_the_meta_device(tmp_path, monkeypatch):
    from transformers import LlamaConfig

    # Every dimension within bounds; together 9.9 T parameters, 40 TB in fp32.
    data = saved_config(LlamaConfig(hidden_size=65536, num_hidden_layers=512), tmp_path)
    h, mlp, vocab = 65536, 11008, 32000  # Llama's defaults beside those two
    params = 512 * (4 * h * h + 3 * h * mlp + 2 * h) + 2 * vocab * h + h  # counted by hand
    held = 4 * params + 2 * 4 * (h // 32 // 2)  # + the rotary embedding's two inv_freq buffers
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    built = builds(monkeypatch)
    start = time.perf_counter()
    with pytest.raises(CheckpointRefused) as e:
        check_model_config(data, "config.json")
    # A hang guard, not a pace: the meta build takes a second or two; allocating the model
    # would take hours, or the memory below.
    assert time.perf_counter() - start < 300
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 1 << 20  # KiB: < 1 GiB more
    assert str(e.value) == (
        f"config.json: describes a model of {params:,} parameters, {held:,} "
        f"bytes in fp32, over the {MAX_MODEL_FP32_BYTES:,}-byte limit (MAX_MODEL_FP32_BYTES)")
    assert len(built) == 1
    with pytest.raises(CheckpointRefused):  # the verdict is kept: no second build
        check_model_config(data, "config.json")
    assert len(built) == 1


def test_weights_of_another_size_than_the_config_are_refused_before_download(
        tokenizer, llama, dataset_csv, tmp_path):
    bigger = save_policy(tiny_policy("llama", tokenizer, hidden_size=64), tmp_path / "bigger")
    storage = open_storage(str(tmp_path / "bucket"))
    # config.json of the tiny model, model.safetensors of a bigger one
    swapped = folder_files(llama, **{"model.safetensors": (bigger / "model.safetensors").read_bytes()})
    m = make_manifest(storage, 0, put_files(storage, 0, swapped), dataset_csv)
    for fetch in (lambda: fetch_checkpoint(storage, m, tmp_path / "dest", require_model=True),
                  lambda: fetch_weights(storage, m)):
        with pytest.raises(CheckpointRefused, match=r"^checkpoints/v000000/model\.safetensors: "
                           r"[\d,]+ bytes in manifest\.json, but config\.json describes 37,792 "
                           r"parameters: 151,168 bytes of float32 data"):
            fetch()
    assert empty(tmp_path / "dest")
    # The right file, announced as bf16: half the bytes it has.
    m = make_manifest(storage, 1, put_files(storage, 1, folder_files(llama)), dataset_csv,
                      weights_dtype="bfloat16")
    with pytest.raises(CheckpointRefused, match="75,584 bytes of bfloat16 data"):
        fetch_checkpoint(storage, m, tmp_path / "dest", require_model=True)
    assert empty(tmp_path / "dest")


def test_a_checkpoint_without_a_model_config_is_refused_where_a_model_is_loaded(
        llama, dataset_csv, tmp_path):
    storage = open_storage(str(tmp_path / "bucket"))
    m = make_manifest(storage, 0, put_files(storage, 0, folder_files(llama, **{"config.json": None})),
                      dataset_csv)
    with pytest.raises(CheckpointRefused, match=r"^manifest\.json: v0 lists no config\.json; "):
        fetch_checkpoint(storage, m, tmp_path / "dest", require_model=True)
    raw = json.loads((llama / "config.json").read_text())
    del raw["model_type"]
    m = make_manifest(storage, 1, put_files(storage, 1, folder_files(
        llama, **{"config.json": json.dumps(raw).encode()})), dataset_csv)
    with pytest.raises(CheckpointRefused, match=r"config\.json: no model_type; "):
        fetch_checkpoint(storage, m, tmp_path / "dest", require_model=True)
    assert empty(tmp_path / "dest")


# --- loading local folders ------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", "gpt2"])
def test_tiny_real_architectures_pass_the_checks_and_load(arch, tokenizer, dataset_csv, tmp_path):
    policy = tiny_policy(arch, tokenizer)
    ids = torch.tensor([tokenizer("Q: 1 + 2\nA: ")["input_ids"]])
    with torch.no_grad():
        expected = policy.model(ids).logits
    # A user's Hugging Face folder (`vrl trainer --model PATH`), as save_pretrained writes it.
    hf = tmp_path / "hf"
    policy.model.save_pretrained(hf)
    tokenizer.save_pretrained(hf)
    shape = check_model_folder(hf)
    assert shape.params == sum(t.numel() for t in policy.model.state_dict().values()) - \
        (policy.model.get_input_embeddings().weight.numel()
         if policy.model.config.tie_word_embeddings else 0)
    with torch.no_grad():
        assert torch.allclose(load_policy(hf).model(ids).logits, expected, atol=1e-5)
    # Published as the trainer does, in both weights dtypes, and fetched as a volunteer does.
    storage = open_storage(str(tmp_path / "bucket"))
    for version, dtype in enumerate((torch.float32, torch.bfloat16)):
        folder = save_policy(policy, tmp_path / f"v{version}", dtype)
        assert {p.name for p in folder.iterdir()} <= set(CHECKPOINT_FILES)
        m = make_manifest(storage, version, publish_checkpoint(storage, version, folder),
                          dataset_csv, weights_dtype=str(dtype).removeprefix("torch."))
        loaded = load_policy(fetch_checkpoint(storage, m, tmp_path / f"got{version}",
                                              require_model=True))
        assert fetch_weights(storage, m).buf.nbytes == \
            m.files["model.safetensors"].size
        with torch.no_grad():
            assert torch.allclose(loaded.model(ids).logits, expected, atol=0.1 if version else 1e-5)


def test_a_tokenizer_config_with_auto_map_is_refused(llama, tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    for p in llama.iterdir():
        (folder / p.name).write_bytes(p.read_bytes())
    raw = json.loads((folder / "tokenizer_config.json").read_text())
    raw["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    (folder / "tokenizer_config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointRefused) as e:
        load_policy(folder)
    assert str(e.value) == (f"{folder / 'tokenizer_config.json'}: auto_map asks transformers to "
                            f"run code shipped with the checkpoint; volunteer_rl never runs code "
                            f"or kernels from a checkpoint")


def test_a_folder_with_pickled_weights_only_is_refused_in_one_line(tokenizer, tmp_path):
    folder = tmp_path / "pickled"
    policy = tiny_policy("llama", tokenizer)
    policy.model.config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    torch.save(policy.model.state_dict(), folder / "pytorch_model.bin")
    expected = (f"{folder / 'model.safetensors'}: missing; volunteer_rl loads safetensors "
                f"weights only (found pytorch_model.bin: pickled weights are never loaded)")
    with pytest.raises(CheckpointRefused) as e:
        load_policy(folder)
    assert str(e.value) == expected
    r = run_vrl(["trainer", "--bucket", str(tmp_path / "bucket"), "--model", str(folder),
                 "--warm-start-steps", "0", "--work-dir", str(tmp_path / "tw")], cwd=tmp_path)
    assert one_line_error(r) == f"error: {expected}"


def test_weights_that_do_not_fit_leave_the_live_model_as_it_was(tokenizer, llama, tmp_path):
    from volunteer_rl.model.weights import load_weights

    live = load_policy(llama)
    before = {k: v.clone() for k, v in live.model.state_dict().items()}
    # Same tensor names; the embedding (stored first) fits, the MLP's (stored later) do not.
    other = tiny_policy("llama", tokenizer, intermediate_size=128)
    with torch.no_grad():
        other.model.model.embed_tokens.weight.add_(1.0)
    other = save_policy(other, tmp_path / "o")
    with pytest.raises(ValueError, match=r"^model\.safetensors: model\.layers\.0\.mlp\.\w+\.weight "
                       r"has shape \[\d+, \d+\]"):
        load_weights(live, other / "model.safetensors")
    assert all(torch.equal(v, before[k]) for k, v in live.model.state_dict().items())


# --- volunteers -----------------------------------------------------------------------------------

def test_a_volunteer_keeps_its_model_when_a_later_checkpoint_is_refused(
        llama, dataset_csv, tmp_path):
    from volunteer_rl.volunteer.loop import Volunteer

    storage = open_storage(str(tmp_path / "bucket"))
    _, etag = publish(storage, 0, folder_files(llama), dataset_csv)
    logs: list[str] = []
    v = Volunteer(VolunteerConfig(bucket=str(tmp_path / "bucket"), volunteer_id="v", device="cpu",
                                  trust_key=PUB, heartbeat_seconds=0,
                                  work_dir=str(tmp_path / "vw")), log=logs.append)
    assert v.try_switch(v.poll()) and v.manifest.version == 0
    policy = v.policy
    evil = with_config(llama, auto_map={"AutoModelForCausalLM": "modeling_evil.Evil"})
    publish(storage, 1, folder_files(llama, **{"config.json": evil}), dataset_csv, etag)
    m = v.poll()
    assert m.version == 1 and not v.try_switch(m)
    assert v.manifest.version == 0 and v.policy is policy and v.usable(m)
    assert logs[-1] == ("warning: cannot load v1: checkpoints/v000001/config.json: auto_map asks "
                        "transformers to run code shipped with the checkpoint; volunteer_rl never "
                        "runs code or kernels from a checkpoint; will retry")
    assert not v.try_switch(m) and logs[-1].startswith("warning: cannot load v1")  # said once
    assert sum("cannot load v1" in line for line in logs) == 1
    # A volunteer that holds no model yet stops on it: nothing it could ever load is here.
    fresh = Volunteer(VolunteerConfig(bucket=str(tmp_path / "bucket"), volunteer_id="w",
                                      device="cpu", trust_key=PUB, heartbeat_seconds=0,
                                      work_dir=str(tmp_path / "vw2")), log=logs.append)
    with pytest.raises(CheckpointRefused, match="auto_map"):
        fresh.try_switch(fresh.poll())
    assert fresh.policy is None


def test_a_volunteer_exits_on_a_signed_manifest_listing_code(llama, dataset_csv, tmp_path):
    storage = open_storage(str(tmp_path / "bucket"))
    evil = with_config(llama, auto_map={"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"})
    publish(storage, 0, folder_files(llama, **{"config.json": evil,
                                               "modeling_evil.py": b"import os\nos.system('id')\n"}),
            dataset_csv)
    work = tmp_path / "vw"
    r = run_vrl(["volunteer", "--bucket", str(tmp_path / "bucket"), "--trust-key", PUB,
                 "--id", "v", "--device", "cpu", "--threads", "1", "--poll-seconds", "0.2",
                 "--heartbeat-seconds", "0", "--max-seconds", "60", "--work-dir", str(work)],
                cwd=tmp_path)
    assert one_line_error(r) == (
        "error: manifest.json: v0 lists 'modeling_evil.py', which is not a file a checkpoint may "
        "hold (weights, configs and tokenizer files only: no code, no pickle, no paths); refused "
        "before downloading the checkpoint")
    assert not list(work.rglob("*.py")) and not list(work.rglob("*.safetensors"))
    assert "now on" not in r.stdout
