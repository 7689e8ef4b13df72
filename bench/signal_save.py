"""Signal-to-commit time of the save on a signal (issue 30), for a state of ``--size`` bytes.

A worker process trains a chain of ``nn.Linear(4096, 4096)`` layers (float32: 64 MiB each,
as many as ``--size`` needs; every parameter changes each step, so nothing is reused from
the previous checkpoint) under ``CheckpointManager(save_on_signal=True)``, saves once (the
write rate the deadline estimate uses, and a warm page cache), then steps, calling
``step_boundary`` after each. After step 3 this process sends SIGTERM; the worker saves at
its next boundary and exits 143. Reported per run: ``seconds`` (from the handler recording
the signal to the commit, what the manager logs), ``exit_seconds`` (from ``os.kill`` here
to the worker's exit) and the bytes written; then the median.

Usage::

    python bench/signal_save.py                     # 1 GiB under a temporary folder
    python bench/signal_save.py --size 256MiB --runs 5 --dir /mnt/fast
    python bench/signal_save.py --where eval --size 16MiB   # SIGTERM 1 s into an evaluation
    python bench/signal_save.py --boundary          # the cost of a step boundary's record
    python bench/signal_save.py --stress 100        # signals at random moments, outcomes counted

``--where eval``: the worker trains 3 steps, then evaluates under ``no_grad`` (a C call
that does not return for 60 s); SIGTERM arrives 1 s in and the watcher thread saves step 3
(``PreemptionPolicy(watcher=True)``, the default); ``seconds`` is from the log line
(signal to commit). ``--boundary``: microseconds per ``step_boundary`` with and without
the watcher (the boundary's state by reference: state dicts and version counters), for the
small model of the signal tests and a ~100M-parameter one (AdamW state included).
``--stress N``: N signals (SIGTERM or SIGUSR1) at random moments of chains of
``tests/scripts/signal_anywhere.py`` runs that evaluate every 4 steps (each run resumes the
previous one's checkpoint; a chain that reaches the end is compared with an uninterrupted
run, losses and weights bit for bit); every run has a 120 s timeout: a run still going then
is a hang. Counted: saved from the watcher, fell back (saved at the next step boundary),
committed already, finished before the signal, exact chains, hangs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _units import parse_size  # noqa: E402

LAYER_BYTES = 4096 * 4096 * 4


def worker(root: str, size: int, out: str) -> None:
    import torch

    import statekit

    torch.set_num_threads(2)
    layers = max(1, round(size / LAYER_BYTES))
    model = torch.nn.Sequential(*(torch.nn.Linear(4096, 4096, bias=False) for _ in range(layers)))
    manager = statekit.CheckpointManager({"model": model}, root, save_on_signal=True, keep_last=1)
    manager.save(0)
    step = 0
    try:
        while True:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1e-3)
            step += 1
            print(f"step {step}", flush=True)
            manager.step_boundary(step)
    except SystemExit:
        Path(out).write_text(json.dumps({**manager.signal_save.result, "bytes": layers * LAYER_BYTES}))
        raise


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1GiB", help="state bytes (default 1GiB)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    parser.add_argument("--worker", nargs=3, metavar=("ROOT", "SIZE", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--where", choices=["boundary", "eval"], default="boundary",
                        help="where the signal lands (default: between two step boundaries)")
    parser.add_argument("--boundary", action="store_true", help="measure the cost of a step boundary's record")
    parser.add_argument("--stress", type=int, default=0, metavar="N", help="N signals at random moments")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], int(args.worker[1]), args.worker[2])
        return
    if args.boundary:
        boundary_cost()
        return
    if args.stress:
        stress(args.stress, args.seed, args.dir)
        return
    if args.where == "eval":
        eval_signal(parse_size(args.size), args.runs, args.dir)
        return
    size = parse_size(args.size)
    records = []
    for run in range(args.runs):
        work = Path(tempfile.mkdtemp(prefix="statekit-signal-save-", dir=args.dir))
        try:
            out = work / "result.json"
            child = subprocess.Popen([sys.executable, __file__, "--worker", str(work / "root"), str(size), str(out)],
                                     stdout=subprocess.PIPE, text=True)
            for line in child.stdout:
                if line.strip() == "step 3":
                    sent = time.monotonic()
                    os.kill(child.pid, signal.SIGTERM)
                    break
            child.stdout.read()
            code = child.wait()
            exit_seconds = time.monotonic() - sent
            result = json.loads(out.read_text())
            record = {"run": run, "seconds": round(result["seconds"], 3), "exit_seconds": round(exit_seconds, 3),
                      "bytes": result["bytes"], "step": result["step"], "exit_code": code}
            records.append(record)
            print(json.dumps(record), flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    median = statistics.median(r["seconds"] for r in records)
    print(f"signal-to-commit, {records[0]['bytes'] / 2**30:.2f} GiB state: median {median:.2f} s "
          f"over {len(records)} runs ({statistics.median(r['exit_seconds'] for r in records):.2f} s to the exit)")


# --------------------------------------------------------------------------- a signal during an evaluation

SAVED = re.compile(r"(SIG\w+): saved from the watcher at step (\d+) while the main thread was (.*), committed at \S+, "
                   r"([\d.]+) s after the signal")


def eval_worker(root: str, size: int) -> None:
    import logging

    import torch

    import statekit

    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    torch.set_num_threads(2)
    layers = max(1, round(size / LAYER_BYTES))
    model = torch.nn.Sequential(*(torch.nn.Linear(4096, 4096, bias=False) for _ in range(layers)))
    manager = statekit.CheckpointManager({"model": model}, root, save_on_signal=True, keep_last=1)
    manager.save(0)
    for step in range(1, 4):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1e-3)
        manager.step_boundary(step)
    print("evaluation started", flush=True)
    with torch.no_grad():
        time.sleep(60)  # an evaluation's C call: the main thread does not run Python for a minute
    print("evaluation done", flush=True)


def eval_signal(size: int, runs: int, where: str | None) -> None:
    records = []
    for run in range(runs):
        work = Path(tempfile.mkdtemp(prefix="statekit-signal-eval-", dir=where))
        try:
            child = subprocess.Popen([sys.executable, __file__, "--eval-worker", str(work / "root"), str(size)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for line in child.stdout:
                if line.strip() == "evaluation started":
                    time.sleep(1.0)  # 1 s into the evaluation
                    sent = time.monotonic()
                    os.kill(child.pid, signal.SIGTERM)
                    break
            rest, err = child.stdout.read(), child.stderr.read()
            code = child.wait()
            exit_seconds = time.monotonic() - sent
            saved = SAVED.search(err)
            record = {"run": run, "seconds": float(saved.group(4)) if saved else None,
                      "exit_seconds": round(exit_seconds, 3), "step": int(saved.group(2)) if saved else None,
                      "exit_code": code, "evaluation_finished": "evaluation done" in rest,
                      "bytes": max(1, round(size / LAYER_BYTES)) * LAYER_BYTES}
            records.append(record)
            print(json.dumps(record), flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    done = [r["seconds"] for r in records if r["seconds"] is not None]
    print(f"signal 1 s into an evaluation, {records[0]['bytes'] / 2**20:.0f} MiB state: saved from the watcher in "
          f"{len(done)}/{len(records)} runs, signal-to-commit median {statistics.median(done) if done else float('nan'):.3f} s, "
          f"to the exit {statistics.median(r['exit_seconds'] for r in records):.3f} s")


# --------------------------------------------------------------------------- the cost of a boundary


def boundary_cost() -> None:
    import torch

    import statekit

    torch.set_num_threads(2)

    def small():
        return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                   torch.nn.Linear(16, 3))

    def large():  # ~100M parameters in 48 blocks (288 tensors), like a transformer's count of tensors
        return torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.LayerNorm(1024),
                                                         torch.nn.Linear(1024, 1024)) for _ in range(48)))

    for name, build in (("small", small), ("100M", large)):
        model = build()
        params = sum(p.numel() for p in model.parameters())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 10)
        width = model[0].in_features if name == "small" else 1024
        model(torch.randn(4, width)).sum().backward()
        optimizer.step()  # AdamW's state exists
        optimizer.zero_grad()
        row = {"model": name, "parameters": params}
        for watcher in (False, True):
            with tempfile.TemporaryDirectory() as root:
                manager = statekit.CheckpointManager({"model": model, "optimizer": optimizer, "scheduler": scheduler},
                                                     root, save_on_signal=statekit.PreemptionPolicy(watcher=watcher))
                times = []
                for step in range(1, 202):
                    started = time.perf_counter()
                    manager.step_boundary(step)
                    times.append(time.perf_counter() - started)
                manager.signal_save.restore()
                row["watcher" if watcher else "flag_only"] = round(statistics.median(times[1:]) * 1e6, 1)
                if watcher:
                    row["tensors"] = len(manager.signal_save.moment.tensors)
        print(json.dumps({**row, "unit": "us per step_boundary (median of 200)"}), flush=True)


# --------------------------------------------------------------------------- stress

SCRIPT = Path(__file__).resolve().parent.parent / "tests" / "scripts" / "signal_anywhere.py"
STRESS_ENV = {"STATEKIT_TEST_EVAL_EVERY": "4", "STATEKIT_TEST_EVAL_SLEEP": "0.02", "OMP_NUM_THREADS": "1"}


def _child(mode: str, root: Path, out: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(SCRIPT), mode, str(root), str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **STRESS_ENV})


def _finish(child: subprocess.Popen, lines: list[str], timeout: float = 120) -> tuple[int | None, str]:
    import threading

    killed = []
    watchdog = threading.Timer(timeout, lambda: (killed.append(True), child.kill()))
    watchdog.start()
    try:
        lines.extend(child.stdout.read().splitlines(keepends=True))
        err = child.stderr.read()
        code = child.wait()
    finally:
        watchdog.cancel()
    return (None if killed else code), err


def stress(count: int, seed: int, where: str | None) -> None:
    import torch

    rng = random.Random(seed or None)
    work = Path(tempfile.mkdtemp(prefix="statekit-signal-stress-", dir=where))
    counts = {"saved-from-watcher": 0, "fell-back": 0, "committed-already": 0, "finished-first": 0,
              "other-exit": 0, "hang": 0, "chains-exact": 0, "chains-differ": 0}
    seconds: list[float] = []
    try:
        ref_lines: list[str] = []
        code, err = _finish(_child("reference", work / "ref-root", work / "ref"), ref_lines)
        assert code == 0, err[-2000:]
        reference = torch.load(f"{work}/ref.rank0.pt")
        sent = chain = 0
        while sent < count:
            chain += 1
            root, losses, run = work / f"chain{chain}", [], 0
            while True:
                run += 1
                out = work / f"chain{chain}-run{run}"
                child = _child("run", root, out)
                lines: list[str] = []
                signalled = False
                for line in child.stdout:
                    lines.append(line)
                    if line.startswith("start") and sent < count:
                        time.sleep(rng.uniform(0.0, 2.5))  # a random moment of a run of about 2 s
                        os.kill(child.pid, rng.choice([signal.SIGTERM, signal.SIGUSR1]))
                        sent += 1
                        signalled = True
                        break
                code, err = _finish(child, lines)
                start = next(int(x.split()[2]) for x in lines if x.startswith("start"))
                mine = [x.split()[3] for x in lines if x.startswith("step")]
                if code is None:
                    counts["hang"] += 1
                    break
                if code == 0:
                    if signalled:
                        counts["finished-first"] += 1
                    losses = losses[:start] + mine
                    final = torch.load(f"{out}.rank0.pt")
                    same = losses == reference["losses"] and all(
                        torch.equal(reference["weights"][k], final["weights"][k]) for k in reference["weights"])
                    counts["chains-exact" if same else "chains-differ"] += 1
                    break
                if code not in (143, 138):
                    counts["other-exit"] += 1
                    print(f"run exited {code}: {err[-1500:]}", flush=True)
                    break
                saved = re.search(r"saved from the watcher at step (\d+).*?([\d.]+) s after the signal", err)
                if saved:
                    counts["saved-from-watcher"] += 1
                    seconds.append(float(saved.group(2)))
                elif "committed already" in err or "was committed already" in err:
                    counts["committed-already"] += 1
                else:
                    counts["fell-back"] += 1
                losses = losses[:start] + mine
            print(json.dumps({"chain": chain, "signals_sent": sent, **counts}), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"signals": count, **counts, "watcher_signal_to_commit_median_s":
                      round(statistics.median(seconds), 3) if seconds else None,
                      "watcher_signal_to_commit_max_s": round(max(seconds), 3) if seconds else None}))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--eval-worker"]:
        eval_worker(sys.argv[2], int(sys.argv[3]))
    else:
        main()
