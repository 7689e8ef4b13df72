"""statekit.CheckpointHook in a hook-based trainer (issue 13 item 8).

``examples/hook_trainer.py`` (loop/epoch/step/micro-batch hooks, 3 micro-batches per
optimizer step, 4 optimizer steps per epoch, saves every 3 steps and at every epoch end)
runs uninterrupted in one process, and in a chain of processes SIGKILLed after steps 5
and 10, each resuming from the newest checkpoint (step 4: an epoch-end save; step 9: a
mid-epoch step-end save). Every loss any process logged and the final state dicts must
equal the uninterrupted run's bit for bit. The hook's own contract (loud refusals, no
double save, async wait, Accelerate) is tested in-process in ``unit/manager/test_trainer_hook.py``.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import statekit
from statekit.testing import assert_state_equal

from repo_paths import ROOT  # noqa: E402

EXAMPLE = ROOT / "examples" / "hook_trainer.py"
STEPS = 16  # 4 epochs x 4 optimizer steps


def _example(url: Path, log: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, str(EXAMPLE), "--url", str(url), "--log", str(log), *extra]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, returncode: int) -> None:
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == returncode, f"{proc.args} exited {proc.returncode}, expected {returncode}:\n{out}"


def _runs(log: Path) -> list[dict]:
    """The log split into runs: ``{"resumed_from": step or None, "losses": {step: loss}}``."""
    runs: list[dict] = []
    for line in log.read_text().splitlines():
        record = json.loads(line)
        if "resumed_from" in record:
            runs.append({"resumed_from": record["resumed_from"], "steps": [], "losses": {}})
        else:
            runs[-1]["steps"].append(record["step"])
            runs[-1]["losses"][record["step"]] = record["loss"]
    return runs


def _assert_final_equal(expected: Path, actual: Path) -> None:
    a, b = torch.load(expected, weights_only=True), torch.load(actual, weights_only=True)
    assert a["model"].keys() == b["model"].keys()
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), f"model weight {name} differs"
    assert_state_equal(a["optimizer"], b["optimizer"], "optimizer")
    assert_state_equal(a["scheduler"], b["scheduler"], "scheduler")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference run (async saves) and the killed-and-resumed chain, run concurrently."""
    tmp = tmp_path_factory.mktemp("hook_trainer")
    reference = _example(tmp / "ref", tmp / "ref.jsonl", "--async-save", "--final", str(tmp / "ref.pt"))
    for kill_at in (5, 10):  # step 4 (epoch end) and step 9 are the newest saves before these kills
        _finish(_example(tmp / "killed", tmp / "killed.jsonl", "--kill-at-step", str(kill_at)), -signal.SIGKILL)
    _finish(_example(tmp / "killed", tmp / "killed.jsonl", "--final", str(tmp / "killed.pt")), 0)
    _finish(reference, 0)
    return tmp


def test_killed_hook_trainer_resumes_exactly(trained: Path):
    (reference,) = _runs(trained / "ref.jsonl")
    assert reference["resumed_from"] is None and reference["steps"] == list(range(1, STEPS + 1))
    runs = _runs(trained / "killed.jsonl")
    # killed after step 5 and after step 10: each resume redoes the steps after its checkpoint
    assert [r["resumed_from"] for r in runs] == [None, 4, 9]
    assert [r["steps"] for r in runs] == [list(range(1, 6)), list(range(5, 11)), list(range(10, STEPS + 1))]
    for run in runs:
        for step, loss in run["losses"].items():
            assert loss.hex() == reference["losses"][step].hex(), f"step {step} after resume from {run['resumed_from']}"
    _assert_final_equal(trained / "ref.pt", trained / "killed.pt")


def test_resume_from_a_step_end_save_at_an_epochs_last_step(trained: Path, tmp_path: Path):
    # checkpoint-12 was saved at the on_step_end of epoch 2's last step (its epoch end saved nothing more)
    root = tmp_path / "root"
    shutil.copytree(trained / "ref", root)
    for later in ("checkpoint-00000015", "checkpoint-00000016"):
        shutil.rmtree(root / later)
    _finish(_example(root, tmp_path / "log.jsonl", "--final", str(tmp_path / "final.pt")), 0)
    (reference,) = _runs(trained / "ref.jsonl")
    (run,) = _runs(tmp_path / "log.jsonl")
    assert run["resumed_from"] == 12 and run["steps"] == [13, 14, 15, 16]
    assert [run["losses"][s] for s in run["steps"]] == [reference["losses"][s] for s in run["steps"]]
    _assert_final_equal(trained / "ref.pt", tmp_path / "final.pt")
