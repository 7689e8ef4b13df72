"""Trainer under ``torchrun`` (2 processes, gloo, CPU): killed after a checkpoint, resumed with
``resume_from_checkpoint=True``, every rank's micro-batch losses and the final weights equal
the uninterrupted run's."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "ddp_run.py"


def torchrun(*args: str) -> None:
    """2 gloo processes on a free local port, one thread each."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
         "--master_addr=127.0.0.1", str(SCRIPT), *args],
        capture_output=True, text=True, timeout=300, check=False, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


@pytest.mark.slow
def test_two_ranks_resume_exactly(tmp_path):
    torchrun(str(tmp_path / "ref"), str(tmp_path / "ref.pt"))
    torchrun(str(tmp_path / "run"), str(tmp_path / "killed.pt"), "--stop-at", "8")
    torchrun(str(tmp_path / "run"), str(tmp_path / "resumed.pt"), "--resume")
    reference, resumed = torch.load(tmp_path / "ref.pt"), torch.load(tmp_path / "resumed.pt")
    for rank in range(2):
        losses = resumed["losses"][rank]
        assert losses[0][0] == 6
        assert losses == [entry for entry in reference["losses"][rank] if entry[0] >= 6]
    for name, value in reference["weights"].items():
        assert torch.equal(resumed["weights"][name], value), name
