"""The DDPM demo (``examples/ddpm_demo.py``) in its own process: trained, killed and resumed
exactly."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_ddpm_demo_runs_and_resumes_exactly(tmp_path):
    demo = os.path.join(os.path.dirname(__file__), "..", "..", "..", "..", "examples", "ddpm_demo.py")
    if not os.path.exists(demo):
        pytest.skip("examples/ddpm_demo.py is not in this checkout")
    png = tmp_path / "grid.png"
    result = subprocess.run(
        [sys.executable, demo, "--url", "memory://ddpm-demo-test", "--steps", "24", "--save-every", "8",
         "--kill-at", "13", "--samples", "4", "--out", str(png)],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "resume exact         yes" in result.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
