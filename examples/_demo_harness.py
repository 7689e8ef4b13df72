"""The kill-and-resume orchestration shared by ``resume_demo.py`` and ``ddpm_demo.py``.

A demo script keeps only what is its own (the model, the data, one training step, what
its final state holds, its report rows); this module does the rest:

1. a reference training to N steps, in a fresh process;
2. the same training in a child process killed with SIGKILL at a random step in the
   middle of an epoch (with a ``memory://`` URL, in this process: :class:`Abandon`
   stands in for the SIGKILL, as ``memory://`` is private to each process);
3. a new process that resumes from the newest committed checkpoint and trains to N;

each run logs its steps, saves and resume as JSON lines (:func:`jsonl_logger`), which
:mod:`_demo_report` compares and reports on. ``--moto`` starts a local moto S3 server with
:func:`statekit.testing.start_moto_server`.

The scripts import it as ``_demo_harness`` (and ``_demo_report``): Python puts a
script's folder first on ``sys.path``, so ``python examples/resume_demo.py`` finds it
from any directory.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import statekit
from statekit.manager.listing import list_checkpoints

try:  # pytest and moto come with statekit[test]: only --moto needs them
    from statekit.testing import start_moto_server
except ImportError:  # pragma: no cover - an environment without pytest
    start_moto_server = None

BUCKET = "statekit-demo"
"""The bucket ``--moto`` creates on the local server."""

Log = Callable[[dict], None]
Train = Callable[..., None]
"""``train(args, log, resume, abandon_at=None)``: one demo's training, to ``args.steps``."""


class Abandon(Exception):
    """Stands in for SIGKILL when the checkpoints live in this process (memory://)."""


# --------------------------------------------------------------------------- options


def demo_parser(
    doc: str, slug: str, *, steps: int, steps_help: str, save_every: int, keep_last: int
) -> argparse.ArgumentParser:
    """The options every demo has (a demo adds its own), and the hidden worker options."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--url", default=None, help=f"checkpoint root URL (default: ./runs/{slug}-<id>)")
    parser.add_argument("--moto", action="store_true", help=f"start a local moto S3 server and use s3://{BUCKET}/...")
    parser.add_argument("--steps", type=int, default=steps, help=f"training steps (default {steps}: {steps_help})")
    parser.add_argument("--save-every", type=int, default=save_every)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--keep-last", type=int, default=keep_last)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kill-at", type=int, default=None, help="step to kill at (default: random, mid-epoch)")
    parser.add_argument("--preempt", action="store_true",
                        help="send SIGTERM instead of SIGKILL: the run saves the step it reached "
                             "(CheckpointManager(save_on_signal=True)) and exits 143; the next start resumes from that step")
    parser.add_argument("--preempt-eval", action="store_true",
                        help="as --preempt, the SIGTERM landing 1 s into a 60 s evaluation after the kill step: the "
                             "manager's watcher thread saves that step at once and the run exits 143 mid-evaluation")
    parser.add_argument("--eval-at", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--replicate-to", default=None, metavar="URL|moto",
                        help="also replicate every checkpoint to this remote root (moto: a local moto S3 server); "
                             "the resumed run then starts on a fresh node (empty local root) and resumes from it")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--log", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--final", default=None, help=argparse.SUPPRESS)
    return parser


@contextlib.contextmanager
def demo_storage(args: argparse.Namespace, slug: str) -> Iterator[None]:
    """Fill in ``args.url`` (``./runs/<slug>-<id>``, or ``s3://statekit-demo/<slug>-<id>``
    with ``--moto``); with ``--moto``, run a local moto S3 server (the ``AWS_*``
    environment points at it, for this process and its workers) until the block ends."""
    run_id = f"{slug}-{uuid.uuid4().hex[:8]}"
    replicate_moto = getattr(args, "replicate_to", None) == "moto"
    if not args.moto and not replicate_moto:
        args.url = args.url or str(Path("runs") / run_id)
        yield
        return
    if start_moto_server is None:
        raise SystemExit('--moto and --replicate-to moto need pytest and moto: pip install "statekit[test]"')
    with start_moto_server() as server:
        server.filesystem().mkdir(BUCKET)  # statekit never creates buckets
        if args.moto:
            args.url = args.url or f"s3://{BUCKET}/{run_id}"
        else:
            args.url = args.url or str(Path("runs") / run_id)
            args.replicate_to = f"s3://{BUCKET}/{run_id}-replica"
        print(f"moto S3 server at {server.endpoint_url}")
        yield


# --------------------------------------------------------------------------- the training loop


def save_on_signal(args: argparse.Namespace) -> Any:
    """The manager's ``save_on_signal`` for the demo's options: False without ``--preempt``;
    else a policy whose ``before_exit`` logs the save from the watcher (that exit is
    ``os._exit``: nothing after it runs) as the ``signal_save`` event a safe point's
    ``SystemExit`` logs in :func:`train_steps`."""
    if not getattr(args, "preempt", False):
        return False
    log = jsonl_logger(Path(args.log)) if getattr(args, "log", None) else None
    return statekit.PreemptionPolicy(before_exit=(lambda result: log({"event": "signal_save", **result})) if log else None)


def evaluate_long(evaluate: Callable[[], Any], log: Log, seconds: float = 60.0) -> None:
    """An evaluation of about ``seconds``: ``evaluate()`` (under ``no_grad``) again and again,
    logging ``evaluation_started`` first and ``evaluation_done`` last (``--preempt-eval``: the
    SIGTERM lands inside it)."""
    log({"event": "evaluation_started"})
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        evaluate()
        time.sleep(0.5)  # a slow evaluation: mostly outside Python
    log({"event": "evaluation_done"})


def resume_step(manager: statekit.CheckpointManager, log: Log) -> int:
    """Resume from the newest committed checkpoint (step 0 if none), logging how long it took."""
    started = time.perf_counter()
    step = manager.resume() or 0
    log({"event": "resume", "step": step, "seconds": time.perf_counter() - started, "from": manager.resumed_from})
    return step


def train_steps(
    args: argparse.Namespace,
    manager: statekit.CheckpointManager,
    loader: Iterable[Any],
    train_step: Callable[[Any], float],
    log: Log,
    *,
    describe_save: Callable[[Any], dict],
    step: int = 0,
    abandon_at: int | None = None,
    evaluate: Callable[[], Any] | None = None,
) -> int:
    """Run ``train_step(batch)`` (which returns the loss) from ``step`` to ``args.steps``,
    epoch after epoch; log every step; save every ``args.save_every`` steps (logging the
    time, the size and ``describe_save(manifest)``). Returns the last step.

    After each step ``manager.step_boundary(step)``: with ``save_on_signal`` a signal's
    save of that step (in it, or in the periodic ``save``; logged as a ``signal_save``
    event), then ``SystemExit(143)``.

    With ``args.eval_at`` (``--preempt-eval``'s killed run) and ``evaluate``: after that
    step's boundary, :func:`evaluate_long`.

    Raises:
        Abandon: at step ``abandon_at``, right after logging it.
        SystemExit: the save on a signal committed (``--preempt``).
    """
    while step < args.steps:
        for batch in loader:
            loss = train_step(batch)
            step += 1
            log({"event": "step", "step": step, "loss": loss})
            if abandon_at is not None and step == abandon_at:
                raise Abandon(step)
            try:  # save() and step_boundary() are the safe points of save_on_signal (--preempt)
                if step % args.save_every == 0:
                    started = time.perf_counter()
                    manifest = manager.save(step, metrics={"loss": loss})
                    size = manifest.size_bytes
                    log({"event": "save", "step": step, "seconds": time.perf_counter() - started, "bytes": size,
                         **describe_save(manifest)})
                manager.step_boundary(step)
            except SystemExit:
                log({"event": "signal_save", **manager.signal_save.result})
                raise
            if evaluate is not None and getattr(args, "eval_at", None) == step:
                evaluate_long(evaluate, log)
            if step >= args.steps:
                break
    return step


# --------------------------------------------------------------------------- logs


def jsonl_logger(path: Path) -> Log:
    """A ``log(record)`` that appends ``record`` to ``path`` as one JSON line, flushed."""
    handle = path.open("a", buffering=1)

    def log(record: dict) -> None:
        handle.write(json.dumps(record) + "\n")
        handle.flush()

    return log


def read_log(path: Path) -> list[dict]:
    """The records of a JSON-lines log (none if it does not exist yet)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# --------------------------------------------------------------------------- the three runs


@dataclass
class Runs:
    """Where the reference run and the killed-and-resumed run write their logs and final states."""

    work: Path
    ref_log: Path = field(init=False)
    run_log: Path = field(init=False)
    ref_final: str = field(init=False)
    run_final: str = field(init=False)

    def __post_init__(self) -> None:
        self.ref_log, self.run_log = self.work / "reference.jsonl", self.work / "run.jsonl"
        self.ref_final, self.run_final = str(self.work / "final-reference"), str(self.work / "final-resumed")

    def ref_events(self) -> list[dict]:
        return read_log(self.ref_log)

    def run_events(self) -> list[dict]:
        return read_log(self.run_log)


def choose_kill_step(kill_at: int | None, save_every: int, steps: int, batches_per_epoch: int) -> int:
    """``kill_at`` if it is mid-epoch, else a random mid-epoch step after the first save."""
    rng = random.Random()
    while kill_at is None or kill_at % batches_per_epoch == 0:
        kill_at = rng.randrange(save_every + 1, steps - 1)
    return kill_at


def kill_and_resume(
    args: argparse.Namespace,
    *,
    title: str,
    script: str,
    train: Train,
    worker_flags: list[str],
    batches_per_epoch: int,
    work_prefix: str,
) -> Runs:
    """Steps 1 to 3 of the demo (see the module docstring), printing progress.

    Args:
        args: the parsed options (``url``, ``steps``, ``save_every``, ``kill_at``...).
        title: the demo's name in the first line.
        script: the demo script, run with ``--worker`` for each run (not for memory://).
        train: the demo's training function.
        worker_flags: the demo's own options, passed on to each worker.
        batches_per_epoch: batches in one epoch (the kill step is never at its end).
        work_prefix: prefix of the temporary folder for the logs and final states.

    Returns:
        The :class:`Runs`, once the resumed run has finished.
    """
    runs = Runs(Path(tempfile.mkdtemp(prefix=work_prefix)))
    kill_at = choose_kill_step(args.kill_at, args.save_every, args.steps, batches_per_epoch)
    # preempted: between two periodic saves, and early enough for the window's end (--grad-accum) to come
    while getattr(args, "preempt", False) and args.kill_at is None and (
            kill_at % args.save_every == 0 or kill_at > args.steps - 10):
        kill_at = choose_kill_step(None, args.save_every, args.steps, batches_per_epoch)
    print(f"{title}: {args.steps} steps, checkpoint every {args.save_every} to {args.url}")
    ref_args = argparse.Namespace(**{**vars(args), "url": f"{args.url.rstrip('/')}-reference", "replicate_to": None,
                                     "log": str(runs.ref_log), "final": runs.ref_final})
    run_args = argparse.Namespace(**{**vars(args), "log": str(runs.run_log), "final": runs.run_final})
    # with a remote tier the resumed run starts on a "fresh node": an empty local root
    resume_args = argparse.Namespace(**{**vars(run_args), "url": f"{args.url.rstrip('/')}-fresh-node"}) \
        if getattr(args, "replicate_to", None) else run_args
    preempt = getattr(args, "preempt", False)
    if preempt and args.url.startswith("memory://"):
        raise SystemExit("--preempt needs a URL other processes can read (memory:// is private to each process)")
    during_eval = getattr(args, "preempt_eval", False)
    runner = _Runner(train, script, worker_flags + (["--preempt"] if preempt else []),
                     in_process=args.url.startswith("memory://"), sig=signal.SIGTERM if preempt else signal.SIGKILL,
                     during_eval=during_eval)
    print("1. reference run ...", flush=True)
    runner.run(ref_args, resume=False)
    batch = kill_at % batches_per_epoch
    how = ("sent SIGTERM 1 s into an evaluation" if during_eval else "sent SIGTERM (preempted)") if preempt \
        else "killed"
    print(f"2. run {how} at step {kill_at} (mid-epoch: batch {batch} of {batches_per_epoch}) ...", flush=True)
    killed_at = runner.run(run_args, resume=False, kill_at=kill_at)
    print(f"   {'saved the step it reached and exited after step' if preempt else 'killed after step'} {killed_at}")
    print("3. resumed run" + (f" on a fresh node ({resume_args.url}, empty)" if resume_args is not run_args else "") + " ...",
          flush=True)
    runner.run(resume_args, resume=True)
    return runs


@dataclass
class _Runner:
    """Runs a demo's training in a worker process, or in this process for memory:// URLs."""

    train: Train
    script: str
    worker_flags: list[str]
    in_process: bool
    sig: int = signal.SIGKILL
    during_eval: bool = False

    def run(self, args: argparse.Namespace, resume: bool, kill_at: int | None = None) -> int | None:
        """Train to the end, or until killed at ``kill_at``; returns the last step seen when killed."""
        if self.in_process:
            with contextlib.suppress(Abandon):
                self.train(args, jsonl_logger(Path(args.log)), resume=resume, abandon_at=kill_at)
            return kill_at
        command = self.command(args, resume)
        if kill_at is None:
            run_to_end(command)
            return None
        if self.during_eval:
            command += ["--eval-at", str(kill_at)]
        return run_and_kill(command, Path(args.log), kill_at, ready=_remote_committed(args), sig=self.sig,
                            during_eval=self.during_eval)

    def command(self, args: argparse.Namespace, resume: bool) -> list[str]:
        cmd = [sys.executable, self.script, "--worker", "--url", args.url, "--steps", str(args.steps),
               "--save-every", str(args.save_every), "--batch-size", str(args.batch_size), "--seed", str(args.seed),
               "--keep-last", str(args.keep_last), "--log", str(args.log), "--final", args.final, *self.worker_flags]
        if getattr(args, "replicate_to", None):
            cmd += ["--replicate-to", args.replicate_to]
        if resume:
            cmd.append("--resume")
        return cmd


def _remote_committed(args: argparse.Namespace) -> Callable[[], bool] | None:
    """With ``--replicate-to``: whether a checkpoint has committed on the remote tier."""
    remote = getattr(args, "replicate_to", None)
    if not remote:
        return None
    return lambda: any(i.committed for i in list_checkpoints(remote, details=False))


def run_to_end(cmd: list[str]) -> None:
    """Run a worker to its end.

    Raises:
        SystemExit: the worker failed.
    """
    result = subprocess.run(cmd)
    if result.returncode != 0:
        raise SystemExit(f"worker failed with exit code {result.returncode}: {' '.join(cmd)}")


def run_and_kill(cmd: list[str], log: Path, kill_at: int, ready: Callable[[], bool] | None = None,
                 sig: int = signal.SIGKILL, during_eval: bool = False) -> int:
    """Start the worker and send it ``sig`` (SIGKILL) once it reports step >= kill_at (and, if
    given, ``ready()`` holds: with a remote tier, a checkpoint has committed there, so the
    fresh node has something to resume from); returns the last step seen (for a SIGTERM,
    once the worker has saved on the signal and exited 143: the last step it logged).
    ``during_eval``: the signal is sent 1 s after the worker logged ``evaluation_started``.

    Raises:
        SystemExit: the worker finished before it could be killed, or did not exit with
            ``128 + sig`` after a signal other than SIGKILL.
    """
    child = subprocess.Popen(cmd)
    checked = 0.0
    try:
        while child.poll() is None:
            records = read_log(log)
            steps = [r["step"] for r in records if r["event"] == "step"]
            if during_eval and not any(r["event"] == "evaluation_started" for r in records):
                time.sleep(0.002)
                continue
            if during_eval and ready is None:
                time.sleep(1.0)  # 1 s into the evaluation
            if steps and steps[-1] >= kill_at and ready is not None and time.monotonic() - checked > 0.2:
                checked = time.monotonic()
                ready = None if ready() else ready
            if steps and steps[-1] >= kill_at and ready is None:
                os.kill(child.pid, sig)
                code = child.wait()
                if sig != signal.SIGKILL and code != 128 + sig:
                    raise SystemExit(f"the worker exited with {code} after signal {sig}, not {128 + sig}")
                return [r["step"] for r in read_log(log) if r["event"] == "step"][-1]
            time.sleep(0.002)
    finally:
        if child.poll() is None:
            child.kill()
    raise SystemExit(f"the worker finished (exit code {child.returncode}) before it could be killed at step {kill_at}")
