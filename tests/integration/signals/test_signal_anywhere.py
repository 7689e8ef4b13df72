"""The save on a signal from anywhere in the loop (``PreemptionPolicy(watcher=True)``, the
default), with real signals and real processes: a SIGTERM during a 60 s evaluation or a
stalled data loader is saved from the watcher thread at once (the last completed step), the
process exits 143 before the evaluation ends, and the resumed run equals the uninterrupted
one bit for bit; a SIGTERM inside a training step that changed a BatchNorm buffer falls
back to the next step boundary, still exact. Two torchrun ranks save the same step.
The signal-to-commit seconds are in the watcher's log line (bench/signal_save.py reports them)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

import statekit

from accelerate_helpers import SCRIPTS, script_command

pytest.importorskip("accelerate")

SCRIPT = SCRIPTS / "signal_anywhere.py"
TOTAL, EVAL_AT, MIDSTEP_AT = 14, 6, 11  # signal_anywhere's
SAVED = re.compile(r"SIGTERM: saved from the watcher at step (\d+) while the main thread was (.*), committed at \S+, "
                   r"([\d.]+) s after the signal")


class Child:
    """``signal_anywhere.py`` in one process or under torchrun, its stdout read line by line."""

    def __init__(self, mode: str, root: Path, out: Path, nproc: int = 1, **env: str) -> None:
        self.out, self.nproc = out, nproc
        cmd = script_command(SCRIPT, mode, str(root), str(out), nproc=nproc)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "OMP_NUM_THREADS": "1", **env})
        self.lines: list[str] = []
        self.pids: dict[int, int] = {}
        self.stderr = ""

    def until(self, *words: str, count: int = 1) -> None:
        """Read stdout until ``count`` lines starting with ``words`` were seen (an event, not a sleep)."""
        seen = 0
        for line in self.proc.stdout:
            self.lines.append(line)
            parts = line.split()
            if parts[:1] == ["ready"]:
                self.pids[int(parts[1])] = int(parts[2])
            if parts[: len(words)] == list(words):
                seen += 1
                if seen == count:
                    return
        self.proc.wait()
        raise AssertionError(f"child ended before {words}: {''.join(self.lines)[-2000:]}{self.proc.stderr.read()[-3000:]}")

    def finish(self, timeout: float = 240) -> int:
        """Read the rest of stdout (through the same buffered reader as :meth:`until`:
        ``communicate`` would skip what it buffered) and stderr; kill a child still running
        after ``timeout`` seconds (a hang fails the test instead of blocking it)."""
        watchdog = threading.Timer(timeout, self.proc.kill)
        watchdog.start()
        try:
            self.lines.append(self.proc.stdout.read())
            self.stderr = self.proc.stderr.read()
            self.proc.wait()
        finally:
            watchdog.cancel()
        return self.proc.returncode

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def losses(self, rank: int = 0) -> list[str]:
        """The losses the child printed, by step (float.hex)."""
        return [line.split()[3] for line in self.text.splitlines() if line.split()[:2] == ["step", str(rank)]]

    def results(self) -> list[dict]:
        return [torch.load(f"{self.out}.rank{r}.pt") for r in range(self.nproc)]


def run_child(mode: str, root: Path, out: Path, nproc: int = 1, **env: str) -> list[dict]:
    child = Child(mode, root, out, nproc, **env)
    code = child.finish()
    assert code == 0, child.text[-2000:] + child.stderr[-3000:]
    return child.results()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    cache: dict[int, list[dict]] = {}
    work = tmp_path_factory.mktemp("reference")

    def get(nproc: int = 1) -> list[dict]:
        if nproc not in cache:
            cache[nproc] = run_child("reference", work / f"root{nproc}", work / f"ref{nproc}", nproc)
        return cache[nproc]

    return get


def signalled(tmp_path: Path, event: tuple[str, ...], nproc: int = 1, **env: str) -> Child:
    """Start a run, wait for ``event`` on every rank, send SIGTERM about 1 s later to every
    rank (as ``scancel --signal=TERM`` does to each task)."""
    child = Child("run", tmp_path / "root", tmp_path / "first", nproc, **env)
    child.until(*event, count=nproc)
    time.sleep(1.0)  # the scenario: the signal lands 1 s into the evaluation (or stall), not a synchronisation
    for pid in child.pids.values():
        os.kill(pid, signal.SIGTERM)
    return child


def _alive(pid: int) -> bool:
    """A process that runs (not gone, not a zombie waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def committed_step(root: Path) -> int:
    latest = statekit.CheckpointManager({}, str(root)).latest()
    assert latest is not None
    return int(latest.rsplit("-", 1)[1])


def assert_resumes_exactly(tmp_path: Path, reference: list[dict], first: Child, step: int, nproc: int = 1) -> None:
    """The resumed run starts at ``step``; the first run's losses up to it and the resumed
    run's equal the uninterrupted run's, and so do the final weights (torch.equal), on every rank."""
    resumed = run_child("run", tmp_path / "root", tmp_path / "resumed", nproc)
    for rank, (ref, res) in enumerate(zip(reference, resumed)):
        assert res["start"] == step and res["code"] == 0, (rank, res["start"])
        assert first.losses(rank)[:step] + res["losses"] == ref["losses"], f"rank {rank}"
        assert ref["weights"].keys() == res["weights"].keys()
        assert all(torch.equal(ref["weights"][k], res["weights"][k]) for k in ref["weights"]), f"rank {rank}"


@pytest.mark.slow
def test_a_sigterm_during_a_60_s_evaluation_is_saved_from_the_watcher_and_resumes_exactly(tmp_path, reference):
    child = signalled(tmp_path, ("evaluation", "started"), STATEKIT_TEST_WHERE="eval")
    assert child.finish() == 143
    assert "evaluation done" not in child.text
    saved = SAVED.search(child.stderr)
    assert saved and int(saved.group(1)) == EVAL_AT, child.stderr[-3000:]
    assert "in evaluate (signal_anywhere.py" in saved.group(2), saved.group(2)
    assert committed_step(tmp_path / "root") == EVAL_AT
    assert_resumes_exactly(tmp_path, reference(), child, EVAL_AT)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_a_sigterm_during_a_data_loader_stall_is_saved_from_the_watcher_and_resumes_exactly(tmp_path, reference,
                                                                                           workers):
    child = signalled(tmp_path, ("stall", "started"), STATEKIT_TEST_WHERE="stall", STATEKIT_TEST_WORKERS=str(workers))
    assert child.proc.wait(timeout=240) == 143
    # the stalled DataLoader workers end with the run (os._exit skips multiprocessing's own exit
    # function): none outlives it holding the job's stdout
    stalled = {int(line.split()[3]) for line in child.text.splitlines() if line.startswith("stall started")}
    assert [pid for pid in stalled - set(child.pids.values()) if _alive(pid)] == []
    assert child.finish() == 143
    last = len(child.losses())  # the last completed step (with workers: the batches fetched ahead were trained)
    saved = SAVED.search(child.stderr)
    assert saved and int(saved.group(1)) == last, child.stderr[-3000:]
    assert committed_step(tmp_path / "root") == last
    assert_resumes_exactly(tmp_path, reference(), child, last)


@pytest.mark.slow
def test_a_sigterm_inside_a_training_step_falls_back_to_the_next_boundary_and_resumes_exactly(tmp_path, reference):
    # after the forward and backward of step 11 BatchNorm's statistics have changed: the watcher
    # cannot prove the boundary of step 10 and falls back; the step ends and its boundary saves 11
    child = signalled(tmp_path, ("in-step", "0", str(MIDSTEP_AT)), STATEKIT_TEST_WHERE="mid-step")
    assert child.finish() == 143
    (first,) = child.results()
    assert first["code"] == 143 and first["stopped"] == MIDSTEP_AT
    result = first["result"]
    assert result["step"] == MIDSTEP_AT and result["from_watcher"] is False, result
    # (BatchNorm's kernel writes running_mean/var without bumping their version counters;
    # num_batches_tracked, bumped by an add_ in Python each training forward, is what tells)
    assert result["path"].startswith(f"fell back: model_0.1.num_batches_tracked changed since step {MIDSTEP_AT - 1}"), \
        result
    assert result["path"].endswith(f"saved at the step boundary {MIDSTEP_AT}"), result
    assert committed_step(tmp_path / "root") == MIDSTEP_AT
    assert_resumes_exactly(tmp_path, reference(), child, MIDSTEP_AT)


@pytest.mark.slow
def test_two_torchrun_ranks_signalled_during_an_evaluation_save_the_same_step_from_their_watchers(tmp_path, reference):
    child = signalled(tmp_path, ("evaluation", "started"), nproc=2, STATEKIT_TEST_WHERE="eval")
    assert child.finish() != 0  # torchrun: its workers failed
    assert "evaluation done" not in child.text
    steps = [int(m.group(1)) for m in SAVED.finditer(child.stderr)]
    assert steps == [EVAL_AT, EVAL_AT], child.stderr[-4000:]
    exits = sorted(re.findall(r"rank\s*: (\d) \(local_rank: \d\)\s+exitcode\s*: (\d+)", child.stderr))
    assert exits == [("0", "143"), ("1", "143")], child.stderr[-3000:]  # torchrun's failure summary
    assert committed_step(tmp_path / "root") == EVAL_AT
    assert_resumes_exactly(tmp_path, reference(2), child, EVAL_AT, nproc=2)
