"""A bucket's URI: what it may be, checked before anything is read (`check_bucket`), and the
storage it opens (`open_storage`: the backend for its scheme, wrapped in Retrying).

A bucket is addressed by URI: a plain folder path or `file://` (the embedded default, no
server), `s3://bucket/prefix` (boto3; `endpoint_url` for MinIO, R2 and other S3-compatible
stores; s3fs with VRL_S3_BACKEND=fsspec), `gs://bucket/prefix` (gcsfs), or `memory://name`
for unit tests.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from volunteer_rl.storage.base import Storage, StorageError
from volunteer_rl.storage.local import LocalStorage
from volunteer_rl.storage.retry import Retrying

from volunteer_rl.storage.retry import Retrying

FSSPEC_SCHEMES = {"s3": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "memory": None,
                  "az": "adlfs", "abfs": "adlfs"}
"""Schemes served by fsspec, and the package that brings each (None: fsspec's own)."""
EXTRAS = {"gcsfs": "gcsfs (what vrl's [gcs] extra adds; docs/DEPLOY.md)"}
"""What to pip install for a scheme's package, where the project says more than its name. No
index serves vrl itself, so the hint names the package, not `volunteer-rl[gcs]`."""

# A mistyped URL (`s3:/x`, `gs:bucket`): a scheme of two or more letters and a colon, without
# the `//` after it. One letter is a Windows drive (`C:/runs`), which stays a folder.
_SCHEME_WITHOUT_SLASHES = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):(?!//)")


def local_folder(uri: str) -> Path | None:
    """The folder of a folder bucket (a plain path or file://), None for any other scheme;
    StorageError for an empty --bucket or one that looks like a URL with its `//` missing."""
    if not uri:
        raise StorageError("--bucket is empty: give a folder path or a URI such as s3://bucket")
    mistyped = _SCHEME_WITHOUT_SLASHES.match(uri)
    if mistyped:
        raise StorageError(
            f"--bucket {uri}: looks like a URL missing its '//' (such as "
            f"{mistyped.group(1)}://...); for a folder of that name write ./{uri}")
    if uri.startswith("file://"):
        return Path(uri[len("file://"):])
    return None if "://" in uri else Path(uri)


def check_bucket(uri: str, endpoint_url: str | None = None, create: bool = True) -> None:
    """StorageError (one line naming the flag) unless `uri` and `endpoint_url` can address a
    bucket: a known scheme whose package is installed, an endpoint with its http(s):// scheme,
    and a folder bucket that exists, or is made now when `create`. Reads nothing remote.

    Only the trainer (and the demo, for its trainer) may make a folder bucket: for any other
    command a missing folder is a mistyped path, and a volunteer would wait there forever."""
    folder = local_folder(uri)
    if endpoint_url is not None and not re.match(r"^https?://[^/]", endpoint_url):
        raise StorageError(f"--endpoint-url {endpoint_url}: give a URL with its scheme, such "
                           f"as http://{endpoint_url.split('://')[-1]}")
    if folder is not None:
        folder = folder.expanduser()
        if create:
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StorageError(f"--bucket {uri}: cannot create the folder "
                                   f"({exc.strerror or exc})") from None
        elif not folder.is_dir():
            raise StorageError(f"--bucket {uri}: no such folder (only the trainer creates a "
                               "folder bucket; check the path)")
        return
    scheme = uri.split("://", 1)[0]
    if scheme == "s3" and os.environ.get("VRL_S3_BACKEND", "") != "fsspec":
        return  # boto3, a dependency
    if scheme not in FSSPEC_SCHEMES:
        raise StorageError(f"--bucket {uri}: unsupported scheme "
                           "(use a folder, file://, s3://, gs:// or memory://)")
    package = FSSPEC_SCHEMES[scheme]
    if package:
        import importlib.util

        if importlib.util.find_spec(package) is None:
            raise StorageError(f"--bucket {uri}: {scheme}:// needs the package {package}, which "
                               f"is not installed: pip install {EXTRAS.get(package, package)}")


def open_storage(uri: str, endpoint_url: str | None = None, retry: bool = True,
                 create: bool = True) -> Storage:
    """The storage for a bucket URI (see the module docstring for the forms accepted), after
    check_bucket: `create=False` refuses a folder bucket that does not exist."""
    endpoint_url = endpoint_url or os.environ.get("VRL_ENDPOINT_URL") or None
    check_bucket(uri, endpoint_url, create)
    folder = local_folder(uri)
    if folder is not None:
        inner: Storage = LocalStorage(folder)
    elif uri.startswith("s3://") and os.environ.get("VRL_S3_BACKEND", "") != "fsspec":
        from volunteer_rl.storage.s3 import (
            S3Storage,  # boto3: conditional writes, ETag polls, multipart
        )

        inner = S3Storage(uri, endpoint_url=endpoint_url)
    else:
        from volunteer_rl.storage.fsspec import FsspecStorage  # fsspec and its file systems

        inner = FsspecStorage(uri, endpoint_url=endpoint_url)
    return Retrying(inner) if retry else inner
