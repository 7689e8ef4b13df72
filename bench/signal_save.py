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
"""

from __future__ import annotations

import argparse
import json
import os
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
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], int(args.worker[1]), args.worker[2])
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


if __name__ == "__main__":
    main()
