"""The S3 backends against moto's S3 server over HTTP on 127.0.0.1: what is S3's own.

The Storage contract runs on both S3 backends, S3Storage (boto3, storage/s3.py) and
FsspecStorage (s3fs), in test_storage_contract.py. Here: where keys land in the bucket, the
requests S3Storage sends for its conditional operations (the 304 manifest poll) and big
objects (the multipart tests shrink the part size to 5 MiB, S3's minimum, so a 12 MiB object
takes three parts), and how S3's answers and network faults are classified.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import boto3
import moto.server  # noqa: F401  (a hard test dependency: a broken install fails here)
import pytest
from botocore.config import Config  # noqa: E402
from botocore.exceptions import (  # noqa: E402
    ClientError,
    ConnectionClosedError,
    EndpointConnectionError,
    ReadTimeoutError,
    SSLError,
)
from botocore.stub import Stubber  # noqa: E402

from helpers.storage_contract import empty_bucket, moto_s3  # noqa: E402
from volunteer_rl.storage import s3_errors, s3_transfer  # noqa: E402
from volunteer_rl.storage.base import (  # noqa: E402
    AlreadyExists,
    Forbidden,
    NotFound,
    PreconditionFailed,
    ShortObject,
    StorageError,
    TooLarge,
    Transient,
    is_missing,
)
from volunteer_rl.storage.fsspec import FsspecStorage  # noqa: E402
from volunteer_rl.storage.retry import Retrying  # noqa: E402
from volunteer_rl.storage.s3 import S3Storage  # noqa: E402
from volunteer_rl.storage.s3_transfer import expected_etag  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BUCKET = "vrl-s3-test"
URI = f"s3://{BUCKET}/some/prefix"
MiB = 1024 * 1024


# --- fixtures ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def endpoint():
    """moto's S3 server for this module, with fake credentials in the environment."""
    with moto_s3() as url:
        yield url


@pytest.fixture
def admin(endpoint):
    """A plain boto3 client on a fresh, empty bucket (the server's state is reset first)."""
    return empty_bucket(endpoint, BUCKET)


@pytest.fixture
def store(admin, endpoint) -> S3Storage:
    return S3Storage(URI, endpoint_url=endpoint)


@pytest.fixture(params=["boto3", "s3fs"])
def any_store(request, admin, endpoint):
    """Each S3 backend on the same bucket and URI prefix."""
    if request.param == "boto3":
        return S3Storage(URI, endpoint_url=endpoint)
    return FsspecStorage(URI, endpoint_url=endpoint)


@pytest.fixture
def small_parts(monkeypatch):
    """Multipart from 5 MiB on, in 5 MiB parts: a 12 MiB object becomes 5 + 5 + 2 MiB."""
    monkeypatch.setattr(s3_transfer, "MULTIPART_THRESHOLD", 5 * MiB)
    monkeypatch.setattr(s3_transfer, "PART_SIZE", 5 * MiB)
    monkeypatch.setattr(s3_transfer, "MIN_PART", 5 * MiB)


class Requests:
    """Every request a boto3 client sends, and the HTTP status of every answer."""

    def __init__(self, client):
        self.sent: list[tuple[str, dict]] = []
        self.statuses: list[tuple[str, int]] = []
        client.meta.events.register("before-send.s3.*", self._before_send)
        client.meta.events.register("after-call.s3.*", self._after_call)

    def _before_send(self, request, **kwargs):
        operation = kwargs["event_name"].rsplit(".", 1)[1]
        self.sent.append((operation, {k.lower(): v for k, v in request.headers.items()}))

    def _after_call(self, http_response, model, **kwargs):
        self.statuses.append((model.name, http_response.status_code))

    def named(self, operation: str) -> list[dict]:
        return [headers for op, headers in self.sent if op == operation]

    def clear(self) -> None:
        self.sent.clear()
        self.statuses.clear()


def _header(headers: dict, name: str) -> str:
    value = headers.get(name)
    return value.decode() if isinstance(value, bytes) else value


# --- where keys land, listings ----------------------------------------------------------

def test_keys_live_under_the_uri_prefix_in_the_bucket(any_store, admin):
    for key in ("r/v000001/vol/b.gz", "r/v000001/vol/a.gz", "rr/other"):
        any_store.write(key, b"1")
    listed = admin.list_objects_v2(Bucket=BUCKET)["Contents"]
    assert sorted(o["Key"] for o in listed)[0] == "some/prefix/r/v000001/vol/a.gz"


def test_list_pages_past_a_thousand_keys(store, admin):
    for i in range(1005):
        admin.put_object(Bucket=BUCKET, Key=f"some/prefix/many/{i:05d}", Body=b"")
    keys = store.list("many")
    assert len(keys) == 1005 and keys[0] == "many/00000" and keys[-1] == "many/01004"


def test_a_bounded_listing_stops_paging(store, admin):
    for i in range(1100):
        admin.put_object(Bucket=BUCKET, Key=f"some/prefix/many/{i:05d}", Body=b"")
    pages = []
    store.client.meta.events.register(
        "provide-client-params.s3.ListObjectsV2", lambda params, **kw: pages.append(params.get("MaxKeys")))
    assert store.list("many", limit=5) == [f"many/{i:05d}" for i in range(5)]
    assert pages == [5]
    pages.clear()
    assert store.list("many", limit=1025) == [f"many/{i:05d}" for i in range(1025)]
    assert pages == [513, 513]  # not 1,100 keys, nor two pages of 1,000
    pages.clear()
    assert store.list_level("") == ["many/"] and len(pages) == 1  # one entry for 1,100 keys


# --- S3Storage: conditional operations ---------------------------------------------------

def test_read_if_changed_is_one_conditional_get_answered_304(store):
    etag = store.write_if_match("manifest.json", b"v1", None)
    data, seen = store.read_if_changed("manifest.json", None)
    assert (data, seen) == (b"v1", etag)
    requests = Requests(store.client)
    assert store.read_if_changed("manifest.json", seen) == (None, seen)
    assert [op for op, _ in requests.sent] == ["GetObject"]
    assert _header(requests.named("GetObject")[0], "if-none-match") == seen
    assert requests.statuses == [("GetObject", 304)]             # no body crossed the wire
    e2 = store.write_if_match("manifest.json", b"v2", seen)
    assert store.read_if_changed("manifest.json", seen) == (b"v2", e2)
    with pytest.raises(NotFound, match="missing"):
        store.read_if_changed("missing", None)


# --- S3Storage: big objects -------------------------------------------------------------

def test_multipart_write_then_one_streamed_get_on_a_fast_link(store, admin, small_parts):
    data = os.urandom(12 * MiB)
    requests = Requests(store.client)
    store.write("checkpoints/v000001/model.safetensors", data)  # the first big upload: multipart
    assert len(requests.named("UploadPart")) == 3
    full = "some/prefix/checkpoints/v000001/model.safetensors"
    etag = admin.head_object(Bucket=BUCKET, Key=full)["ETag"]
    assert etag.endswith('-3"') and etag == expected_etag(data)
    requests.clear()
    assert store.read("checkpoints/v000001/model.safetensors") == data
    [get] = requests.named("GetObject")  # loopback: one stream is done long before SPLIT_SECONDS
    assert _header(get, "range") is None


def test_a_slow_stream_splits_into_ranged_gets_pinned_to_the_etag(store, admin, small_parts,
                                                                   monkeypatch):
    monkeypatch.setattr(s3_transfer, "PROBE_BYTES", 2 * MiB)  # two 1 MiB chunks, then every stream
    monkeypatch.setattr(s3_transfer, "SPLIT_SECONDS", 0.0)   # counts as slow
    data = os.urandom(12 * MiB)
    store.write("big.bin", data)
    etag = admin.head_object(Bucket=BUCKET, Key="some/prefix/big.bin")["ETag"]
    requests = Requests(store.client)
    assert store.read("big.bin") == data
    gets = requests.named("GetObject")
    # after its first 2 MiB the stream keeps the next 5 MiB; 7-12 MiB comes ranged
    assert sorted(str(_header(h, "range")) for h in gets) == ["None", "bytes=7340032-12582911"]
    assert sum(_header(h, "if-match") == etag for h in gets) == 1


def test_big_reads_take_bytes_from_the_socket_straight_into_the_buffer(store, admin):
    admin.put_object(Bucket=BUCKET, Key="some/prefix/x.bin", Body=b"0123456789")
    body = store.client.get_object(Bucket=BUCKET, Key="some/prefix/x.bin")["Body"]
    readinto = s3_transfer._socket_reader(body)
    assert readinto.__qualname__ == "HTTPResponse.readinto"  # http.client's, under urllib3
    assert readinto.__self__ is body._raw_stream._fp
    view = memoryview(bytearray(10))
    assert s3_transfer._fill("x.bin", readinto, view, 0, 10) == 10 and bytes(view) == b"0123456789"
    body.close()


def test_a_wrapped_body_is_read_through_its_own_read(store, admin):
    from botocore.response import StreamingBody

    class Checked(StreamingBody):  # stands for botocore's checksum-validating body
        pass

    admin.put_object(Bucket=BUCKET, Key="some/prefix/x.bin", Body=b"0123456789")
    raw = store.client.get_object(Bucket=BUCKET, Key="some/prefix/x.bin")["Body"]
    body = Checked(raw._raw_stream, 10)
    readinto = s3_transfer._socket_reader(body)
    assert readinto.__qualname__ != "HTTPResponse.readinto"
    view = memoryview(bytearray(10))
    assert s3_transfer._fill("x.bin", readinto, view, 0, 10) == 10 and bytes(view) == b"0123456789"
    with pytest.raises(StorageError, match="x.bin: connection closed after 10 of 11 bytes"):
        s3_transfer._fill("x.bin", readinto, memoryview(bytearray(11)), 10, 11)


def test_upload_choice_tries_both_methods_then_keeps_the_faster():
    choice = s3_transfer.UploadChoice()
    size = 100 * MiB
    assert choice.pick(size) == "multipart"
    choice.record("multipart", size, 2.0)
    assert choice.pick(size) == "single"
    choice.record("single", size, 1.0)
    picks = []
    for _ in range(20):
        picks.append(choice.pick(size))
        choice.record(picks[-1], size, 1.0 if picks[-1] == "single" else 2.0)
    assert picks.count("single") == 18 and picks.count("multipart") == 2  # retried 1 in 10
    assert choice.pick(s3_transfer.MAX_SINGLE_PUT + 1) == "multipart"  # over S3's PUT limit
    assert s3_transfer.UploadChoice(fixed="single").pick(size) == "single"


def test_big_single_put_is_recognised_as_ours_after_a_retry(store, small_parts):
    store.upload_choice = s3_transfer.UploadChoice(fixed="single")
    data = os.urandom(6 * MiB)
    store.create("one-put.bin", data)
    assert store._is_ours("one-put.bin", data) == expected_etag(data, multipart=False)
    assert store._is_ours("one-put.bin", os.urandom(6 * MiB)) is None


def test_streamed_create_uploads_parts_while_writing_and_reads_back_into_a_buffer(
        store, admin, small_parts):
    key = "checkpoints/v000001/model.safetensors"
    data = os.urandom(12 * MiB)
    requests = Requests(store.client)
    # written in odd-sized pieces: the sink cuts 5 MiB parts itself
    store.create_from(key, lambda f: [f.write(data[i:i + 3 * MiB + 7])
                                      for i in range(0, len(data), 3 * MiB + 7)])
    assert len(requests.named("UploadPart")) == 3
    [complete] = requests.named("CompleteMultipartUpload")
    assert _header(complete, "if-none-match") == "*"
    assert admin.head_object(Bucket=BUCKET, Key=f"some/prefix/{key}")["ETag"] == expected_etag(data)
    buf, pieces = bytearray(len(data)), []
    store.read_into(key, memoryview(buf), lambda off, piece: pieces.append((off, bytes(piece))))
    assert bytes(buf) == data
    ends = [0] + [off + len(p) for off, p in pieces[:-1]]
    assert [off for off, _ in pieces] == ends  # in order, each byte once
    assert b"".join(p for _, p in pieces) == data
    with pytest.raises(AlreadyExists, match=key):
        store.create_from(key, lambda f: f.write(b"x" * (6 * MiB)))
    assert admin.list_multipart_uploads(Bucket=BUCKET).get("Uploads", []) == []
    with pytest.raises(TooLarge):
        store.read_into(key, memoryview(bytearray(len(data) - 1)))
    with pytest.raises(ShortObject):
        store.read_into(key, memoryview(bytearray(len(data) + 1)))


def test_a_small_streamed_create_is_one_put(store):
    requests = Requests(store.client)
    store.create_from("a.json", lambda f: f.write(b"{}"))
    assert [op for op, _ in requests.sent] == ["PutObject"]
    buf = bytearray(2)
    store.read_into("a.json", memoryview(buf))
    assert bytes(buf) == b"{}"


def test_a_failing_writer_leaves_no_object_and_no_upload(store, admin, small_parts):
    def write(f):
        f.write(os.urandom(11 * MiB))
        raise RuntimeError("serializer died")
    with pytest.raises(RuntimeError):
        store.create_from("x.bin", write)
    assert not store.exists("x.bin")
    assert admin.list_multipart_uploads(Bucket=BUCKET).get("Uploads", []) == []


def test_multipart_create_is_write_once_and_leaves_no_upload_behind(store, admin, small_parts):
    key = "checkpoints/v000001/model.safetensors"
    first, second = os.urandom(12 * MiB), os.urandom(11 * MiB)
    store.create(key, first)
    with pytest.raises(AlreadyExists, match=key):
        store.create(key, second)
    assert hashlib.sha256(store.read(key)).digest() == hashlib.sha256(first).digest()
    assert store.list("checkpoints") == [key]
    assert admin.list_multipart_uploads(Bucket=BUCKET).get("Uploads", []) == []


def test_multipart_compare_and_swap_puts_the_condition_on_complete(store, small_parts):
    store.upload_choice = s3_transfer.UploadChoice(fixed="multipart")
    e1 = store.write_if_match("big.bin", os.urandom(6 * MiB), None)
    with pytest.raises(PreconditionFailed):                     # If-None-Match: * (enforced)
        store.write_if_match("big.bin", os.urandom(6 * MiB), None)
    requests = Requests(store.client)
    new = os.urandom(7 * MiB)
    assert store.write_if_match("big.bin", new, e1) == expected_etag(new)
    assert store.read("big.bin") == new
    # moto 5.2 ignores If-Match on CompleteMultipartUpload (AWS enforces it): check the header.
    [complete] = requests.named("CompleteMultipartUpload")
    assert _header(complete, "if-match") == e1


def test_read_cap_on_a_big_object_sends_one_capped_get(store, small_parts):
    data = os.urandom(12 * MiB)
    store.write("big.bin", data)
    requests = Requests(store.client)
    with pytest.raises(TooLarge, match="big.bin"):
        store.read("big.bin", max_bytes=MiB)
    assert [_header(h, "range") for h in requests.named("GetObject")] == [f"bytes=0-{MiB}"]
    assert store.read("big.bin", max_bytes=len(data)) == data


# --- S3Storage: errors and retries ------------------------------------------------------

def test_access_denied_is_forbidden_naming_key_and_bucket(store):
    """A 403 AccessDenied, what S3 answers a reader without list permission for a key that
    does not exist (moto's IAM enforcement in test_storage_contract.py makes real ones)."""
    with Stubber(store.client) as stub:
        stub.add_client_error("get_object", service_error_code="AccessDenied",
                              service_message="Access Denied", http_status_code=403)
        with pytest.raises(Forbidden, match=f"manifest.json.*{BUCKET}") as caught:
            store.read("manifest.json")
    assert is_missing(caught.value)


def _client_error(code: str, status: int) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": code},
                        "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")


def test_which_s3_faults_are_transient():
    for exc in (_client_error("SlowDown", 503), _client_error("InternalError", 500),
                _client_error("BadGateway", 502), _client_error("TooManyRequests", 429),
                _client_error("RequestTimeout", 400), _client_error("Throttling", 400),
                EndpointConnectionError(endpoint_url="http://127.0.0.1:9"),
                ConnectionClosedError(endpoint_url="http://127.0.0.1:9"),
                ReadTimeoutError(endpoint_url="http://127.0.0.1:9"),
                ConnectionResetError("reset by peer"), TimeoutError("timed out")):
        assert s3_errors.is_transient(exc), exc
    for exc in (_client_error("AccessDenied", 403), _client_error("NoSuchKey", 404),
                _client_error("PreconditionFailed", 412), _client_error("InvalidRange", 416),
                SSLError(endpoint_url="https://s3.example.org", error="certificate expired"),
                ValueError("x")):
        assert not s3_errors.is_transient(exc), exc


def test_a_throttled_request_is_transient_and_retried(store):
    with Stubber(store.client) as stub:
        for _ in range(2):
            stub.add_client_error("head_object", service_error_code="SlowDown",
                                  service_message="Please reduce your request rate.",
                                  http_status_code=503)
        stub.add_response("head_object", {"ContentLength": 5})
        with pytest.raises(Transient, match=f"manifest.json: size failed in {URI}: .*SlowDown"):
            store.size("manifest.json")
        assert Retrying(store, sleep=lambda t: None).size("manifest.json") == 5
        stub.assert_no_pending_responses()


def test_a_server_that_cannot_be_reached_is_transient():
    store = S3Storage(URI, endpoint_url="http://127.0.0.1:9")  # nothing listens on port 9
    store.client = boto3.client("s3", endpoint_url="http://127.0.0.1:9",
                                config=Config(retries={"max_attempts": 1}, connect_timeout=2))
    with pytest.raises(Transient, match="manifest.json: read failed in .*127.0.0.1:9") as caught:
        store.read("manifest.json")
    assert isinstance(caught.value.__cause__, EndpointConnectionError)
    assert "\n" not in str(caught.value) and not is_missing(caught.value)


def test_s3fs_errors_are_classified_by_the_s3_rule(admin, endpoint, monkeypatch):
    """s3fs maps S3's codes onto OSError types; an answer it has no type for (a 502) comes as
    OSError(EIO) with the ClientError as its cause, which the S3 rule classifies."""
    from s3fs.errors import translate_boto_error

    store = FsspecStorage(URI, endpoint_url=endpoint)
    for code, status, kind in (("BadGateway", 502, Transient), ("SlowDown", 503, Transient),
                               ("AccessDenied", 403, Forbidden)):
        def answer(*args, **kwargs):
            raise translate_boto_error(_client_error(code, status))
        monkeypatch.setattr(store.fs, "cat_file", answer)
        with pytest.raises(kind, match="manifest.json"):
            store.read("manifest.json")


def _first_attempt_lands_but_its_answer_is_lost(client, operation: str) -> None:
    """Send the first `operation` request for real, then report a dropped connection, so
    botocore retries a request that has already taken effect."""
    state = {"done": False}

    def hook(request, **kwargs):
        if state["done"]:
            return None
        state["done"] = True
        headers = {k: v.decode() if isinstance(v, bytes) else v
                   for k, v in request.headers.items() if k.lower() != "expect"}
        headers.setdefault("Content-Type", "binary/octet-stream")  # else urllib says "form"
        body = request.body
        if hasattr(body, "read"):  # botocore hands the body over as a seekable stream
            position = body.tell()
            body, _ = body.read(), body.seek(position)
        sent = urllib.request.Request(request.url, data=body, headers=headers,
                                      method=request.method)
        urllib.request.build_opener(urllib.request.ProxyHandler({})).open(sent).read()
        raise ConnectionClosedError(endpoint_url=request.url)

    client.meta.events.register(f"before-send.s3.{operation}", hook)


def test_a_retried_create_that_had_landed_is_not_a_conflict(store):
    _first_attempt_lands_but_its_answer_is_lost(store.client, "PutObject")
    store.create("rollouts/v000001/vol/s.jsonl.gz", b"shard")
    assert store.read("rollouts/v000001/vol/s.jsonl.gz") == b"shard"


def test_a_retried_swap_that_had_landed_returns_the_new_etag(store):
    e1 = store.write_if_match("manifest.json", b"v1", None)
    _first_attempt_lands_but_its_answer_is_lost(store.client, "PutObject")
    e2 = store.write_if_match("manifest.json", b"v2", e1)
    assert e2 == expected_etag(b"v2") and store.read("manifest.json") == b"v2"


def test_importing_the_module_does_not_import_boto3():
    code = "import sys, volunteer_rl.storage.s3; assert 'boto3' not in sys.modules, 'boto3 imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_uri_without_prefix_uses_the_bucket_root(admin, endpoint):
    store = S3Storage(f"s3://{BUCKET}/", endpoint_url=endpoint)
    assert store.uri == f"s3://{BUCKET}"
    store.write("manifest.json", b"{}")
    store.write("r/a", b"1")
    assert admin.get_object(Bucket=BUCKET, Key="manifest.json")["Body"].read() == b"{}"
    assert store.list("") == ["manifest.json", "r/a"] and store.list("r") == ["r/a"]


def test_retention_steps_over_an_object_a_bucket_policy_keeps_and_goes_on(store, admin):
    """A bucket policy denies deleting one shard of v1: DeleteObjects answers AccessDenied for
    that key alone. The trainer's pass names it, deletes everything else that expired
    (checkpoints included) and moves on; the next pass does not ask again."""
    import json

    from volunteer_rl.protocol import layout
    from volunteer_rl.protocol.manifest import Dataset, Manifest, Sampling, TaskRef
    from volunteer_rl.trainer.retention import TrainerRetention

    def manifest(v):
        return Manifest(task=TaskRef("calculator", "volunteer-rl", "0.1.0"), run_id="run-x",
                        version=v, checkpoint=layout.checkpoint_prefix(v), files={},
                        dataset=Dataset("train", "datasets/train-abc.csv", "ab" * 32, 10, 1),
                        sampling=Sampling(2, 1.0, 8), max_staleness=1)

    for v in range(6):
        store.write(layout.checkpoint_key(v, "config.json"), b"{}")
        store.write(layout.shard_key(v, "vol-1", f"0000000000001-{v:06d}-00000000"), b"s")
        store.write(layout.manifest_history_key(v), manifest(v).to_json())
    kept = layout.shard_key(1, "vol-1", "0000000000001-000001-00000000")
    admin.put_bucket_policy(Bucket=BUCKET, Policy=json.dumps({"Version": "2012-10-17", "Statement": [
        {"Effect": "Deny", "Principal": "*", "Action": "s3:DeleteObject",
         "Resource": f"arn:aws:s3:::{BUCKET}/{store.full_key(kept)}"}]}))
    logs = []
    r = TrainerRetention(Retrying(store, sleep=lambda s: None), keep_versions=2, every=1,
                         log=logs.append)
    out = r.run_pass(manifest(5))
    assert [k for k, _ in out.failed] == [kept] and "AccessDenied" in out.failed[0][1]
    assert logs[0] == "retention: removed 7 objects; kept v4-v5; could not delete 1 object"
    assert {layout.split_versioned_key(k)[1] for k in store.list("checkpoints")} == {4, 5}
    assert kept in store.list("rollouts")
    assert {layout.split_versioned_key(k)[1] for k in store.list("rollouts")} == {1, 4, 5}
    logs.clear()
    assert not r.run_pass(manifest(5)).failed and logs == []
