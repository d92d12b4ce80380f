"""The bucket: one small interface (read, create-only write, compare-and-swap, list, delete)
and its backends (a local folder, any fsspec filesystem, S3), plus retry as a wrapper.

Knows nothing of what the objects mean; that is protocol's job.

    base.py         the Storage interface, its errors, is_missing
    local.py        a folder (the embedded default)
    fsspec.py       any fsspec file system (gs://, memory://, s3:// through s3fs)
    s3.py           S3 and S3-compatible stores through boto3, with real conditional writes
    s3_transfer.py  S3's big objects at the link's speed: split reads, multipart uploads
    s3_errors.py    what S3's answers mean, and which are worth another try
    retry.py        Retrying: Transient failures tried again
    here            open_storage: the storage for a bucket URI

A bucket is addressed by URI: a plain folder path or `file://` (the embedded default, no
server), `s3://bucket/prefix` (boto3; `endpoint_url` for MinIO, R2 and other S3-compatible
stores; s3fs with VRL_S3_BACKEND=fsspec), `gs://bucket/prefix` (gcsfs), or `memory://name`
for unit tests. Keys are always relative, `/`-separated, and built by `layout`.

May import: the shared modules (errors, faults) only.
"""

from __future__ import annotations

import os

from volunteer_rl.storage.base import Storage, StorageError
from volunteer_rl.storage.local import LocalStorage
from volunteer_rl.storage.retry import Retrying


def open_storage(uri: str, endpoint_url: str | None = None, retry: bool = True) -> Storage:
    """The storage for a bucket URI (see the module docstring for the forms accepted)."""
    if not uri:
        raise StorageError("--bucket is empty: give a folder path or a URI such as s3://bucket")
    endpoint_url = endpoint_url or os.environ.get("VRL_ENDPOINT_URL") or None
    if "://" not in uri:
        inner: Storage = LocalStorage(uri)
    elif uri.startswith("file://"):
        inner = LocalStorage(uri[len("file://"):])
    elif uri.startswith("s3://") and os.environ.get("VRL_S3_BACKEND", "") != "fsspec":
        from volunteer_rl.storage.s3 import (
            S3Storage,  # boto3: conditional writes, ETag polls, multipart
        )

        inner = S3Storage(uri, endpoint_url=endpoint_url)
    elif uri.split("://", 1)[0] in ("s3", "gs", "gcs", "memory", "az", "abfs"):
        from volunteer_rl.storage.fsspec import FsspecStorage  # fsspec and its file systems

        inner = FsspecStorage(uri, endpoint_url=endpoint_url)
    else:
        raise StorageError(f"--bucket {uri}: unsupported scheme "
                           "(use a folder, file://, s3://, gs:// or memory://)")
    return Retrying(inner) if retry else inner
