"""Blocking time of a save with replication on, against the same save without it (issue 15).

Usage::

    python bench/replication.py [--size 256MiB] [--runs 3]

Starts a moto S3 server on 127.0.0.1 (the demo's and tests' server), builds the benchmark
state of ``bench/_workers.py`` (``nn.Linear`` layers + AdamW, ``--size`` bytes), and per
run saves it with ``CheckpointManager.save`` to a fresh local root, alternately without and
with ``replicate_to`` an S3 root: the time ``save()`` blocks is what training waits. The
replication time (commit to committed remote copy, ``wait()``) is reported next to a raw
``s3fs.put`` of the same files (the server's limit). Prints min / median / max and ratios.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _workers  # noqa: E402
from _units import parse_size  # noqa: E402

import statekit  # noqa: E402
from statekit.testing import start_moto_server  # noqa: E402


def _stats(values: list[float]) -> str:
    return f"{min(values):.3f} / {statistics.median(values):.3f} / {max(values):.3f} s"


def main() -> None:
    """Run the comparison (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="256MiB")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, optim = _workers.build(parse_size(args.size), torch.float32)
    objects = {"model": model, "optim": optim}
    work = tempfile.mkdtemp(prefix="statekit-bench-tiers-", dir=os.path.join(os.path.dirname(__file__), ".."))
    plain, tiered, replicated, raw = [], [], [], []
    with start_moto_server() as server, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fs = server.filesystem()
        fs.mkdir("bench-tiers")
        statekit.hooks.registry.get_plugin_manager()
        for run in range(args.runs):
            for with_remote in (False, True):
                root = os.path.join(work, f"run{run}-{int(with_remote)}")
                remote = f"s3://bench-tiers/run{run}" if with_remote else None
                manager = statekit.CheckpointManager(objects, root, replicate_to=remote)
                started = time.perf_counter()
                manager.save(1)
                blocked = time.perf_counter() - started
                (tiered if with_remote else plain).append(blocked)
                if with_remote:
                    manager.wait()
                    replicated.append(time.perf_counter() - started - blocked)
                    files = [os.path.join(dp, f) for dp, _, fs_ in os.walk(os.path.join(root, "checkpoint-00000001")) for f in fs_]
                    t0 = time.perf_counter()
                    for path in files:
                        fs.put_file(path, f"bench-tiers/raw{run}/{os.path.relpath(path, root)}")
                    raw.append(time.perf_counter() - t0)
                shutil.rmtree(root, ignore_errors=True)
                print(f"run {run} {'replicated' if with_remote else 'local only':10s} save blocked {blocked:.3f} s"
                      + (f", replicated in {replicated[-1]:.3f} s (raw put {raw[-1]:.3f} s)" if with_remote else ""), flush=True)
    shutil.rmtree(work, ignore_errors=True)
    print(f"\nstate {args.size}, {args.runs} runs (min / median / max)")
    print(f"save blocking, local only      {_stats(plain)}")
    print(f"save blocking, with replicate  {_stats(tiered)}   ratio {statistics.median(tiered) / statistics.median(plain):.2f}")
    print(f"replication (commit -> remote) {_stats(replicated)}   / raw s3fs put {statistics.median(replicated) / statistics.median(raw):.2f}")
    print(f"raw s3fs put of the same files {_stats(raw)}")


if __name__ == "__main__":
    main()
