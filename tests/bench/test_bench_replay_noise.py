"""bench/replay_noise.py at --quick size: honest samples replayed under every setting, and not
one of them rejected at the tolerance it proposes."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.replay_noise import accelerator

ROOT = Path(__file__).resolve().parents[2]
RESULT = re.compile(r"^RESULT tolerance=(\S+) rejections=(\d+) completions=(\d+) "
                    r"worst_margin=(\S+) seconds=(\d+)$", re.MULTILINE)


@pytest.mark.slow  # samples and replays 500 groups under 8 settings: a check of bench code, ~1 min
def test_replay_noise_quick_rejects_no_honest_completion():
    out = subprocess.run([sys.executable, "-m", "bench.replay_noise", "--quick"], cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    (tol, rejections, completions, worst, _), = RESULT.findall(out.stdout)
    # groups x K x settings: 2 weights x 2 sampler x 2 replay thread counts, and 2 weights x 2
    # replayers of the accelerator's samples where there is one
    assert int(completions) == 500 * 8 * (8 + 4 * (accelerator() is not None))
    assert float(tol) >= 1e-6 and int(rejections) == 0
    assert float(worst) >= -float(tol)
    assert "| weights | sampler | replay |" in out.stdout
