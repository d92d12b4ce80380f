"""The storage contract (helpers/storage_contract.py) on every backend: a folder, fsspec's
memory file system, and S3 over HTTP (moto's server on 127.0.0.1) through both of its code
paths, boto3 (S3Storage) and s3fs (FsspecStorage, what VRL_S3_BACKEND=fsspec picks); the
folder and boto3 again behind a bandwidth cap (pace.Paced), which must change nothing else.

Refusals are real on S3: moto enforces IAM and knows no user of the stores' keys, so it
answers 403. The folder and memory backends are refused where the operating system or the
file system would do it: tests run as root here, whom no file mode refuses, and memory://
has no permissions at all.
"""

from __future__ import annotations

import contextlib
import errno
import uuid
from dataclasses import dataclass
from typing import Iterator
from unittest import mock

import moto.server  # noqa: F401  (a hard test dependency: a broken install fails here)
import pytest

from helpers import storage_contract as contract
from volunteer_rl.storage.fsspec import FsspecStorage
from volunteer_rl.storage.local import LocalStorage
from volunteer_rl.storage.pace import Paced, TokenBucket
from volunteer_rl.storage.s3 import S3Storage

BUCKET = "vrl-contract-test"
URI = f"s3://{BUCKET}/some/prefix"


@dataclass
class Backend:
    make: contract.Make
    deny: contract.Deny


def _eacces(*args, **kwargs):
    raise PermissionError(errno.EACCES, "Permission denied")


@contextlib.contextmanager
def _refuse_folder(store: LocalStorage) -> Iterator[None]:
    """EACCES for every path of the bucket, as a folder the process may not enter gives."""
    with mock.patch.object(store, "_path", side_effect=_eacces):
        yield


@contextlib.contextmanager
def _refuse_memory(store: FsspecStorage) -> Iterator[None]:
    """A file system that refuses to read, as s3fs and gcsfs report a 403."""
    with mock.patch.object(store.fs, "cat_file", side_effect=_eacces):
        yield


@pytest.fixture(scope="module")
def endpoint():
    with contract.moto_s3() as url:
        yield url


FAST = 1e9
"""A cap (bytes per second) that paces without slowing the checks: the paced backends run
every read and write through pace.Paced's code paths, pieces and sinks."""


@pytest.fixture(params=["folder", "folder-paced", "memory", "s3-boto3", "s3-boto3-paced",
                        "s3-s3fs"])
def backend(request, tmp_path) -> Backend:
    if request.param == "folder":
        return Backend(lambda: LocalStorage(tmp_path / "bucket"), _refuse_folder)
    if request.param == "folder-paced":
        return Backend(lambda: Paced(LocalStorage(tmp_path / "bucket"), TokenBucket(FAST),
                                     TokenBucket(FAST)),
                       lambda store: _refuse_folder(store.inner))
    if request.param == "memory":
        return Backend(lambda: FsspecStorage(f"memory://contract-{uuid.uuid4().hex}/pre"),
                       _refuse_memory)
    endpoint = request.getfixturevalue("endpoint")
    kind = FsspecStorage if request.param == "s3-s3fs" else S3Storage

    def make():
        contract.empty_bucket(endpoint, BUCKET)
        store = kind(URI, endpoint_url=endpoint)
        if request.param.endswith("-paced"):
            return Paced(store, TokenBucket(FAST), TokenBucket(FAST))
        return store
    return Backend(make, lambda store: contract.iam_denies_everything(endpoint))


CHECKS = [
    contract.check_write_read_size_exists_delete,
    contract.check_missing_objects_are_not_found,
    contract.check_create_is_write_once,
    contract.check_compare_and_swap,
    contract.check_read_if_changed,
    contract.check_capped_reads,
    contract.check_streamed_create_and_read_into,
    contract.check_listing_is_recursive_relative_sorted_under_the_prefix,
    contract.check_bounded_listing_and_one_level,
    contract.check_delete_many_removes_a_batch_and_skips_missing_keys,
]
"""The checks every backend passes with nothing but a factory of fresh stores."""


@pytest.mark.parametrize("check", CHECKS, ids=lambda check: check.__name__.removeprefix("check_"))
def test_contract(backend, check):
    check(backend.make)


def test_refused_reads_are_forbidden(backend):
    contract.check_refused_reads_are_forbidden(backend.make, backend.deny)


def test_retrying_retries_transient_failures_only(backend):
    contract.check_retrying_retries_transient_failures_only(backend.make, backend.deny)
