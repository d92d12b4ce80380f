import pytest

from volunteer_rl.protocol import layout


def test_keys_are_zero_padded_and_sorted():
    assert layout.version_dir(42) == "v000042"
    assert layout.checkpoint_key(42, "model.safetensors") == "checkpoints/v000042/model.safetensors"
    assert layout.manifest_history_key(7) == "manifests/v000007.json"
    assert layout.metrics_key(3) == "metrics/v000003.jsonl"
    assert sorted([layout.version_dir(v) for v in (10, 9, 100)]) == ["v000009", "v000010", "v000100"]


def test_shard_key_round_trip():
    key = layout.shard_key(42, "laptop-ab12", "1700000000000-000001-deadbeef")
    assert key == "rollouts/v000042/laptop-ab12/1700000000000-000001-deadbeef.jsonl.gz"
    assert layout.parse_shard_key(key) == (42, "laptop-ab12", "1700000000000-000001-deadbeef")


def test_parse_shard_key_rejects_anything_off():
    for bad in ["rollouts/v000042/a/b.json", "rollouts/v42x/a/b.jsonl.gz",
                "rollouts/v000042/../b.jsonl.gz", "rollouts/v000042/a/c/b.jsonl.gz",
                "checkpoints/v000042/a/b.jsonl.gz", "rollouts/v000042/.hidden/b.jsonl.gz"]:
        assert layout.parse_shard_key(bad) is None, bad


def test_unsafe_names_refused():
    for bad in ["", "..", "a/b", "../x", ".hidden", "-x", "a" * 65, "a b", "a..b"]:
        assert not layout.is_safe_name(bad), bad
    for good in ["a", "laptop-ab12", "host.example_1"]:
        assert layout.is_safe_name(good)
    import pytest
    with pytest.raises(ValueError):
        layout.shard_key(1, "../evil", "x")


def test_dataset_key_is_content_addressed():
    assert layout.dataset_key("train", "ab" * 32) == "datasets/train-abababababab.csv"
    assert layout.dataset_key("we/ird name", "cd" * 32).startswith("datasets/we_ird_name-")


def test_parse_version_dir():
    assert layout.parse_version_dir("rollouts/v000042/") == 42
    assert layout.parse_version_dir("v12") is None


@pytest.mark.parametrize("name", ["vol-1\n", "v\u0661\u0662", "vol\u0663", "a" * 65, "..x", ".x", "",
                                  "x/y", "vol 1", "vol\x1b[31m"])
def test_unsafe_names_are_refused_whole(name):
    """`$` accepted a trailing newline and `\\d` other scripts' digits (int() reads them)."""
    assert not layout.is_safe_name(name)


@pytest.mark.parametrize("key", [
    "rollouts/v000003\n/vol/s.jsonl.gz", "rollouts/v\u0660\u0660\u0660\u0660\u0660\u0663/vol/s.jsonl.gz",
    "rollouts/v000003/vol\n/s.jsonl.gz", "rollouts/v000003/vol/s\n.jsonl.gz",
])
def test_shard_keys_with_newlines_or_foreign_digits_do_not_parse(key):
    assert layout.parse_shard_key(key) is None


def test_foreign_digits_are_no_version():
    assert layout.parse_version_dir("v\u0660\u0660\u0660\u0660\u0660\u0663") is None
    assert layout.parse_version_dir("v000003\n") is None
    assert layout.split_versioned_key("metrics/v000003.jsonl\n") is None
    assert layout.parse_version_dir("v000003") == 3


def test_every_object_under_a_volunteer_folder_has_an_author_and_a_quarantine_name():
    assert layout.rollout_author("rollouts/v000003/vol/notes.txt") == (3, "vol")
    assert layout.rollout_author("rollouts/v000003/vol/a/b/c") == (3, "vol")
    assert layout.rollout_author("rollouts/v000003/x.txt") is None
    assert layout.rollout_author("rollouts/v000003/../x") is None
    q = layout.quarantine_key("rollouts/v000003/vol/notes.txt")
    assert q.startswith("quarantine/v000003/vol/junk-") and q.endswith(".json") and len(q) < 60
    assert layout.quarantine_key(layout.shard_key(3, "vol", "s1")) == "quarantine/v000003/vol/s1.json"
    with pytest.raises(ValueError):
        layout.quarantine_key("rollouts/v000003/x.txt")


# --- the staleness window --------------------------------------------------------------------

@pytest.mark.parametrize("current, max_staleness, versions", [
    (5, 2, [3, 4, 5]),
    (2, 2, [0, 1, 2]),     # the window just reaches v0
    (1, 3, [0, 1]),        # cut short by v0
    (0, 0, [0]),
    (7, 0, [7]),           # no staleness: the current version only
    (3, -1, []),           # nonsense settings accept nothing
])
def test_window_is_current_and_the_max_staleness_before_it(current, max_staleness, versions):
    assert list(layout.window(current, max_staleness)) == versions


@pytest.mark.parametrize("lag, max_staleness, accepted", [
    (0, 2, True), (2, 2, True), (3, 2, False),    # the edge is inside
    (-1, 2, False), (-100, 2, False),             # from a version the trainer has not reached
    (0, 0, True), (1, 0, False), (0, -1, False),
    (10 ** 9, 10 ** 9, True), (10 ** 9 + 1, 10 ** 9, False),
])
def test_in_window_at_its_edges(lag, max_staleness, accepted):
    assert layout.in_window(lag, max_staleness) is accepted


def test_in_window_agrees_with_window_wherever_v0_does_not_cut_it():
    for current in range(0, 12):
        for s in range(0, 5):
            for version in range(0, 15):
                assert (version in layout.window(current, s)) == layout.in_window(current - version, s)


# --- metrics and dashboard keys --------------------------------------------------------------

def test_metrics_key_round_trip():
    for v in (0, 42, 10 ** 6):
        assert layout.parse_metrics_key(layout.metrics_key(v)) == v
    for bad in ("metrics/v000042.json", "metrics/v42.jsonl", "metrics/v000042/x.jsonl",
                "ledger/v000042.jsonl", "metrics/v000042.jsonl\n", "metrics/v\u0661\u0662.jsonl",
                "metrics/x/v000042.jsonl"):
        assert layout.parse_metrics_key(bad) is None, bad


def test_dashboard_key_round_trip():
    assert layout.dashboard_key("index.html") == "dashboard/index.html"
    for name in ("index.html", "accuracy.png"):
        assert layout.parse_dashboard_key(layout.dashboard_key(name)) == name
    for bad in ("dashboard/a/b.png", "dashboard/..png", "plots/a.png", "dashboard/"):
        assert layout.parse_dashboard_key(bad) is None, bad
    for bad in ("../index.html", "a/b.png", ""):
        with pytest.raises(ValueError):
            layout.dashboard_key(bad)
