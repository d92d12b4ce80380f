"""The deployed IAM policies, checked against an S3 server that enforces IAM.

The policy documents are rendered from the same JSON templates terraform deploys
(terraform/aws/policies/*.json.tftpl, equal to the MinIO module's), attached the way the AWS
module attaches them (inline user policy per volunteer, group policy for the trainer), and
exercised with each identity's own keys against moto's S3 server with IAM enforcement on.
Every denial is checked twice: the AccessDenied error, and the bucket's content afterwards as
seen with admin keys.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import boto3
import moto.server  # noqa: F401  (a hard test dependency: a broken install fails here)
from botocore.config import Config  # noqa: E402
from botocore.exceptions import ClientError  # noqa: E402
from vrlproc import load_infra  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
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


def trainer_policy() -> dict:
    return policy_template.render_policy(
        POLICIES / "trainer.json.tftpl", bucket_arn=BUCKET_ARN, key_prefix=KEY_PREFIX
    )


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

    # Each volunteer: its own user with an inline policy rendered for its name.
    volunteer_keys = {}
    for name in ("vol-a", "vol-b"):
        user = f"vrl-volunteer-{name}"
        iam.create_user(UserName=user)
        iam.put_user_policy(
            UserName=user,
            PolicyName="vrl-volunteer-bucket-access",
            PolicyDocument=json.dumps(volunteer_policy(name)),
        )
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
        }
    finally:
        s3_server.disable_iam_auth(endpoint_url)
        _cleanup(setup, iam)


def _cleanup(s3, iam) -> None:
    versions = s3.list_object_versions(Bucket=BUCKET)
    for item in versions.get("Versions", []) + versions.get("DeleteMarkers", []):
        s3.delete_object(Bucket=BUCKET, Key=item["Key"], VersionId=item["VersionId"])
    s3.delete_bucket(Bucket=BUCKET)
    for user in ("vrl-test-admin", "vrl-trainer", "vrl-volunteer-vol-a", "vrl-volunteer-vol-b"):
        for key in iam.list_access_keys(UserName=user)["AccessKeyMetadata"]:
            iam.delete_access_key(UserName=user, AccessKeyId=key["AccessKeyId"])
        for policy in iam.list_user_policies(UserName=user)["PolicyNames"]:
            iam.delete_user_policy(UserName=user, PolicyName=policy)
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
