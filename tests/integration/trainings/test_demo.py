"""The resume demo, end to end, on local disk, memory:// and the moto S3 server."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("sklearn")
from repo_paths import ROOT  # noqa: E402

DEMO = ROOT / "examples" / "resume_demo.py"


def _demo(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(DEMO), "--steps", "100", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, cwd=cwd, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["memory", "s3"])
def test_demo_resumes_exactly(where, tmp_path, s3_server):
    # memory:// resumes inside the demo's process, --moto in a new one from the S3 server; the
    # local-disk demo is the one of the gradient-accumulation and inexact-resume tests below
    args = {"memory": ["--url", "memory://demo"], "s3": ["--moto"]}[where]
    proc = _demo(*args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "resume exact         yes" in proc.stdout
    assert "plugins active       rng 0.1.0" in proc.stdout


@pytest.mark.slow
def test_demo_with_gradient_accumulation_resumes_exactly(tmp_path):
    # saves every 10 micro-batches with windows of 3: most checkpoints hold accumulated gradients
    proc = _demo("--url", str(tmp_path / "run"), "--grad-accum", "3", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "grad accumulation    3 micro-batches per optimizer step" in proc.stdout
    assert "resume exact         yes" in proc.stdout


@pytest.mark.slow
def test_demo_detects_an_inexact_resume(tmp_path):
    # Without statekit-rng the dropout masks after the resume differ: the demo must say so.
    proc = _demo("--url", str(tmp_path / "run"), env={"STATEKIT_DISABLE_PLUGINS": "rng,diffusers,fsdp,offload"})
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "RESUME NOT EXACT" in proc.stdout


@pytest.mark.slow
def test_demo_with_replication_resumes_a_fresh_node_from_the_remote_tier(tmp_path):
    proc = _demo("--url", str(tmp_path / "run"), "--replicate-to", "moto", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "on a fresh node" in proc.stdout
    assert "(remote tier: replicated to s3://statekit-demo/" in proc.stdout
    assert "resume exact         yes" in proc.stdout


@pytest.mark.slow
def test_demo_preempted_by_sigterm_resumes_from_the_step_the_signal_stopped(tmp_path):
    # the demo picks a random step between two periodic saves, sends SIGTERM, and fails
    # unless the resumed run starts from the step the signalled run saved and exited at;
    # with accumulation windows of 4 (the signal's save may fall inside one: the harder
    # case; save_on_signal without accumulation is tests/integration/signals/test_preemption.py)
    proc = _demo("--url", str(tmp_path / "run"), "--preempt", "--grad-accum", "4", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "saved the step it reached and exited after step" in proc.stdout
    assert "exit code 143; resumed exactly from step" in proc.stdout
    assert "resume exact         yes" in proc.stdout


@pytest.mark.slow
def test_demo_preempted_during_an_evaluation_is_saved_from_the_watcher_and_resumes_exactly(tmp_path):
    # make demo-preempt-eval: the SIGTERM lands 1 s into a 60 s evaluation after the kill step;
    # the demo fails unless the watcher saved that step before the evaluation ended and the
    # resumed run starts there, bit for bit
    proc = _demo("--url", str(tmp_path / "run"), "--preempt-eval", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "sent SIGTERM 1 s into an evaluation at step" in proc.stdout
    assert "saved from the watcher at step" in proc.stdout and "while the main thread was in evaluate_long" in proc.stdout
    assert "resume exact         yes" in proc.stdout
