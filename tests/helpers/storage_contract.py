"""Checks every storage backend must pass, shared by the folder, memory and S3 test files."""

LISTED = ["r/a.txt", "r/b.txt", "r/b/c", "r/b/d/e", "r/b0", "r/c/x"]
"""Keys whose sorted order is not a naive folder walk's: "r/b.txt" sorts before "r/b/c"."""


def check_bounded_listing_and_one_level(store) -> None:
    """`list` with and without a limit returns the first keys in sorted order; `list_level`
    names a prefix's objects and folders one level down."""
    for key in reversed(LISTED + ["rr/other", "top"]):
        store.write(key, b"1")
    assert store.list("r") == LISTED
    for limit in range(len(LISTED) + 2):
        assert store.list("r", limit=limit) == LISTED[:limit]
    assert store.list("nothing", limit=3) == []
    assert store.list_level("r") == ["r/a.txt", "r/b.txt", "r/b/", "r/b0", "r/c/"]
    assert store.list_level("r/b") == ["r/b/c", "r/b/d/"]
    assert store.list_level("") == ["r/", "rr/", "top"]
    assert store.list_level("nothing/here") == [] and store.list_level("top") == []
