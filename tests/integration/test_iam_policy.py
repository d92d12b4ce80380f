"""The deployed IAM policies, checked against an S3 server that enforces IAM.

The policy documents are rendered from the same JSON templates terraform deploys
(terraform/aws/policies/*.json.tftpl; the MinIO module's differ only by one statement MinIO
cannot express, see test_terraform.py), attached the way the AWS module attaches them (a
managed policy per volunteer, a group policy for the trainer), and exercised with each
identity's own keys against moto's S3 server with IAM enforcement on. Every denial moto can evaluate is
checked twice: the AccessDenied error, and the bucket's content afterwards as seen with admin
keys.

moto cannot evaluate the statements with a Condition (test_moto_cannot_evaluate_s3_conditions
shows how it gets them wrong), so the volunteers of the moto world carry their policy without
its conditional denies, and those denies and the trainer's s3:prefix condition are checked on
the rendered documents instead, with AWS's documented rules for the operators they use
(`_applying`), against the requests vrl itself sends.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import boto3
import moto.server  # noqa: F401  (a hard test dependency: a broken install fails here)
import pytest
from botocore.config import Config  # noqa: E402
from botocore.exceptions import ClientError  # noqa: E402

from helpers.vrlproc import load_infra  # noqa: E402
from volunteer_rl.observe.dashboard import read_history
from volunteer_rl.protocol import layout
from volunteer_rl.protocol.manifest import Dataset, Manifest, Sampling, TaskRef
from volunteer_rl.storage.s3 import S3Storage
from volunteer_rl.trainer.retention import TrainerRetention

ROOT = Path(__file__).resolve().parents[2]
POLICIES = ROOT / "terraform" / "aws" / "policies"
REGION = "us-east-1"
BUCKET = "vrl-iam-policy-test"
BUCKET_ARN = f"arn:aws:s3:::{BUCKET}"
KEY_PREFIX = ""  # the modules' default; test_terraform.py renders a non-empty prefix too

MANIFEST = b'{"version": 1, "checkpoint": "checkpoints/v000001/"}'
CHECKPOINT = b"weights-v1"
DATASET = b"prompt,answer\n1+1,2\n"
HEARTBEAT_B = b'{"volunteer": "vol-b"}'


s3_server = load_infra("s3_server")
policy_template = load_infra("policy_template")


def volunteer_policy(volunteer_id: str) -> dict:
    return policy_template.render_policy(
        POLICIES / "volunteer.json.tftpl",
        bucket_arn=BUCKET_ARN,
        key_prefix=KEY_PREFIX,
        volunteer_id=volunteer_id,
    )


def trainer_policy(key_prefix: str = KEY_PREFIX) -> dict:
    return policy_template.render_policy(
        POLICIES / "trainer.json.tftpl", bucket_arn=BUCKET_ARN, key_prefix=key_prefix
    )


# The volunteer's denies that hang on a request header. moto would apply each of them to every
# upload (see test_moto_cannot_evaluate_s3_conditions), so the moto world leaves them out and
# the tests under "conditions" check them on the document.
CONDITIONAL_DENIES = {
    "DenyRolloutWritesWithoutIfNoneMatch",
    "DenyStorageClassesOtherThanStandard",
    "DenyCustomerProvidedKeys",
}


def as_moto_evaluates(policy: dict) -> dict:
    """`policy` without its conditional Deny statements, which must be exactly CONDITIONAL_DENIES:
    a new one has to be given a test of its own before the moto tests can ignore it."""
    kept = [s for s in policy["Statement"] if not (s["Effect"] == "Deny" and "Condition" in s)]
    dropped = {s["Sid"] for s in policy["Statement"]} - {s["Sid"] for s in kept}
    assert dropped == CONDITIONAL_DENIES, dropped
    return {**policy, "Statement": kept}


def _client(service: str, endpoint_url: str, key_id: str, secret: str):
    return boto3.client(
        service,
        endpoint_url=endpoint_url,
        region_name=REGION,
        aws_access_key_id=key_id,
        aws_secret_access_key=secret,
        config=Config(retries={"max_attempts": 1}, s3={"addressing_style": "path"}),
    )


def _key_of(iam, user: str) -> tuple[str, str]:
    key = iam.create_access_key(UserName=user)["AccessKey"]
    return key["AccessKeyId"], key["SecretAccessKey"]


@pytest.fixture(scope="module")
def endpoint_url():
    server, url = s3_server.start_s3_server()
    try:
        yield url
    finally:
        server.stop()


@pytest.fixture(scope="module")
def world(endpoint_url):
    """Bucket with trainer-written objects, an admin, the trainer and volunteers vol-a, vol-b.

    IAM enforcement is switched on for the tests of this module and off again afterwards,
    and everything created here is removed, so later tests in this process see moto as usual.
    """
    s3_server.disable_iam_auth(endpoint_url)
    iam = _client("iam", endpoint_url, "testing", "testing")
    setup = _client("s3", endpoint_url, "testing", "testing")

    iam.create_user(UserName="vrl-test-admin")
    iam.put_user_policy(
        UserName="vrl-test-admin",
        PolicyName="admin",
        PolicyDocument=json.dumps(
            {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
        ),
    )
    admin_keys = _key_of(iam, "vrl-test-admin")

    setup.create_bucket(Bucket=BUCKET)
    setup.put_bucket_versioning(Bucket=BUCKET, VersioningConfiguration={"Status": "Enabled"})
    setup.put_object(Bucket=BUCKET, Key="manifest.json", Body=MANIFEST)
    setup.put_object(Bucket=BUCKET, Key="checkpoints/v000001/model.safetensors", Body=CHECKPOINT)
    setup.put_object(Bucket=BUCKET, Key="datasets/calc-0123456789ab.csv", Body=DATASET)
    setup.put_object(Bucket=BUCKET, Key="volunteers/vol-b.json", Body=HEARTBEAT_B)
    setup.put_object(Bucket=BUCKET, Key="rollouts/v000001/vol-b/s0.jsonl.gz", Body=b"b-shard")

    # The trainer as terraform/aws sets it up: a user in a group carrying the policy.
    iam.create_group(GroupName="vrl-trainers")
    iam.put_group_policy(
        GroupName="vrl-trainers",
        PolicyName="vrl-trainer-bucket-access",
        PolicyDocument=json.dumps(trainer_policy()),
    )
    iam.create_user(UserName="vrl-trainer")
    iam.add_user_to_group(GroupName="vrl-trainers", UserName="vrl-trainer")
    trainer_keys = _key_of(iam, "vrl-trainer")

    # Each volunteer: its own user with a managed policy rendered for its name, minus what moto
    # cannot evaluate. vol-a-as-deployed carries vol-a's policy whole, to show what moto makes
    # of the rest.
    volunteer_keys = {}
    for name, policy in (
        ("vol-a", as_moto_evaluates(volunteer_policy("vol-a"))),
        ("vol-b", as_moto_evaluates(volunteer_policy("vol-b"))),
        ("vol-a-as-deployed", volunteer_policy("vol-a")),
    ):
        user = f"vrl-volunteer-{name}"
        iam.create_user(UserName=user)
        arn = iam.create_policy(
            PolicyName=user, Path="/volunteer-rl/volunteers/", PolicyDocument=json.dumps(policy)
        )["Policy"]["Arn"]
        iam.attach_user_policy(UserName=user, PolicyArn=arn)
        volunteer_keys[name] = _key_of(iam, user)

    s3_server.enable_iam_auth(endpoint_url)
    try:
        yield {
            "endpoint_url": endpoint_url,
            "anonymous": _client("s3", endpoint_url, "testing", "testing"),
            "admin": _client("s3", endpoint_url, *admin_keys),
            "trainer": _client("s3", endpoint_url, *trainer_keys),
            "vol-a": _client("s3", endpoint_url, *volunteer_keys["vol-a"]),
            "vol-b": _client("s3", endpoint_url, *volunteer_keys["vol-b"]),
            "vol-a-as-deployed": _client("s3", endpoint_url, *volunteer_keys["vol-a-as-deployed"]),
        }
    finally:
        s3_server.disable_iam_auth(endpoint_url)
        _cleanup(setup, iam)


def _cleanup(s3, iam) -> None:
    versions = s3.list_object_versions(Bucket=BUCKET)
    for item in versions.get("Versions", []) + versions.get("DeleteMarkers", []):
        s3.delete_object(Bucket=BUCKET, Key=item["Key"], VersionId=item["VersionId"])
    s3.delete_bucket(Bucket=BUCKET)
    users = ("vrl-volunteer-vol-a", "vrl-volunteer-vol-b", "vrl-volunteer-vol-a-as-deployed")
    for user in ("vrl-test-admin", "vrl-trainer", *users):
        for key in iam.list_access_keys(UserName=user)["AccessKeyMetadata"]:
            iam.delete_access_key(UserName=user, AccessKeyId=key["AccessKeyId"])
        for policy in iam.list_user_policies(UserName=user)["PolicyNames"]:
            iam.delete_user_policy(UserName=user, PolicyName=policy)
        for attached in iam.list_attached_user_policies(UserName=user)["AttachedPolicies"]:
            iam.detach_user_policy(UserName=user, PolicyArn=attached["PolicyArn"])
            iam.delete_policy(PolicyArn=attached["PolicyArn"])
        for group in iam.list_groups_for_user(UserName=user)["Groups"]:
            iam.remove_user_from_group(GroupName=group["GroupName"], UserName=user)
        iam.delete_user(UserName=user)
    iam.delete_group_policy(GroupName="vrl-trainers", PolicyName="vrl-trainer-bucket-access")
    iam.delete_group(GroupName="vrl-trainers")


def _denied(call, *args, **kwargs) -> None:
    with pytest.raises(ClientError) as excinfo:
        call(*args, **kwargs)
    assert excinfo.value.response["Error"]["Code"] == "AccessDenied", excinfo.value.response


def _read(world, key: str) -> bytes:
    return world["admin"].get_object(Bucket=BUCKET, Key=key)["Body"].read()


def _absent(world, key: str) -> bool:
    try:
        world["admin"].head_object(Bucket=BUCKET, Key=key)
    except ClientError as exc:
        return exc.response["Error"]["Code"] in ("404", "NoSuchKey")
    return False


# --------------------------------------------------------------------------- sanity


def test_enforcement_is_on(world):
    """Keys of no IAM user are refused: otherwise every test below would pass vacuously."""
    with pytest.raises(ClientError):
        world["anonymous"].get_object(Bucket=BUCKET, Key="manifest.json")
    assert _read(world, "manifest.json") == MANIFEST


# --------------------------------------------------------------------------- volunteer: allowed


def test_volunteer_reads_manifest_checkpoints_and_datasets(world):
    vol = world["vol-a"]
    assert vol.get_object(Bucket=BUCKET, Key="manifest.json")["Body"].read() == MANIFEST
    key = "checkpoints/v000001/model.safetensors"
    assert vol.get_object(Bucket=BUCKET, Key=key)["Body"].read() == CHECKPOINT
    assert vol.get_object(Bucket=BUCKET, Key=key, Range="bytes=0-6")["Body"].read() == CHECKPOINT[:7]
    assert vol.get_object(Bucket=BUCKET, Key="datasets/calc-0123456789ab.csv")["Body"].read() == DATASET


def test_volunteer_uploads_own_shard_and_heartbeat(world):
    vol = world["vol-a"]
    vol.put_object(Bucket=BUCKET, Key="rollouts/v000001/vol-a/x.jsonl.gz", Body=b"a-shard", IfNoneMatch="*")
    vol.put_object(Bucket=BUCKET, Key="volunteers/vol-a.json", Body=b'{"n": 1}')
    vol.put_object(Bucket=BUCKET, Key="volunteers/vol-a.json", Body=b'{"n": 2}')  # heartbeats overwrite

    key = "rollouts/v000002/vol-a/big.jsonl.gz"
    upload = vol.create_multipart_upload(Bucket=BUCKET, Key=key)
    part = vol.upload_part(Bucket=BUCKET, Key=key, UploadId=upload["UploadId"], PartNumber=1, Body=b"p1")
    vol.complete_multipart_upload(
        Bucket=BUCKET,
        Key=key,
        UploadId=upload["UploadId"],
        MultipartUpload={"Parts": [{"ETag": part["ETag"], "PartNumber": 1}]},
    )

    assert _read(world, "rollouts/v000001/vol-a/x.jsonl.gz") == b"a-shard"
    assert _read(world, "volunteers/vol-a.json") == b'{"n": 2}'
    assert _read(world, key) == b"p1"


# --------------------------------------------------------------------------- volunteer: denied


def _manifest_versions(world) -> list[str]:
    listed = world["admin"].list_object_versions(Bucket=BUCKET, Prefix="manifest.json")
    return [v["VersionId"] for v in listed["Versions"]]


def test_volunteer_cannot_overwrite_manifest(world):
    vol = world["vol-a"]
    versions_before = _manifest_versions(world)
    _denied(vol.put_object, Bucket=BUCKET, Key="manifest.json", Body=b'{"version": 666}')
    _denied(vol.create_multipart_upload, Bucket=BUCKET, Key="manifest.json")
    _denied(
        vol.copy_object,
        Bucket=BUCKET,
        Key="manifest.json",
        CopySource={"Bucket": BUCKET, "Key": "checkpoints/v000001/model.safetensors"},
    )
    assert _read(world, "manifest.json") == MANIFEST
    assert _manifest_versions(world) == versions_before


def test_volunteer_cannot_write_checkpoints_or_datasets(world):
    vol = world["vol-a"]
    _denied(vol.put_object, Bucket=BUCKET, Key="checkpoints/v000002/model.safetensors", Body=b"evil")
    _denied(vol.put_object, Bucket=BUCKET, Key="checkpoints/v000001/model.safetensors", Body=b"evil")
    _denied(vol.put_object, Bucket=BUCKET, Key="datasets/calc-0123456789ab.csv", Body=b"evil")
    assert _absent(world, "checkpoints/v000002/model.safetensors")
    assert _read(world, "checkpoints/v000001/model.safetensors") == CHECKPOINT
    assert _read(world, "datasets/calc-0123456789ab.csv") == DATASET


def test_volunteer_cannot_write_trainer_prefixes(world):
    vol = world["vol-a"]
    for key in (
        "metrics/v000001.jsonl",
        "dashboard/index.html",
        "quarantine/v000001/vol-a/x.jsonl.gz",
        "trainer/state.json",
        "rollouts/v000001/x.jsonl.gz",  # a shard outside any volunteer's prefix
    ):
        _denied(vol.put_object, Bucket=BUCKET, Key=key, Body=b"evil")
        assert _absent(world, key), key


def test_volunteer_cannot_delete_anything(world):
    vol = world["vol-a"]
    vol.put_object(Bucket=BUCKET, Key="rollouts/v000001/vol-a/keep.jsonl.gz", Body=b"mine")
    for key in (
        "manifest.json",
        "checkpoints/v000001/model.safetensors",
        "rollouts/v000001/vol-b/s0.jsonl.gz",
        "rollouts/v000001/vol-a/keep.jsonl.gz",  # not even its own shards
        "volunteers/vol-b.json",
    ):
        _denied(vol.delete_object, Bucket=BUCKET, Key=key)
    version_id = world["admin"].head_object(Bucket=BUCKET, Key="manifest.json")["VersionId"]
    _denied(vol.delete_object, Bucket=BUCKET, Key="manifest.json", VersionId=version_id)

    assert _read(world, "manifest.json") == MANIFEST
    assert _read(world, "checkpoints/v000001/model.safetensors") == CHECKPOINT
    assert _read(world, "rollouts/v000001/vol-b/s0.jsonl.gz") == b"b-shard"
    assert _read(world, "rollouts/v000001/vol-a/keep.jsonl.gz") == b"mine"
    assert _read(world, "volunteers/vol-b.json") == HEARTBEAT_B
    markers = world["admin"].list_object_versions(Bucket=BUCKET).get("DeleteMarkers", [])
    assert markers == []


# moto 5.2 answers SignatureDoesNotMatch to any list whose Prefix contains "/" once IAM is
# enforced (it checks the signature against a differently encoded query string), so the list
# calls below use slash-free prefixes.


def test_volunteer_cannot_list(world):
    _denied(world["vol-a"].list_objects_v2, Bucket=BUCKET)
    _denied(world["vol-a"].list_objects_v2, Bucket=BUCKET, Prefix="rollouts")
    _denied(world["vol-a"].list_object_versions, Bucket=BUCKET)


def test_volunteer_cannot_write_as_another_volunteer(world):
    vol_a = world["vol-a"]
    for key in (
        "rollouts/v000001/vol-b/forged.jsonl.gz",
        "rollouts/v000001/vol-b/vol-a/nested.jsonl.gz",  # own name nested inside B's prefix
        "rollouts/v000001/vol-aa/x.jsonl.gz",  # a name that merely starts with vol-a
    ):
        _denied(vol_a.put_object, Bucket=BUCKET, Key=key, Body=b"forged")
        assert _absent(world, key), key
    _denied(vol_a.put_object, Bucket=BUCKET, Key="volunteers/vol-b.json", Body=b'{"forged": true}')
    assert _read(world, "volunteers/vol-b.json") == HEARTBEAT_B

    # ...while B itself may.
    world["vol-b"].put_object(Bucket=BUCKET, Key="rollouts/v000001/vol-b/s1.jsonl.gz", Body=b"b1")
    assert _read(world, "rollouts/v000001/vol-b/s1.jsonl.gz") == b"b1"


# --------------------------------------------------------------------------- trainer


def test_trainer_reads_lists_publishes_and_deletes(world):
    trainer = world["trainer"]
    world["vol-b"].put_object(Bucket=BUCKET, Key="rollouts/v000003/vol-b/t.jsonl.gz", Body=b"t")

    listed = trainer.list_objects_v2(Bucket=BUCKET, Prefix="rollouts")
    keys = [o["Key"] for o in listed["Contents"] if o["Key"].startswith("rollouts/v000003/")]
    assert keys == ["rollouts/v000003/vol-b/t.jsonl.gz"]
    assert trainer.get_object(Bucket=BUCKET, Key="rollouts/v000003/vol-b/t.jsonl.gz")["Body"].read() == b"t"
    trainer.delete_object(Bucket=BUCKET, Key="rollouts/v000003/vol-b/t.jsonl.gz")
    assert _absent(world, "rollouts/v000003/vol-b/t.jsonl.gz")

    trainer.put_object(Bucket=BUCKET, Key="checkpoints/v000003/model.safetensors", Body=b"weights-v3")
    trainer.put_object(Bucket=BUCKET, Key="metrics/v000003.jsonl", Body=b"{}\n")
    etag = trainer.head_object(Bucket=BUCKET, Key="manifest.json")["ETag"]
    new_manifest = b'{"version": 3, "checkpoint": "checkpoints/v000003/"}'
    trainer.put_object(Bucket=BUCKET, Key="manifest.json", Body=new_manifest, IfMatch=etag)
    try:
        assert world["vol-a"].get_object(Bucket=BUCKET, Key="manifest.json")["Body"].read() == new_manifest
    finally:
        # Put the original manifest back for any test that runs after this one.
        trainer.put_object(Bucket=BUCKET, Key="manifest.json", Body=MANIFEST)


# --------------------------------------------------------------------------- conditions
#
# moto 5.2 checks an S3 request against IAM policies with no request context: a statement's
# Condition meets no key, and every operator but StringEquals counts as met. So a conditional
# Deny refuses every request it names and a conditional Allow grants every one. The tests below
# therefore check the conditional statements on the rendered documents, with the rules AWS
# documents for the four operators the templates use, and feed them the requests vrl sends.


def test_moto_cannot_evaluate_s3_conditions(world):
    """Why the conditions are checked on the documents. moto refuses an upload that meets every
    condition of the deployed volunteer policy (AWS lets it through), and lets the trainer list
    the whole bucket (its s3:prefix condition stops that on AWS). Once this fails, moto has
    learnt conditions: turn the document checks below into requests."""
    key = "rollouts/v000001/vol-a/as-deployed.jsonl.gz"
    _denied(world["vol-a-as-deployed"].put_object, Bucket=BUCKET, Key=key, Body=b"x", IfNoneMatch="*")
    assert _absent(world, key)
    assert world["trainer"].list_objects_v2(Bucket=BUCKET)["KeyCount"] > 0  # no Prefix at all


def _iam_like(pattern: str, value: str) -> bool:
    """IAM's wildcard match (Resource, StringLike): `*` any run of characters, `/` included,
    `?` any one character, everything else literal and case-sensitive."""
    regex = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)
    return re.fullmatch(regex, value, flags=re.S) is not None


def _holds(operator: str, key: str, expected, context: dict[str, str]) -> bool:
    """One condition key under one operator, as AWS evaluates it. A key the request does not
    carry fails every operator except Null ("true") and the negated ones."""
    expected = expected if isinstance(expected, list) else [expected]
    if operator == "Null":
        assert expected in (["true"], ["false"]), expected
        return (key not in context) == (expected == ["true"])
    if key not in context:
        return operator == "StringNotEquals"
    value = context[key]
    if operator == "StringNotEquals":
        return value not in expected
    if operator == "StringLike":
        return any(_iam_like(p, value) for p in expected)
    if operator == "Bool":
        return value in expected
    raise AssertionError(f"no rule here for the {operator} operator: add AWS's before using it")


def _applying(policy: dict, effect: str, action: str, resource: str, context: dict[str, str]) -> set[str]:
    """Sids of the `effect` statements that apply to the request: its action and resource match
    and every condition holds (operators and the keys under each are ANDed, values ORed)."""
    sids = set()
    for s in policy["Statement"]:
        resources = s["Resource"] if isinstance(s["Resource"], list) else [s["Resource"]]
        if s["Effect"] != effect or action not in s["Action"]:
            continue
        if not any(_iam_like(r, resource) for r in resources):
            continue
        conditions = s.get("Condition", {})
        if all(_holds(op, key, want, context) for op, keys in conditions.items() for key, want in keys.items()):
            sids.add(s["Sid"])
    return sids


SHARD_ARN = f"{BUCKET_ARN}/rollouts/v000001/vol-a/s.jsonl.gz"
CREATES = {"s3:ObjectCreationOperation": "true"}  # PutObject, CompleteMultipartUpload, CopyObject
MULTIPART_STEPS = {"s3:ObjectCreationOperation": "false"}  # CreateMultipartUpload, UploadPart


def test_volunteer_shard_uploads_must_be_create_only(world):
    # Document check (moto cannot evaluate s3:if-none-match or s3:ObjectCreationOperation).
    policy = volunteer_policy("vol-a")
    deny = {"DenyRolloutWritesWithoutIfNoneMatch"}
    assert _applying(policy, "Deny", "s3:PutObject", SHARD_ARN, CREATES) == deny
    assert _applying(policy, "Deny", "s3:PutObject", SHARD_ARN, {**CREATES, "s3:if-none-match": "*"}) == set()
    # The steps of a multipart upload before Complete cannot carry the header and are let
    # through; its Complete is held to it like a PUT.
    assert _applying(policy, "Deny", "s3:PutObject", SHARD_ARN, MULTIPART_STEPS) == set()
    # The heartbeat is the one object a volunteer overwrites.
    assert _applying(policy, "Deny", "s3:PutObject", f"{BUCKET_ARN}/volunteers/vol-a.json", CREATES) == set()

    # With the header, S3 itself keeps the first upload (moto does enforce If-None-Match).
    key = "rollouts/v000001/vol-a/once.jsonl.gz"
    world["vol-a"].put_object(Bucket=BUCKET, Key=key, Body=b"first", IfNoneMatch="*")
    with pytest.raises(ClientError) as excinfo:
        world["vol-a"].put_object(Bucket=BUCKET, Key=key, Body=b"second", IfNoneMatch="*")
    assert excinfo.value.response["Error"]["Code"] == "PreconditionFailed"
    assert _read(world, key) == b"first"


def test_volunteer_uploads_only_the_standard_storage_class():
    # Document check (moto cannot evaluate s3:x-amz-storage-class).
    policy = volunteer_policy("vol-a")
    deny = {"DenyStorageClassesOtherThanStandard"}
    for storage_class in ("GLACIER", "DEEP_ARCHIVE", "STANDARD_IA", "REDUCED_REDUNDANCY"):
        chosen = {"s3:x-amz-storage-class": storage_class}
        put = {**CREATES, "s3:if-none-match": "*", **chosen}
        assert _applying(policy, "Deny", "s3:PutObject", SHARD_ARN, put) == deny, storage_class
        # CreateMultipartUpload is where a multipart upload names its class.
        assert _applying(policy, "Deny", "s3:PutObject", SHARD_ARN, {**MULTIPART_STEPS, **chosen}) == deny
    standard = {**CREATES, "s3:if-none-match": "*", "s3:x-amz-storage-class": "STANDARD"}
    assert _applying(policy, "Deny", "s3:PutObject", SHARD_ARN, standard) == set()
    # No header means STANDARD. StringNotEquals alone would hold for a missing key and refuse
    # every upload that names no class, which is every upload vrl makes: hence the Null clause.
    assert _applying(policy, "Deny", "s3:PutObject", SHARD_ARN, {**CREATES, "s3:if-none-match": "*"}) == set()


def test_volunteer_cannot_upload_with_a_customer_provided_key():
    # Document check (moto cannot evaluate s3:x-amz-server-side-encryption-customer-algorithm).
    policy = volunteer_policy("vol-a")
    sse_c = {"s3:x-amz-server-side-encryption-customer-algorithm": "AES256"}
    for context in ({**CREATES, "s3:if-none-match": "*", **sse_c}, {**MULTIPART_STEPS, **sse_c}):
        assert "DenyCustomerProvidedKeys" in _applying(policy, "Deny", "s3:PutObject", SHARD_ARN, context)
    heartbeat = f"{BUCKET_ARN}/volunteers/vol-a.json"
    assert _applying(policy, "Deny", "s3:PutObject", heartbeat, {**CREATES, **sse_c}) == {"DenyCustomerProvidedKeys"}
    # SSE-S3, the bucket's default, stays allowed.
    sse_s3 = {**CREATES, "s3:if-none-match": "*", "s3:x-amz-server-side-encryption": "AES256"}
    assert _applying(policy, "Deny", "s3:PutObject", SHARD_ARN, sse_s3) == set()


class _RecordingClient:
    """Stands in for S3Storage's boto3 client: records each call, answers like an empty bucket."""

    def __init__(self):
        self.calls: list[tuple[str, dict]] = []

    def get_paginator(self, operation: str):
        calls = self.calls

        class Pages:
            def paginate(self, **kwargs):
                calls.append((operation, kwargs))
                return [{}]

        return Pages()

    def put_object(self, **kwargs):
        self.calls.append(("put_object", kwargs))
        return {"ETag": '"0"'}

    def get_object(self, **kwargs):
        self.calls.append(("get_object", kwargs))
        raise ClientError({"Error": {"Code": "NoSuchKey"}, "ResponseMetadata": {"HTTPStatusCode": 404}},
                          "GetObject")

    def delete_objects(self, **kwargs):
        self.calls.append(("delete_objects", kwargs))
        return {}


def _recording_storage(key_prefix: str) -> tuple[S3Storage, _RecordingClient]:
    root = key_prefix.rstrip("/")
    storage = S3Storage(f"s3://{BUCKET}/{root}" if root else f"s3://{BUCKET}", "http://127.0.0.1:9")
    storage.client = _RecordingClient()
    return storage, storage.client


def test_the_uploads_vrl_volunteer_makes_meet_every_condition():
    """The volunteer's own requests (a shard, create-only; its heartbeat, overwritten) are not
    refused by any deny of the deployed policy, conditional or not, and are allowed."""
    storage, client = _recording_storage(KEY_PREFIX)
    storage.create(layout.shard_key(1, "vol-a", "s0"), b"shard")
    storage.write(layout.heartbeat_key("vol-a"), b"{}")
    policy = volunteer_policy("vol-a")
    headers = {
        "IfNoneMatch": "s3:if-none-match",
        "StorageClass": "s3:x-amz-storage-class",
        "SSECustomerAlgorithm": "s3:x-amz-server-side-encryption-customer-algorithm",
    }
    assert [op for op, _ in client.calls] == ["put_object", "put_object"]
    for _, kwargs in client.calls:
        context = {**CREATES, **{key: kwargs[param] for param, key in headers.items() if param in kwargs}}
        arn = f"{BUCKET_ARN}/{kwargs['Key']}"
        assert _applying(policy, "Deny", "s3:PutObject", arn, context) == set(), kwargs["Key"]
        assert _applying(policy, "Allow", "s3:PutObject", arn, context), kwargs["Key"]
    assert client.calls[0][1]["IfNoneMatch"] == "*"


@pytest.mark.parametrize("key_prefix", ["", "runs/calc/"])
def test_trainer_lists_only_the_run_prefixes(key_prefix):
    """Document check (moto ignores s3:prefix): every listing the trainer, `vrl gc` and
    `vrl status` make, through the real code where it is cheap to call, is allowed by
    ListRunPrefixes, and a listing of the bucket, the run's root or anything else is not."""
    storage, client = _recording_storage(key_prefix)
    read_history(storage)  # the dashboard: metrics/
    retention = TrainerRetention(storage, keep_versions=3, every=1)
    m = Manifest(task=TaskRef("calculator", "volunteer-rl", "0.1.0"), run_id="r", version=7, checkpoint=layout.checkpoint_prefix(7), files={},
                 dataset=Dataset("train", "datasets/t.csv", "ab" * 32, 10, 1),
                 sampling=Sampling(2, 1.0, 8), max_staleness=1)
    retention.run_pass(m)  # first pass: checkpoints/ one level and manifests/, where to start
    retention.next = {layout.ROLLOUTS: 3, layout.CHECKPOINTS: 3}
    retention.run_pass(m)  # the walk: rollouts/vNNNNNN/ of the versions below the kept range
    for prefix in (layout.CHECKPOINTS, layout.ROLLOUTS):  # `vrl gc`: the prefixes whole
        storage.list(prefix)
    for prefix in (layout.CHECKPOINTS, layout.MANIFESTS):  # trainer.published_or_started
        storage.list(prefix)
    storage.list(layout.rollout_version_prefix(7))  # ingest.poll: the window's shards
    storage.list(layout.VOLUNTEERS)  # status.read_status: the heartbeats

    assert {op for op, _ in client.calls} == {"list_objects_v2", "get_object"}
    listed = {kwargs["Prefix"] for op, kwargs in client.calls if op == "list_objects_v2"}
    walked = {f"{key_prefix}{p}/" for p in (layout.rollout_version_prefix(3), layout.rollout_version_prefix(4))}
    assert walked <= listed and len(listed) == 8, sorted(listed)
    policy = trainer_policy(key_prefix)
    for prefix in listed:
        for action in ("s3:ListBucket", "s3:ListBucketVersions"):
            assert "ListRunPrefixes" in _applying(policy, "Allow", action, BUCKET_ARN, {"s3:prefix": prefix}), prefix

    for prefix in ("", key_prefix, "runs/", "other-run/rollouts/", f"{key_prefix}dashboard/", f"{key_prefix}trainer/"):
        assert _applying(policy, "Allow", "s3:ListBucket", BUCKET_ARN, {"s3:prefix": prefix}) == set(), prefix
    assert _applying(policy, "Allow", "s3:ListBucket", BUCKET_ARN, {}) == set()  # no Prefix at all


@pytest.mark.parametrize("key_prefix", ["", "runs/calc/"])
def test_retention_deletes_in_batches_the_trainer_policy_allows(key_prefix):
    """Document check: S3Storage.delete_many sends one DeleteObjects per 1,000 keys (not one
    request per object), and DeleteObjects is authorized per key as s3:DeleteObject, which
    the trainer's policy allows under the run's prefix."""
    storage, client = _recording_storage(key_prefix)
    keys = [layout.shard_key(1, "vol-a", f"s{i}") for i in range(2500)]
    assert storage.delete_many(keys) == []
    assert [op for op, _ in client.calls] == ["delete_objects"] * 3
    sent = [o["Key"] for _, kwargs in client.calls for o in kwargs["Delete"]["Objects"]]
    assert sent == [key_prefix + k for k in keys]
    policy = trainer_policy(key_prefix)
    for key in (sent[0], sent[-1], key_prefix + layout.checkpoint_key(1, "model.safetensors")):
        assert _applying(policy, "Allow", "s3:DeleteObject", f"{BUCKET_ARN}/{key}", {}), key


@pytest.mark.parametrize("key_prefix", ["", "runs/calc/"])
def test_trainer_hears_not_found_for_run_objects_not_written_yet(key_prefix):
    """Document check. For a GET or HEAD of a missing key, S3 answers 404 only if the caller may
    list that key as a prefix (s3:ListBucket with s3:prefix = the key), else 403, which vrl
    takes for a permission error. So the keys the trainer and its tools read before they exist
    must pass the s3:prefix condition too (NotFoundForMissingRunObjects), and so must the
    existence checks of the fsspec backend: HEAD the key, then list `key/`; a folder name
    listed empty is HEADed bare."""
    shard = layout.shard_key(7, "alice", "s0")
    maybe_missing = [
        layout.MANIFEST,  # a fresh run
        layout.DENYLIST,
        layout.FLEET,
        layout.ledger_key(7),
        layout.manifest_history_key(7),
        layout.metrics_key(7),
        layout.heartbeat_key("alice"),
        layout.checkpoint_key(7, "model.safetensors"),
        shard,
        layout.quarantine_key(shard),
        layout.dataset_key("calc", "0" * 64),
        layout.CHECKPOINTS,
        layout.MANIFESTS,
        layout.METRICS,
        layout.ROLLOUTS,
        layout.VOLUNTEERS,
    ]
    top_level_files = {layout.MANIFEST, layout.DENYLIST, layout.FLEET}  # only ever read whole
    policy = trainer_policy(key_prefix)
    for key in maybe_missing:
        probes = [key] if key in top_level_files else [key, f"{key}/"]
        for probe in (key_prefix + p for p in probes):
            assert _applying(policy, "Allow", "s3:ListBucket", BUCKET_ARN, {"s3:prefix": probe}), probe
    for key in ("dashboard/index.html", "manifest.json.old", "fleet.json/x"):
        assert _applying(policy, "Allow", "s3:ListBucket", BUCKET_ARN, {"s3:prefix": key_prefix + key}) == set(), key
