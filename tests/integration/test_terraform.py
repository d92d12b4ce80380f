"""Offline checks of terraform/: every file parses, the modules are wired consistently, and
the IAM policy templates render to the documents we mean to deploy.

`terraform init/validate` needs the providers, which cannot be downloaded here, so this file
does the checks that need no provider: HCL syntax (python-hcl2, a test dependency),
formatting, variables and locals that are used but not declared, templatefile() calls that
pass other variables than the template uses, and outputs that docs/DEPLOY.md reads.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TERRAFORM = ROOT / "terraform"
MODULES = ("aws", "gcs", "minio")
TF_FILES = sorted(TERRAFORM.rglob("*.tf"))
BUCKET_ARN = "arn:aws:s3:::vrl-test-bucket"

import hcl2

TERRAFORM_BIN = shutil.which("terraform")


def _load_policy_template():
    module_name = "_vrl_infra_policy_template"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, ROOT / "infra" / "policy_template.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


policy_template = _load_policy_template()


def _module_text(module: str) -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in sorted((TERRAFORM / module).glob("*.tf")))


# --------------------------------------------------------------------------- files and syntax


@pytest.mark.parametrize("module", MODULES)
def test_module_has_its_files(module):
    for name in ("main.tf", "variables.tf", "outputs.tf", "versions.tf", "README.md"):
        assert (TERRAFORM / module / name).is_file(), f"terraform/{module}/{name} is missing"


@pytest.mark.parametrize("path", TF_FILES, ids=lambda p: str(p.relative_to(TERRAFORM)))
def test_tf_file_parses(path):
    with path.open(encoding="utf-8") as fh:
        parsed = hcl2.load(fh)
    assert parsed, f"{path} parsed to nothing"


def test_tf_files_exist():
    assert len(TF_FILES) >= 4 * len(MODULES)


@pytest.mark.skipif(TERRAFORM_BIN is None, reason="terraform is not on PATH")
def test_terraform_fmt_is_clean():
    result = subprocess.run(
        [TERRAFORM_BIN, "fmt", "-check", "-recursive", str(TERRAFORM)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, f"run `terraform fmt -recursive terraform`:\n{result.stdout}{result.stderr}"


# --------------------------------------------------------------------------- wiring


@pytest.mark.parametrize("module", MODULES)
def test_used_variables_and_locals_are_declared(module):
    text = _module_text(module)
    declared_vars = set(re.findall(r'^variable\s+"(\w+)"', text, flags=re.M))
    used_vars = set(re.findall(r"\bvar\.(\w+)", text))
    assert used_vars - declared_vars == set(), "var.* used but not declared"
    assert declared_vars - used_vars == set(), "variables declared but never used"

    declared_locals = set()
    for block in re.findall(r"^locals\s*\{(.*?)^\}", text, flags=re.M | re.S):
        declared_locals |= set(re.findall(r"^  (\w+)\s*=", block, flags=re.M))
    used_locals = set(re.findall(r"\blocal\.(\w+)", text))
    assert used_locals - declared_locals == set(), "local.* used but not declared"


@pytest.mark.parametrize("module", MODULES)
def test_referenced_resources_are_declared(module):
    text = _module_text(module)
    declared = set(re.findall(r'^resource\s+"(\w+)"\s+"(\w+)"', text, flags=re.M))
    provider_prefix = {"aws": "aws_", "gcs": "google_", "minio": "minio_"}[module]
    referenced = set(re.findall(rf"\b({provider_prefix}\w+)\.(\w+)\b", text))
    assert referenced - declared == set()


TEMPLATEFILE_CALL = re.compile(
    r'templatefile\(\s*"\$\{path\.module\}/(policies/[\w.]+)"\s*,\s*\{(.*?)\}\s*\)', re.S
)


@pytest.mark.parametrize("module", ("aws", "minio"))
def test_templatefile_calls_pass_exactly_the_template_variables(module):
    calls = TEMPLATEFILE_CALL.findall((TERRAFORM / module / "main.tf").read_text(encoding="utf-8"))
    assert sorted(path for path, _ in calls) == [
        "policies/trainer.json.tftpl",
        "policies/volunteer.json.tftpl",
    ]
    for path, arguments in calls:
        passed = set(re.findall(r"^\s*(\w+)\s*=", arguments, flags=re.M))
        text = (TERRAFORM / module / path).read_text(encoding="utf-8")
        # The Python tests substitute exactly these names, so they test what terraform renders.
        assert policy_template.template_variables(text) == passed, path


# Statements of the AWS templates that MinIO's policy engine cannot express: it knows neither
# s3:if-none-match nor s3:ObjectCreationOperation (minio/pkg, policy/condition/keyname.go) and
# refuses a policy that names a condition key it does not know for the action.
AWS_ONLY_STATEMENTS = {"volunteer.json.tftpl": {"DenyRolloutWritesWithoutIfNoneMatch"}, "trainer.json.tftpl": set()}


def test_minio_policies_are_the_tested_aws_policies():
    """The MinIO templates are the AWS ones, statement for statement in the same order, minus
    exactly AWS_ONLY_STATEMENTS; a template without any is a byte-for-byte copy."""
    for name, aws_only in AWS_ONLY_STATEMENTS.items():
        aws_text = (TERRAFORM / "aws" / "policies" / name).read_text(encoding="utf-8")
        minio_text = (TERRAFORM / "minio" / "policies" / name).read_text(encoding="utf-8")
        if not aws_only:
            assert minio_text == aws_text, f"terraform/minio/policies/{name} drifted from the AWS one"
            continue
        aws, minio = json.loads(aws_text), json.loads(minio_text)  # `${...}` sits inside strings
        assert aws_only <= {s["Sid"] for s in aws["Statement"]}, name
        expected = {**aws, "Statement": [s for s in aws["Statement"] if s["Sid"] not in aws_only]}
        assert minio == expected, f"terraform/minio/policies/{name} drifted from the AWS one"


# Condition keys each provider evaluates for each action the templates put a Condition on, and
# the operators used with them. AWS: the Service Authorization Reference for Amazon S3 and the
# S3 guide's "Enforce conditional writes". MinIO: IAMActionConditionKeyMap in minio/pkg
# policy/action.go (MinIO refuses a policy with any other key for the action). A condition that
# a provider ignored would silently grant or deny nothing, so a new key must be added here on
# evidence, with a test of its effect in tests/integration/test_iam_policy.py.
CONDITION_KEYS = {
    "aws": {
        "s3:PutObject": {
            "s3:if-none-match",
            "s3:ObjectCreationOperation",
            "s3:x-amz-storage-class",
            "s3:x-amz-server-side-encryption-customer-algorithm",
        },
        "s3:ListBucket": {"s3:prefix"},
        "s3:ListBucketVersions": {"s3:prefix"},
    },
    "minio": {
        "s3:PutObject": {"s3:x-amz-storage-class", "s3:x-amz-server-side-encryption-customer-algorithm"},
        "s3:ListBucket": {"s3:prefix"},
        "s3:ListBucketVersions": {"s3:prefix"},
    },
}
CONDITION_OPERATORS = {"Null", "Bool", "StringLike", "StringNotEquals"}


@pytest.mark.parametrize("module", ("aws", "minio"))
def test_conditions_use_only_keys_the_provider_evaluates(module):
    seen = set()
    for name in AWS_ONLY_STATEMENTS:
        policy = json.loads((TERRAFORM / module / "policies" / name).read_text(encoding="utf-8"))
        for s in policy["Statement"]:
            for operator, keys in s.get("Condition", {}).items():
                assert operator in CONDITION_OPERATORS, (name, s["Sid"], operator)
                for action in s["Action"]:
                    assert set(keys) <= CONDITION_KEYS[module][action], (name, s["Sid"], action)
                seen |= set(keys)
    # Every key listed is in use: the table above is what the templates rely on, not a wish list.
    assert seen == set().union(*CONDITION_KEYS[module].values())


# What IAM lets each kind of policy hold, in characters other than white space, for the sum of
# a user's (group's, role's) inline policies or for one managed policy (AWS: "IAM and AWS STS
# quotas"). moto does not check them, so nothing but this test would notice before `apply`.
IAM_POLICY_QUOTA = {
    "aws_iam_user_policy": 2048,
    "aws_iam_group_policy": 5120,
    "aws_iam_role_policy": 10240,
    "aws_iam_policy": 6144,
}


def _holder_of(template: str) -> str:
    """The resource type of terraform/aws that holds the rendered `template`, directly or
    through a local."""
    text = (TERRAFORM / "aws" / "main.tf").read_text(encoding="utf-8")
    call = f'templatefile("${{path.module}}/policies/{template}"'
    names = [call] + [f"local.{n}" for n in re.findall(rf"^  (\w+) = {re.escape(call)}", text, flags=re.M)]
    blocks = re.findall(r'^resource "(\w+)" "\w+" \{(.*?)^\}', text, flags=re.M | re.S)
    holders = {kind for kind, body in blocks if any(n in body for n in names)}
    assert len(holders) == 1, (template, holders)
    return holders.pop()


def test_aws_policies_fit_the_iam_size_quota():
    """The longest inputs the module's validations let through: a 63-character bucket name,
    the longest key prefix and the longest volunteer name."""
    variables = (TERRAFORM / "aws" / "variables.tf").read_text(encoding="utf-8")
    prefix_cap = int(re.search(r"length\(var\.key_prefix\) <= (\d+)", variables).group(1))
    assert "{0,18}" in variables  # volunteer names: 20 characters at most
    longest = {
        "bucket_arn": "arn:aws:s3:::" + "b" * 63,
        "key_prefix": "p" * (prefix_cap - 1) + "/",
        "volunteer_id": "v" * 20,
    }
    for template in ("volunteer.json.tftpl", "trainer.json.tftpl"):
        text = (TERRAFORM / "aws" / "policies" / template).read_text(encoding="utf-8")
        wanted = {k: v for k, v in longest.items() if k in policy_template.template_variables(text)}
        size = len(re.sub(r"\s", "", policy_template.render(text, wanted)))
        quota = IAM_POLICY_QUOTA[_holder_of(template)]
        assert size <= quota, f"{template}: {size} characters, {_holder_of(template)} holds {quota}"


def test_outputs_named_in_deploy_doc_exist():
    doc = (ROOT / "docs" / "DEPLOY.md").read_text(encoding="utf-8")
    named = set(re.findall(r"terraform output (?:-raw |-json )?(\w+)", doc))
    assert named, "docs/DEPLOY.md reads no terraform output"
    outputs = set()
    for module in MODULES:
        outputs |= set(re.findall(r'^output\s+"(\w+)"', _module_text(module), flags=re.M))
    assert named - outputs == set()


def test_gcs_volunteer_bindings_use_object_name_conditions():
    text = (TERRAFORM / "gcs" / "main.tf").read_text(encoding="utf-8")
    bindings = dict(
        re.findall(r'^resource "google_storage_bucket_iam_member" "(\w+)" \{(.*?)^\}', text, flags=re.M | re.S)
    )
    assert set(bindings) == {"trainer_objects", "volunteer_read", "volunteer_rollouts", "volunteer_heartbeat"}
    assert 'role   = "roles/storage.objectAdmin"' in bindings["trainer_objects"]
    assert "condition" not in bindings["trainer_objects"]
    expected = {
        "volunteer_read": ("roles/storage.objectViewer", "local.volunteer_read_condition"),
        "volunteer_rollouts": ("roles/storage.objectCreator", "rollouts/{version}/${each.key}/"),
        "volunteer_heartbeat": ("roles/storage.objectUser", "volunteers/${each.key}.json"),
    }
    for name, (role, scope) in expected.items():
        block = bindings[name]
        assert f'role   = "{role}"' in block, name
        assert "condition {" in block and "expression" in block and scope in block, name
    # Object names as IAM conditions see them, under the optional key prefix.
    assert 'objects = "projects/_/buckets/${google_storage_bucket.run.name}/objects/${var.key_prefix}"' in text
    for needle in ('"${local.objects}manifest.json"', '"${local.objects}checkpoints/"', '"${local.objects}datasets/"'):
        assert needle in text
    assert 'public_access_prevention    = "enforced"' in text
    assert "uniform_bucket_level_access = true" in text


def _gcs_rollouts_condition(bucket: str, key_prefix: str, volunteer: str) -> str:
    """The volunteer_rollouts binding's CEL expression as Terraform renders it: the module's
    join(" && ", [format(...), ...]) with local.objects and each.key filled in (%q quotes a
    string as JSON does)."""
    text = (TERRAFORM / "gcs" / "main.tf").read_text(encoding="utf-8")
    block = re.search(r'"volunteer_rollouts" \{.*?expression = join\(" && ", \[(.*?)\]\)', text, re.S)[1]
    objects = f"projects/_/buckets/{bucket}/objects/{key_prefix}"
    terms = []
    for call in re.findall(r"format\(((?:\"(?:[^\"\\]|\\.)*\"\s*,?\s*)+)\)", block):
        fmt, *args = json.loads(f"[{call.rstrip().rstrip(',')}]")
        args = [json.dumps(a.replace("${local.objects}", objects).replace("${each.key}", volunteer))
                for a in args]
        terms.append(fmt.replace("%q", "{}").format(*args))
    return " && ".join(terms)


def _cel(expression: str, name: str) -> bool:
    """Evaluate the forms of CEL the GCS conditions use on `resource.name`, with extract()
    as IAM documents it: the text after the first occurrence of the template's prefix, up to
    the first occurrence of its suffix after that, or "" if either is missing."""
    def extract(template: str) -> str:
        before, after = re.fullmatch(r"(.*)\{\w+\}(.*)", template).groups()
        if before not in name:
            return ""
        rest = name[name.index(before) + len(before):]
        return rest[:rest.index(after)] if after in rest else ""

    quoted = r'"((?:[^"\\]|\\.)*)"'
    for term in expression.split(" && "):
        if m := re.fullmatch(rf"resource\.name\.startsWith\({quoted}\)", term):
            ok = name.startswith(json.loads(f'"{m[1]}"'))
        elif m := re.fullmatch(rf'resource\.name\.extract\({quoted}\) != ""', term):
            ok = extract(json.loads(f'"{m[1]}"')) != ""
        elif m := re.fullmatch(rf"resource\.name\.extract\({quoted}\) == resource\.name\.extract\({quoted}\)", term):
            ok = extract(json.loads(f'"{m[1]}"')) == extract(json.loads(f'"{m[2]}"'))
        else:
            raise AssertionError(f"unknown CEL term {term}")
        if not ok:
            return False
    return True


@pytest.mark.parametrize("key_prefix", ["", "runs/calc/"])
def test_gcs_rollouts_condition_denies_own_name_nested_in_another_prefix(key_prefix):
    """GCS's counterpart of the AWS DenyOwnNameNestedInAnotherPrefix: alice may create under
    rollouts/<version>/alice/ and nowhere else, not in bob's folder with her name nested."""
    expression = _gcs_rollouts_condition("vrl-b", key_prefix, "alice")
    objects = f"projects/_/buckets/vrl-b/objects/{key_prefix}"
    allowed = ["rollouts/v000001/alice/s.jsonl.gz", "rollouts/v000001/alice/x/alice/y"]
    denied = ["rollouts/v000001/bob/alice/x", "rollouts/v000001/bob/alice/", "rollouts/v1/v2/alice/x",
              "rollouts/v000001/bob/s.jsonl.gz", "rollouts/v000001/alicex/s", "rollouts//alice/x",
              "checkpoints/v000001/alice/x", "other/rollouts/v000001/alice/x", "rollouts/alice/x"]
    for key in allowed:
        assert _cel(expression, objects + key), key
    for key in denied:
        assert not _cel(expression, objects + key), key
    if key_prefix:  # the same key outside the run's prefix
        assert not _cel(expression, "projects/_/buckets/vrl-b/objects/rollouts/v000001/alice/s")


# --------------------------------------------------------------------------- policy templates


def _statements(policy: dict) -> dict[str, dict]:
    assert policy["Version"] == "2012-10-17"
    statements = {s["Sid"]: s for s in policy["Statement"]}
    assert len(statements) == len(policy["Statement"]), "duplicate Sid"
    for s in statements.values():
        assert re.fullmatch(r"[A-Za-z0-9]+", s["Sid"])
        assert s["Effect"] in ("Allow", "Deny")
        assert "*" not in s["Action"] and "s3:*" not in s["Action"]
    return statements


@pytest.mark.parametrize("module", ("aws", "minio"))
@pytest.mark.parametrize("key_prefix", ["", "runs/calc/"])
def test_volunteer_policy_renders(module, key_prefix):
    policy = policy_template.render_policy(
        TERRAFORM / module / "policies" / "volunteer.json.tftpl",
        bucket_arn=BUCKET_ARN,
        key_prefix=key_prefix,
        volunteer_id="alice",
    )
    statements = _statements(policy)
    objects = f"{BUCKET_ARN}/{key_prefix}"
    assert statements["ReadPublishedModelAndData"] == {
        "Sid": "ReadPublishedModelAndData",
        "Effect": "Allow",
        "Action": ["s3:GetObject", "s3:GetObjectVersion"],
        "Resource": [f"{objects}manifest.json", f"{objects}manifests/*", f"{objects}checkpoints/*",
                     f"{objects}datasets/*", f"{objects}grants/alice.json"],
    }
    assert statements["WriteOwnRollouts"]["Resource"] == [f"{objects}rollouts/*/alice/*"]
    assert statements["WriteOwnHeartbeat"]["Resource"] == [f"{objects}volunteers/alice.json"]
    assert statements["DenyOwnNameNestedInAnotherPrefix"]["Resource"] == [f"{objects}rollouts/*/*/alice/*"]

    deny_writes = statements["DenyWritesToTrainerObjects"]
    assert deny_writes["Effect"] == "Deny" and deny_writes["Action"] == ["s3:PutObject"]
    assert {f"{objects}manifest.json", f"{objects}checkpoints/*", f"{objects}grants/*"} <= set(deny_writes["Resource"])
    deny_deletes = statements["DenyAllDeletes"]
    assert deny_deletes["Effect"] == "Deny"
    assert set(deny_deletes["Action"]) == {"s3:DeleteObject", "s3:DeleteObjectVersion"}
    assert deny_deletes["Resource"] == [f"{BUCKET_ARN}/*"]

    allowed_actions = set()
    for s in statements.values():
        if s["Effect"] == "Allow":
            allowed_actions |= set(s["Action"])
            assert all(r.startswith(objects) for r in s["Resource"])
            assert "Condition" not in s  # every grant is unconditional; conditions only deny
    # No listing (not even of its own prefix), no delete, no bucket-level rights at all.
    assert allowed_actions == {"s3:GetObject", "s3:GetObjectVersion", "s3:PutObject", "s3:AbortMultipartUpload"}

    # Uploads: the standard storage class only, no customer-provided keys, anywhere.
    assert statements["DenyStorageClassesOtherThanStandard"] == {
        "Sid": "DenyStorageClassesOtherThanStandard",
        "Effect": "Deny",
        "Action": ["s3:PutObject"],
        "Resource": [f"{BUCKET_ARN}/*"],
        "Condition": {
            "Null": {"s3:x-amz-storage-class": "false"},
            "StringNotEquals": {"s3:x-amz-storage-class": "STANDARD"},
        },
    }
    assert statements["DenyCustomerProvidedKeys"] == {
        "Sid": "DenyCustomerProvidedKeys",
        "Effect": "Deny",
        "Action": ["s3:PutObject"],
        "Resource": [f"{BUCKET_ARN}/*"],
        "Condition": {"Null": {"s3:x-amz-server-side-encryption-customer-algorithm": "false"}},
    }
    # Shards create-only where the provider evaluates s3:if-none-match (AWS, not MinIO); the
    # heartbeat under volunteers/ stays overwritable.
    create_only = statements.get("DenyRolloutWritesWithoutIfNoneMatch")
    if module == "minio":
        assert create_only is None
    else:
        assert create_only == {
            "Sid": "DenyRolloutWritesWithoutIfNoneMatch",
            "Effect": "Deny",
            "Action": ["s3:PutObject"],
            "Resource": [f"{objects}rollouts/*"],
            "Condition": {
                "Null": {"s3:if-none-match": "true"},
                "Bool": {"s3:ObjectCreationOperation": "true"},
            },
        }


@pytest.mark.parametrize("module", ("aws", "minio"))
@pytest.mark.parametrize("key_prefix", ["", "runs/calc/"])
def test_trainer_policy_renders(module, key_prefix):
    policy = policy_template.render_policy(
        TERRAFORM / module / "policies" / "trainer.json.tftpl", bucket_arn=BUCKET_ARN, key_prefix=key_prefix
    )
    statements = _statements(policy)
    assert all(s["Effect"] == "Allow" for s in statements.values())
    objects = statements["ReadWriteRunObjects"]
    assert objects["Resource"] == [f"{BUCKET_ARN}/{key_prefix}*"]
    assert {"s3:GetObject", "s3:PutObject", "s3:DeleteObject"} <= set(objects["Action"])
    assert "Condition" not in objects

    # Listing only under the run's own prefixes: every statement that grants a list action
    # carries an s3:prefix condition whose patterns all sit under the key prefix.
    listing = {sid: s for sid, s in statements.items() if any(a.startswith("s3:ListBucket") for a in s["Action"])}
    assert set(listing) == {"ListRunPrefixes", "NotFoundForMissingRunObjects"}
    for sid, s in listing.items():
        assert s["Resource"] == [BUCKET_ARN], sid
        assert list(s["Condition"]) == ["StringLike"] and list(s["Condition"]["StringLike"]) == ["s3:prefix"], sid
        patterns = s["Condition"]["StringLike"]["s3:prefix"]
        # No pattern may start with a wildcard or be the bare prefix: either would list the run
        # (or, with an empty key prefix, the bucket) whole.
        assert all(p.startswith(key_prefix) and len(p) > len(key_prefix) and p[len(key_prefix)] != "*" for p in patterns), sid
    assert set(statements["NotFoundForMissingRunObjects"]["Action"]) == {"s3:ListBucket"}
    assert set(statements["InspectBucket"]["Action"]) == {"s3:GetBucketLocation", "s3:GetBucketVersioning"}


@pytest.mark.skipif(TERRAFORM_BIN is None, reason="terraform is not on PATH")
@pytest.mark.parametrize(
    "template, variables",
    [
        ("volunteer.json.tftpl", {"bucket_arn": BUCKET_ARN, "key_prefix": "", "volunteer_id": "alice"}),
        ("volunteer.json.tftpl", {"bucket_arn": BUCKET_ARN, "key_prefix": "runs/calc/", "volunteer_id": "b-2"}),
        ("trainer.json.tftpl", {"bucket_arn": BUCKET_ARN, "key_prefix": ""}),
        ("trainer.json.tftpl", {"bucket_arn": BUCKET_ARN, "key_prefix": "runs/calc/"}),
    ],
)
def test_python_renderer_matches_terraform_templatefile(template, variables, tmp_path):
    """terraform's own templatefile() (via `terraform console`, offline, no providers) and the
    renderer the tests use produce the same policy."""
    path = TERRAFORM / "aws" / "policies" / template
    arguments = ", ".join(f"{name} = {json.dumps(value)}" for name, value in variables.items())
    expression = f"jsonencode(jsondecode(templatefile({json.dumps(str(path))}, {{ {arguments} }})))"
    result = subprocess.run(
        [TERRAFORM_BIN, "console"],
        input=expression + "\n",
        capture_output=True,
        text=True,
        cwd=tmp_path,  # an empty directory: no configuration, nothing to init
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    from_terraform = json.loads(json.loads(result.stdout.strip()))
    assert from_terraform == policy_template.render_policy(path, **variables)


def test_renderer_refuses_what_it_cannot_render_like_terraform():
    with pytest.raises(KeyError):
        policy_template.render('{"a": "${missing}"}', {})
    with pytest.raises(ValueError):
        policy_template.render('%{ if x }{}%{ endif }', {"x": "1"})
    with pytest.raises(ValueError):
        policy_template.render('{"a": "$${literal}"}', {})
    with pytest.raises(ValueError):
        policy_template.template_variables('{"a": "${upper(x)}"}')
    assert json.loads(policy_template.render('{"a": "${x}/${x}"}', {"x": "v"})) == {"a": "v/v"}
