#!/usr/bin/env bash
# Static checks of terraform/: `terraform fmt -check` (when terraform is installed) and checkov.
#
# checkov pins old versions of boto3 and friends, so it lives in its own venv, never in the
# project's Python: ${VRL_CHECKOV_VENV:-.venv-checkov}, created on first use and installed from
# .ci/checkov.lock (checkov and all it pulls in, pinned). Offline after the install:
# --skip-download keeps checkov from fetching anything at scan time.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"

venv="${VRL_CHECKOV_VENV:-.venv-checkov}"
python_bin="${PYTHON:-python3}"

if [[ ! -x "$venv/bin/checkov" ]]; then
    echo "checkov.sh: installing checkov from .ci/checkov.lock into $venv"
    "$python_bin" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r .ci/checkov.lock
fi

status=0

if command -v terraform >/dev/null 2>&1; then
    echo "checkov.sh: terraform fmt -check -recursive terraform"
    if ! terraform fmt -check -recursive terraform; then
        echo "checkov.sh: terraform files are not formatted: run 'terraform fmt -recursive terraform'" >&2
        status=1
    fi
else
    echo "checkov.sh: terraform is not on PATH: skipping 'terraform fmt -check'"
fi

echo "checkov.sh: $("$venv/bin/checkov" --version | head -n 1 | sed 's/^/checkov /')"
if ! "$venv/bin/checkov" -d terraform --framework terraform --skip-download --quiet --compact; then
    echo "checkov.sh: checkov found failed checks" >&2
    status=1
fi

if [[ $status -eq 0 ]]; then
    echo "checkov.sh: terraform checks passed"
fi
exit "$status"
