"""The bucket: one small interface (read, create-only write, compare-and-swap, list, delete)
and its backends (a local folder, any fsspec filesystem, S3), plus retry and bandwidth caps as
wrappers.

Knows nothing of what the objects mean; that is protocol's job.

    base.py         the Storage interface, its errors, is_missing
    local.py        a folder (the embedded default)
    fsspec.py       any fsspec file system (gs://, memory://, s3:// through s3fs)
    s3.py           S3 and S3-compatible stores through boto3, with real conditional writes
    s3_transfer.py  S3's big objects at the link's speed: split reads, multipart uploads
    s3_errors.py    what S3's answers mean, and which are worth another try
    retry.py        Retrying: Transient failures tried again
    pace.py         Paced: reads and writes held to a rate in bytes per second (a token bucket)
    uri.py          check_bucket and open_storage: what a bucket URI may be, and its storage

The package's face is `open_storage(uri)`, the storage of a bucket URI. Keys are always
relative, `/`-separated, and built by `layout`.

May import: the shared modules (errors, faults) only.
"""

from volunteer_rl.storage.uri import open_storage

__all__ = ["open_storage"]
