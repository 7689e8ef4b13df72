"""Save on a signal (``CheckpointManager(save_on_signal=True)``), with real signals and real
processes: one process, and two torchrun ranks (gloo). Each signalled run leaves a committed
checkpoint of the step it reached, exits 143, and the next start resumes exactly from it
(losses and weights equal a run that was never interrupted)."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
from pathlib import Path

import pytest
import torch

import statekit
from statekit.errors import InvalidOptionError

from accelerate_helpers import SCRIPTS, script_command

pytest.importorskip("accelerate")

SCRIPT = SCRIPTS / "signal_train.py"
TOTAL = 24  # signal_train.TOTAL


# --------------------------------------------------------------------------- running the worker


class Worker:
    """``signal_train.py`` in one process or under torchrun, its stdout read line by line."""

    def __init__(self, mode: str, root: Path, out: Path, nproc: int = 1, env: dict[str, str] | None = None) -> None:
        self.out, self.nproc = out, nproc
        for rank in range(nproc):
            fifo = Path(f"{out}.rank{rank}.fifo")
            if not fifo.exists():
                os.mkfifo(fifo)
        cmd = script_command(SCRIPT, mode, str(root), str(out), nproc=nproc)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
        self.pids: dict[int, int] = {}
        self.lines: list[str] = []

    def until(self, *words: str) -> list[str]:
        """Read stdout up to the first line starting with ``words`` (fails if the process ends first)."""
        for line in self.proc.stdout:
            self.lines.append(line)
            parts = line.split()
            if parts[:1] == ["ready"]:
                self.pids[int(parts[1])] = int(parts[2])
            if parts[: len(words)] == list(words):
                return parts
        self.proc.wait()
        raise AssertionError(f"worker ended before {words}: {''.join(self.lines)[-2000:]}{self.proc.stderr.read()[-3000:]}")

    def until_each(self, *lines: tuple[str, ...]) -> None:
        """Read stdout until a line starting with each of ``lines`` was seen, in any order."""
        wanted = [list(words) for words in lines]
        for line in self.proc.stdout:
            self.lines.append(line)
            parts = line.split()
            if parts[:1] == ["ready"]:
                self.pids[int(parts[1])] = int(parts[2])
            wanted = [words for words in wanted if parts[: len(words)] != words]
            if not wanted:
                return
        self.proc.wait()
        raise AssertionError(f"worker ended before {wanted}: {''.join(self.lines)[-2000:]}{self.proc.stderr.read()[-3000:]}")

    def release(self, rank: int = 0) -> None:
        """Let a paused rank go on (it blocks on its FIFO until a line is written)."""
        with open(f"{self.out}.rank{rank}.fifo", "w") as fifo:
            fifo.write("go\n")

    def finish(self, timeout: float = 240) -> int:
        rest, err = self.proc.communicate(timeout=timeout)
        self.lines.append(rest)
        self.stderr = err
        return self.proc.returncode

    def results(self) -> list[dict]:
        missing = [r for r in range(self.nproc) if not Path(f"{self.out}.rank{r}.json").exists()]
        assert not missing, (f"ranks {missing} wrote no result (exit status {self.proc.returncode}): "
                             f"{''.join(self.lines)[-2000:]}{getattr(self, 'stderr', '')[-4000:]}")
        return [json.loads(Path(f"{self.out}.rank{r}.json").read_text()) for r in range(self.nproc)]


def run_worker(mode: str, root: Path, out: Path, nproc: int = 1, **env: str) -> list[dict]:
    worker = Worker(mode, root, out, nproc, env)
    code = worker.finish()
    assert code == 0, "".join(worker.lines)[-2000:] + worker.stderr[-3000:]
    return worker.results()


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[tuple[int, int], list[dict]]:
    """Uninterrupted runs, per (nproc, accum), computed on first use."""
    cache: dict[tuple[int, int], list[dict]] = {}
    work = tmp_path_factory.mktemp("reference")

    def get(nproc: int = 1, accum: int = 1) -> list[dict]:
        if (nproc, accum) not in cache:
            cache[nproc, accum] = run_worker("reference", work / f"root{nproc}-{accum}", work / f"ref{nproc}-{accum}",
                                             nproc, STATEKIT_TEST_ACCUM=str(accum))
        return cache[nproc, accum]

    return get


def assert_resumes_exactly(reference: list[dict], first: list[dict], resumed: list[dict], step: int) -> None:
    """The first run stopped at ``step`` with a signal; the resumed run started from it and
    its losses and final weights equal the uninterrupted reference's, on every rank."""
    for rank, (ref, a, b) in enumerate(zip(reference, first, resumed)):
        assert a["code"] == 143 and a["stopped"] == step, (rank, a["code"], a["stopped"])
        assert a["result"]["step"] == step and a["result"]["seconds"] < a["result"]["grace_s"], a["result"]
        assert b["start"] == step and b["code"] == 0, (rank, b["start"])
        assert a["losses"][:step] + b["losses"] == ref["losses"], f"rank {rank}"
        for key, value in ref["weights"].items():
            assert torch.equal(torch.tensor(b["weights"][key]), torch.tensor(value)), f"rank {rank} {key}"


def signalled_run(tmp_path: Path, pause: str, *, nproc: int = 1, target: int | None = 0, sig=signal.SIGTERM,
                  name: str = "first", **env: str) -> tuple[Worker, list[dict]]:
    """A run paused at ``pause`` (``where:step``) on every rank, signalled there (to rank
    ``target``'s process, or None: to torchrun's launcher), released; returns it finished."""
    worker = Worker("run", tmp_path / "root", tmp_path / name, nproc, {"STATEKIT_TEST_PAUSE": pause, **env})
    for _ in range(nproc):
        worker.until("paused")
    os.kill(worker.proc.pid if target is None else worker.pids[target], sig)
    for rank in range(nproc):
        worker.release(rank)
    code = worker.finish()
    assert code != 0 or nproc > 1, "".join(worker.lines)[-2000:]
    return worker, worker.results()


# --------------------------------------------------------------------------- one process


@pytest.mark.slow
def test_a_signal_mid_accumulation_then_one_during_the_resume_each_save_the_next_safe_point(tmp_path, reference):
    # one chain of runs (accumulation over 3 micro-batches): the first is signalled during
    # micro-batch 7 and saves 9, the end of its window; the second is signalled while it loads
    # checkpoint 9 and saves 12 (the first window end after the resume: a signal during the load
    # is recorded and acted on at the first safe point); the third resumes from 12 exactly
    _, first = signalled_run(tmp_path, "mid-step:7", STATEKIT_TEST_ACCUM="3")
    assert first[0]["code"] == 143 and first[0]["stopped"] == 9 and first[0]["result"]["step"] == 9
    assert statekit.CheckpointManager({}, str(tmp_path / "root")).latest().endswith("checkpoint-00000009")
    _, second = signalled_run(tmp_path, "load:0", name="second", STATEKIT_TEST_ACCUM="3")
    assert second[0]["start"] == 9 and second[0]["stopped"] == 12 and second[0]["result"]["step"] == 12
    resumed = run_worker("run", tmp_path / "root", tmp_path / "resumed", STATEKIT_TEST_ACCUM="3")
    assert_resumes_exactly(reference(1, 3), [{**second[0], "losses": first[0]["losses"][:9] + second[0]["losses"]}],
                           resumed, 12)


@pytest.mark.slow
def test_an_async_save_in_flight_at_a_signal_commits_first_or_is_left_at_the_deadline(tmp_path, reference):
    # one chain of runs with async saves every 4 steps. First: the async save of step 8 stalls
    # on its storage (held until the test writes to a FIFO, which it never does); the signal's
    # safe point at step 10 waits for it only for the grace left (grace_s=2), then warns and
    # exits without saving: step 4 stays latest, step 8 stays uncommitted (the process dies
    # with it in flight). Second: resumes from 4; a SIGUSR1 right after the async save of 8
    # started: that save commits first and is the signal's checkpoint, not written twice.
    # Third: resumes from 8 exactly.
    worker = Worker("run", tmp_path / "root", tmp_path / "first", env={
        "STATEKIT_TEST_ASYNC": "1", "STATEKIT_TEST_HOLD": "8", "STATEKIT_TEST_PAUSE": "mid-step:10",
        "STATEKIT_TEST_GRACE": "2"})
    worker.until_each(("holding", "0", "8"), ("paused", "0", "mid-step", "10"))
    os.kill(worker.pids[0], signal.SIGTERM)
    worker.release()
    assert worker.finish() == 143
    (first,) = worker.results()
    root = tmp_path / "root"
    assert first["stopped"] == 10
    assert first["result"] == {**first["result"], "signal": "SIGTERM", "step": 4, "saved": False, "in_flight": 8,
                               "url": f"holdfile://{root}/checkpoint-00000004"}
    assert re.search(r"save_on_signal: the async save of step 8 is still writing after [\d.]+ s of waiting, the grace "
                     r"left by grace_s=2 s less the signal's own save's estimated [\d.]+ s; step 10 is not saved and "
                     rf"the newest committed checkpoint, holdfile://{root}/checkpoint-00000004, stays latest",
                     worker.stderr), worker.stderr[-3000:]
    waited = float(re.search(r"still writing after ([\d.]+) s", worker.stderr).group(1))
    assert 1.0 < waited <= 2.0
    manager = statekit.CheckpointManager({}, str(root))
    assert [(c.step, c.committed) for c in manager.list()] == [(4, True), (8, False)]
    assert manager.latest().endswith("checkpoint-00000004")

    _, second = signalled_run(tmp_path, "after-async-save:8", sig=signal.SIGUSR1, name="second",
                              STATEKIT_TEST_ASYNC="1")
    assert second[0]["code"] == 138 and second[0]["start"] == 4 and second[0]["stopped"] == 8
    assert second[0]["result"]["saved"] is False and second[0]["result"]["signal"] == "SIGUSR1"
    assert [(c.step, c.committed) for c in manager.list()] == [(4, True), (8, True)]
    resumed = run_worker("run", root, tmp_path / "resumed", STATEKIT_TEST_ASYNC="1")
    assert_resumes_exactly(reference(), [{**second[0], "code": 143, "losses": first["losses"][:4] + second[0]["losses"]}],
                           resumed, 8)


@pytest.mark.slow
@pytest.mark.parametrize("copy_finishes", [True, False], ids=["copy-finishes", "copy-stalls"])
def test_a_signal_during_replication_commits_locally_and_resumes_from_either_tier(tmp_path, reference, copy_finishes):
    # replicate_to a remote tier; the copy of step 8 is held (FIFO) when the signal arrives
    # (the run paused mid-step 10). The signal's checkpoint (10) commits locally, the remote
    # copy is waited for until the deadline, the run exits 143. copy-finishes: the test lets the
    # held copy go on, 8 and 10 reach the remote tier within the grace, and a fresh local root
    # resumes from the remote 10. copy-stalls: it never does, grace_s=2 runs out, a warning names
    # the remote copy not made, the remote tier's newest stays 4, and the local root resumes from 10.
    remote = tmp_path / "remote"
    env = {"STATEKIT_TEST_ASYNC": "1", "STATEKIT_TEST_REMOTE": str(remote), "STATEKIT_TEST_HOLD_COPY": "8"}
    # copy-stalls exits through the interpreter's own exit (atexit's wait for queued copies
    # included): it must end with the grace period, not STATEKIT_REPLICATION_EXIT_TIMEOUT
    worker = Worker("run", tmp_path / "root", tmp_path / "first", env={
        **env, "STATEKIT_TEST_PAUSE": "mid-step:10", "STATEKIT_TEST_GRACE": "30" if copy_finishes else "2",
        **({} if copy_finishes else {"STATEKIT_TEST_NORMAL_EXIT": "1", "STATEKIT_REPLICATION_EXIT_TIMEOUT": "600"})})
    worker.until_each(("holding", "0", "8"), ("paused", "0", "mid-step", "10"))
    os.kill(worker.pids[0], signal.SIGTERM)
    worker.release()
    if copy_finishes:
        with open(tmp_path / "first.rank0.hold.fifo", "w") as fifo:
            fifo.write("go\n")
    assert worker.finish() == 143, worker.stderr[-3000:]
    (first,) = worker.results()
    assert first["stopped"] == 10 and first["result"]["step"] == 10 and first["result"]["saved"] is True
    assert first["result"]["seconds"] < first["result"]["grace_s"]  # to the local commit
    assert first["result"]["replicated"] is copy_finishes
    assert statekit.CheckpointManager({}, str(tmp_path / "root")).latest().endswith("checkpoint-00000010")
    remote_latest = statekit.CheckpointManager({}, str(remote)).latest()
    ref = reference()[0]
    if copy_finishes:
        assert remote_latest.endswith("checkpoint-00000010")
        resume_root = tmp_path / "fresh"  # a new machine: only the remote tier holds the run
    else:
        assert remote_latest.endswith("checkpoint-00000004")
        assert f"holdfile://{remote}/checkpoint-00000010" in worker.stderr, worker.stderr[-3000:]
        resume_root = tmp_path / "root"
    env.pop("STATEKIT_TEST_HOLD_COPY")
    resumed = run_worker("run", resume_root, tmp_path / "resumed", **env)
    assert resumed[0]["start"] == 10 and resumed[0]["stopped"] == TOTAL
    assert first["losses"][:10] + resumed[0]["losses"] == ref["losses"]
    for key, value in ref["weights"].items():
        assert torch.equal(torch.tensor(resumed[0]["weights"][key]), torch.tensor(value)), key
    assert statekit.CheckpointManager({}, str(remote)).latest().endswith(f"checkpoint-{TOTAL:08d}")


# --------------------------------------------------------------------------- two torchrun ranks


@pytest.mark.slow
def test_a_signal_to_one_rank_then_one_to_the_torchrun_launcher_each_stop_both_ranks_at_one_step(tmp_path, reference):
    # one chain of 2-rank runs (accumulation 2). First: SIGTERM to rank 1 only; the ranks agree at
    # their next check (every step boundary: PreemptionPolicy(check_every=1), the default) and
    # save the same step. Second: SIGTERM to torchrun's launcher,
    # which forwards it to each worker a moment later, so the step they agree on is the first
    # optimizer step end both reach after it. Third: resumes exactly.
    accum = {"STATEKIT_TEST_ACCUM": "2"}
    _, first = signalled_run(tmp_path, "mid-step:5", nproc=2, target=1, **accum)
    assert [r["result"]["signal"] for r in first] == [None, "SIGTERM"]  # rank 0 learnt it from the all-reduce
    step1 = first[0]["stopped"]
    assert step1 >= 6 and step1 % 2 == 0 and first[1]["stopped"] == step1
    assert all(r["code"] == 143 and r["result"]["step"] == step1 for r in first)
    _, second = signalled_run(tmp_path, f"mid-step:{step1 + 3}", nproc=2, target=None, name="second", **accum)
    assert all(r["result"]["signal"] == "SIGTERM" for r in second)  # forwarded by torchrun to every worker
    assert all(r["start"] == step1 for r in second)
    step2 = second[0]["stopped"]
    assert step2 >= step1 + 3 and second[1]["stopped"] == step2
    resumed = run_worker("run", tmp_path / "root", tmp_path / "resumed", nproc=2, **accum)
    both = [{**b, "losses": a["losses"][:step1] + b["losses"]} for a, b in zip(first, second)]
    assert_resumes_exactly(reference(2, 2), both, resumed, step2)


# --------------------------------------------------------------------------- stress


@pytest.mark.slow
def test_signals_at_random_moments_each_leave_a_checkpoint_the_next_start_resumes_exactly(tmp_path, reference):
    """STATEKIT_TEST_SIGNALS signals (default 8; each is a process start, about 4 s here),
    each sent after a random number of steps (so at a random point of a step, of a
    boundary's flag check, of an async save every 4 steps or of its copy to the remote tier
    (replicate_to, a local directory)), SIGTERM or SIGUSR1. Every
    signalled run exits 128 + signum with a committed checkpoint of the step it stopped
    at, the next start resumes from exactly that step, and each chain of runs reaches
    TOTAL with the reference's losses and weights; then a new chain starts.
    STATEKIT_TEST_SIGNALS=100 passed locally (28 chains, 775 s on a shared 2-core machine).
    STATEKIT_TEST_NPROC=2 runs the chains under torchrun with 2 ranks, each signal sent to a
    random rank or to the launcher (which forwards SIGTERM to both)."""
    count = int(os.environ.get("STATEKIT_TEST_SIGNALS", "8"))
    nproc = int(os.environ.get("STATEKIT_TEST_NPROC", "1"))  # 2: torchrun, the signal to a random rank or the launcher
    rng = random.Random(int(os.environ.get("STATEKIT_TEST_SEED", "0")) or None)
    ref = reference(nproc)
    sent = chains = 0
    while sent < count:
        chains += 1
        root, losses, step, runs = tmp_path / f"chain{chains}", [[] for _ in range(nproc)], 0, 0
        root.mkdir()
        while step < TOTAL:
            runs += 1
            worker = Worker("run", root / "root", root / f"run{runs}", nproc=nproc,
                            env={"STATEKIT_TEST_ASYNC": "1", "STATEKIT_TEST_REMOTE": str(root / "remote")})
            sig = None
            if sent < count and step < TOTAL - 2:
                target = rng.choice([*range(nproc), None] if nproc > 1 else [0])  # None: torchrun's launcher
                sig = signal.SIGTERM if target is None else rng.choice([signal.SIGTERM, signal.SIGUSR1])
                worker.until("step", "0", str(rng.randrange(step + 1, TOTAL - 1)))
                if target is not None and target not in worker.pids:
                    worker.until("ready", str(target))
                os.kill(worker.proc.pid if target is None else worker.pids[target], sig)
                sent += 1
            worker.finish()
            results = worker.results()
            stopped = {r["stopped"] for r in results}
            assert len(stopped) == 1, (chains, runs, stopped)  # every rank stopped at one step
            for r in results:
                assert r["start"] == step, (chains, runs, r["start"], step)  # from the step the signal stopped
                if r["code"] == 0:
                    assert r["stopped"] == TOTAL
                else:
                    assert sig is not None and r["code"] == 128 + sig and r["result"]["step"] == r["stopped"], (
                        r["code"], r["result"])
            for rank, r in enumerate(results):
                losses[rank] += r["losses"]
            step = stopped.pop()
        for rank in range(nproc):
            assert losses[rank] == ref[rank]["losses"], f"chain {chains} rank {rank}"
            for key, value in ref[rank]["weights"].items():
                assert torch.equal(torch.tensor(results[rank]["weights"][key]), torch.tensor(value)), (chains, rank, key)
        remote = statekit.CheckpointManager({}, str(root / "remote")).latest()  # the last run's wait() replicated all
        assert remote.endswith(f"checkpoint-{TOTAL:08d}"), (chains, remote)


# --------------------------------------------------------------------------- in this process


def _objects():
    model = torch.nn.Linear(3, 2)
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}


def test_handlers_chain_to_the_previous_python_handler_and_are_restored_on_exit(tmp_path):
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:
        installed = signal.getsignal(signal.SIGUSR1)
        with statekit.CheckpointManager(_objects(), str(tmp_path / "root"), save_on_signal=statekit.PreemptionPolicy(
                                            signals=("USR1",), on_signal="return")) as manager:
            assert signal.getsignal(signal.SIGTERM) is not manager  # only the signals asked for
            os.kill(os.getpid(), signal.SIGUSR1)
            os.kill(os.getpid(), signal.SIGUSR1)  # a second signal: counted, nothing else
            assert seen == [signal.SIGUSR1, signal.SIGUSR1]
            assert manager.signal_save.signal_count == 2
            assert manager.step_boundary(3) is True and manager.should_stop
            assert manager.signal_save.result["step"] == 3 and manager.signal_save.result["signal"] == "SIGUSR1"
            assert manager.latest().endswith("checkpoint-00000003")
            assert manager.step_boundary(4) is True  # stopped: nothing more is saved
        assert signal.getsignal(signal.SIGUSR1) is installed
        assert [c.step for c in manager.list()] == [3]
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_a_save_call_is_a_safe_point_and_becomes_the_signals_save(tmp_path):
    # the safe points' path (watcher=False: else the watcher may save step 1 before save(2) runs)
    with statekit.CheckpointManager(_objects(), str(tmp_path / "root"), async_save=True,
                                    save_on_signal=statekit.PreemptionPolicy(on_signal="return", watcher=False)) as manager:
        assert manager.step_boundary(1) is False
        os.kill(os.getpid(), signal.SIGTERM)
        manifest = manager.save(2)  # blocking despite async_save: committed on return
        assert manifest.step == 2 and manager.should_stop and manager.pending is None


def test_save_on_signal_exit_raises_systemexit_with_128_plus_the_signal(tmp_path):
    with pytest.raises(SystemExit) as info:
        with statekit.CheckpointManager(_objects(), str(tmp_path / "root"), save_on_signal=True) as manager:
            os.kill(os.getpid(), signal.SIGUSR1)
            manager.step_boundary(5)
    assert info.value.code == 138
    assert statekit.CheckpointManager({}, str(tmp_path / "root")).latest().endswith("checkpoint-00000005")


def test_a_safe_point_later_than_the_grace_period_warns_with_the_step_time(tmp_path):
    with statekit.CheckpointManager(_objects(), str(tmp_path / "root"), save_on_signal=statekit.PreemptionPolicy(
            on_signal="return", grace_s=1e-9, watcher=False)) as manager:  # the safe points' warnings
        manager.step_boundary(1)
        with pytest.warns(statekit.StatekitWarning, match=r"passed between two safe points .* more than grace_s=1e-09"):
            manager.step_boundary(2)
        os.kill(os.getpid(), signal.SIGTERM)
        with pytest.warns(statekit.StatekitWarning, match=r"the safe point at step 3 came .* after SIGTERM, past grace_s"):
            manager.step_boundary(3)
    assert manager.latest().endswith("checkpoint-00000003")


def test_with_the_watcher_the_long_stretch_warning_says_what_the_watcher_does_not_cover(tmp_path):
    with statekit.CheckpointManager(_objects(), str(tmp_path / "root"), save_on_signal=statekit.PreemptionPolicy(
            on_signal="return", grace_s=1e-9)) as manager:  # the watcher on (the default); no signal is sent
        manager.step_boundary(1)
        with pytest.warns(statekit.StatekitWarning, match=r"more than grace_s=1e-09 s: a signal in such a stretch is "
                                                          r"saved by the watcher only when nothing changed the state"):
            manager.step_boundary(2)


@pytest.mark.parametrize("save_on_signal, message", [
    (lambda: ("SIGKILL",), "save_on_signal: SIGKILL cannot be handled by any process"),
    (lambda: ("SIGNOPE",), "save_on_signal: 'SIGNOPE' is not a signal"),
    (lambda: 3.5, "save_on_signal must be True, False or a tuple of signals, got 3.5"),
    (lambda: statekit.PreemptionPolicy(on_signal="quit"), "on_signal must be 'exit' or 'return', got 'quit'"),
    (lambda: statekit.PreemptionPolicy(grace_s=0), "grace_s must be a positive number of seconds, got 0"),
    (lambda: statekit.PreemptionPolicy(check_every=0), "PreemptionPolicy.check_every must be a positive integer, got 0"),
])
def test_bad_save_on_signal_options_are_refused_by_name(tmp_path, save_on_signal, message):
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(InvalidOptionError, match=re.escape(message)):
        statekit.CheckpointManager(_objects(), str(tmp_path / "root"), save_on_signal=save_on_signal())
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_save_estimated_past_the_deadline_warns_with_the_measured_write_rate(tmp_path):
    with statekit.CheckpointManager(_objects(), str(tmp_path / "root"), save_on_signal=statekit.PreemptionPolicy(
            on_signal="return", grace_s=1e-9, watcher=False)) as manager:  # the safe points' warnings
        manager.save(1)  # measures the write rate
        os.kill(os.getpid(), signal.SIGTERM)
        with pytest.warns(statekit.StatekitWarning) as record:
            assert manager.step_boundary(2)
    messages = [str(w.message) for w in record]
    assert any(re.search(r"step 2 needs about .* s \(\d[\d,]* bytes at the measured .* MiB/s of the last save\), "
                         r".* of grace_s=1e-09 s remain; no faster local tier is configured", m) for m in messages), messages
    assert manager.latest().endswith("checkpoint-00000002")  # written anyway


def test_a_hook_based_trainer_saves_on_a_signal_at_its_step_end_and_resumes_there(tmp_path):
    objects = _objects()
    progress = statekit.TrainerProgress()
    with statekit.CheckpointManager({**objects, "trainer": progress}, str(tmp_path / "root"),
                                    save_on_signal=statekit.PreemptionPolicy(on_signal="return")) as manager:
        hook = statekit.CheckpointHook(manager, progress, every_n_steps=5)
        hook.on_loop_begin()
        while not manager.should_stop:  # the trainer's loop checks should_stop after each step end
            objects["model"](torch.randn(2, 3)).sum().backward()
            objects["optimizer"].step()
            objects["optimizer"].zero_grad()
            progress.finish_step()
            if progress.global_step == 7:
                os.kill(os.getpid(), signal.SIGTERM)
            hook.on_step_end()
    saved = {k: v.clone() for k, v in objects["model"].state_dict().items()}
    fresh = _objects()
    progress2 = statekit.TrainerProgress()
    with statekit.CheckpointManager({**fresh, "trainer": progress2}, str(tmp_path / "root")) as manager2:
        assert statekit.CheckpointHook(manager2, progress2, every_n_steps=5).on_loop_begin() == 7
    assert progress2.global_step == 7
    for key, value in saved.items():
        assert torch.equal(fresh["model"].state_dict()[key], value)
