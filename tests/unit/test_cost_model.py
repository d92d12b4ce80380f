"""scripts/cost_model.py: the arithmetic of docs/SCALE.md, checked by hand on one row."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "cost_model.py"
spec = importlib.util.spec_from_file_location("cost_model", SCRIPT)
cost_model = importlib.util.module_from_spec(spec)
sys.modules["cost_model"] = cost_model  # dataclasses look their module up there
spec.loader.exec_module(cost_model)


def test_one_plan_by_hand():
    p = cost_model.Plan(volunteers=100, params=6e8, publish_seconds=30, patch_ratio=60,
                        keyframe_every=20, rejoins_per_hour=1)
    file = 1.2e9  # 6e8 bf16 parameters
    assert p.egress_full() == pytest.approx(100 * 120 * file)  # 120 versions an hour
    assert p.egress_patches() == pytest.approx(100 * (120 * file / 60 + file))
    assert p.uplink_full() == pytest.approx(file / 30)
    assert p.uplink_patches() == pytest.approx((file / 60 + file / 20) / 30)
    assert p.downlink_patches() == pytest.approx(file / 60 / 30)


def test_the_script_prints_the_table_and_refuses_half_a_plan():
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, check=True).stdout
    assert out.count("\n| ") == len(cost_model.TABLE) + 1  # the rows and the header's rule
    r = subprocess.run([sys.executable, str(SCRIPT), "--volunteers", "5"], capture_output=True, text=True)
    assert r.returncode == 2 and "give --volunteers, --params and --publish-seconds together" in r.stderr
