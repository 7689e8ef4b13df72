"""``make demo-trainer`` (examples/trainer_demo.py): SIGKILL mid-epoch, resume in a new process, exact."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parents[4] / "examples" / "trainer_demo.py"


@pytest.mark.slow
def test_trainer_demo_resumes_exactly(tmp_path):
    out = subprocess.run(
        [sys.executable, str(DEMO), "--dir", str(tmp_path / "demo"), "--steps", "16", "--save-every", "4", "--kill-at", "10"],
        capture_output=True, text=True, timeout=600, check=False,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "RESULT: exact resume" in out.stdout
    assert "resumed from" in out.stdout and "checkpoint-8" in out.stdout
    assert "pickle files        none" in out.stdout
    assert "resume audit        verified" in out.stdout
