"""Async saves under a host-memory budget (issue 46, part 1): peak extra RSS, blocking,
time to commit and training steps beside the save, per budget, against the unbudgeted
save and DCP's ``async_save`` in the same run.

A ReLU chain of ``Linear(2048, 2048)`` with ``--size`` bytes of fp32 weights (default 1 GiB)
and fused AdamW (state: 3x that), trained on 2 threads. Each configuration runs in a fresh
worker process (``--worker``), ``--runs`` times (median reported):

- ``train_only``: no save (the RSS the training itself adds, the control);
- ``statekit``: ``CheckpointManager(async_save=True)``, no budget (one arena of the state);
- ``budget_<f>``: ``AsyncPolicy(host_memory_budget=<f>)`` for each fraction of ``--budgets``;
- ``dcp``: ``torch.distributed.checkpoint.async_save`` (thread executor, single-process gloo).

A worker saves once to warm up (buffers, imports), trains ``--base`` undisturbed steps,
makes the measured save, trains until it has committed (at least ``--base`` steps beside
it), then ``--base`` undisturbed steps again. Reported: ``peak_extra_x`` = (VmHWM over the
whole run, both saves, minus the RSS just before the first save; the peak is reset with
``echo 5 > /proc/self/clear_refs``) / state bytes; ``blocking_s`` (the save call);
``total_s`` (call to commit, seen by a thread joined on the save); ``step_ratio`` = mean step
beside the save / median undisturbed step; ``lost_s`` = blocking + the steps beside the save
beyond their undisturbed time (what the save cost the training, seconds). Targets: peak <= 0.25x with a 0.25x budget,
steps beside the save <= 1.05x, budgeted blocking <= unbudgeted blocking.

Usage::

    python bench/async_budget.py --size 1GiB --runs 3 --json docs/async-budget.json
    python bench/async_budget.py --size 64MiB --runs 1    # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _units import parse_size  # noqa: E402
from async_training import DcpSaver, build, init_gloo, state_tensors, step  # noqa: E402

BUDGETS = (0.05, 0.1, 0.25, 0.5)


def rss_bytes(field: str = "VmRSS") -> int:
    """``field`` of /proc/self/status (``VmRSS``, ``VmHWM``), bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} missing from /proc/self/status")


def reset_peak() -> None:
    """Reset VmHWM to the current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class StatekitSaver:
    """statekit's async save through a manager, with ``budget`` (None: unbudgeted)."""

    def __init__(self, model, optim, root: str, budget: float | None) -> None:
        import statekit

        policy = statekit.AsyncPolicy(host_memory_budget=budget)
        self.manager = statekit.CheckpointManager({"model": model, "optim": optim}, root, async_save=policy, keep_last=1,
                                                  incremental=False)
        self.n = 0

    def start(self):
        self.n += 1
        return self.manager.save(self.n)

    @staticmethod
    def join(handle) -> None:
        handle.join()

    def wait(self, handle) -> None:
        self.manager.wait()


class Dcp(DcpSaver):
    @staticmethod
    def join(handle) -> None:
        handle.result()


def warm_up(config: str, workdir: str) -> None:
    """A save of one small tensor, so that imports and first-use allocations (not the
    save's buffers) are in the RSS before the measured saves."""
    tiny = {"t": torch.zeros(4)}
    if config == "dcp":
        import torch.distributed.checkpoint as dcp

        future = dcp.async_save(tiny, storage_writer=dcp.FileSystemWriter(os.path.join(workdir, "warm")))
        getattr(future, "upload_completion", future).result()
    elif config != "train_only":
        import statekit

        statekit.save(os.path.join(workdir, "warm"), tiny, blocking=False, host_memory_budget=0.5).wait()


def worker(config: str, size_bytes: int, workdir: str, batch: int, base_steps: int) -> dict:
    """One configuration in this (fresh) process; returns its record."""
    torch.set_num_threads(2)
    torch.set_flush_denormal(True)  # AdamW's second moments go subnormal; x86 slows 10x+ on them
    if config == "dcp":
        init_gloo(workdir)
    model, optim, x = build(3 * size_bytes, batch)
    state = sum(t.numel() * t.element_size() for t in state_tensors(model, optim))
    for _ in range(2):
        step(model, optim, x)
    root = os.path.join(workdir, config)
    saver: object | None = None
    if config == "statekit":
        saver = StatekitSaver(model, optim, root, None)
    elif config.startswith("budget_"):
        saver = StatekitSaver(model, optim, root, float(config.split("_", 1)[1]))
    elif config == "dcp":
        saver = Dcp(model, optim, root, "dcp_thread")
    warm_up(config, workdir)
    before = rss_bytes()
    reset_peak()
    out = {"config": config, "state_bytes": state, "size_bytes": size_bytes}
    if saver is not None:
        saver.wait(saver.start())  # warm-up save: buffers, imports, writer
    base = [step(model, optim, x) for _ in range(base_steps)]
    beside: list[float] = []
    if saver is not None:
        committed: list[float] = []
        t0 = time.perf_counter()
        handle = saver.start()
        out["blocking_s"] = time.perf_counter() - t0
        watcher = threading.Thread(target=lambda: (saver.join(handle), committed.append(time.perf_counter())))
        watcher.start()
        while not committed or len(beside) < base_steps:
            beside.append(step(model, optim, x))
        watcher.join()
        saver.wait(handle)
        out["total_s"] = committed[0] - t0
    else:
        beside = [step(model, optim, x) for _ in range(base_steps)]
    base += [step(model, optim, x) for _ in range(base_steps)]
    out["peak_extra_bytes"] = rss_bytes("VmHWM") - before
    out["peak_extra_x"] = out["peak_extra_bytes"] / state
    out["step_base_s"] = statistics.median(base)
    out["step_ratio"] = statistics.mean(beside) / out["step_base_s"]
    out["steps_beside"] = len(beside)
    shutil.rmtree(root, ignore_errors=True)
    return out


def measure(size_bytes: int, runs: int, workdir: str, budgets: tuple[float, ...] = BUDGETS, batch: int = 16,
            base_steps: int = 5) -> list[dict]:
    """Every configuration ``runs`` times, each in a fresh worker process.

    Args:
        size_bytes: fp32 weight bytes of the model (the state is about 3x: AdamW's moments).
        runs: fresh processes per configuration.
        workdir: a directory on the disk under test (checkpoints are written, then removed).
        budgets: ``host_memory_budget`` fractions to run.
        batch: input rows per training step.
        base_steps: undisturbed steps before and after, and the least steps beside the save.

    Returns:
        One record per configuration and run (``config``, ``run``, ``peak_extra_x``,
        ``blocking_s``, ``total_s``, ``step_ratio``...).

    Raises:
        RuntimeError: a worker failed (its stderr is in the message).
    """
    configs = ["train_only", "statekit", *[f"budget_{b:g}" for b in budgets], "dcp"]
    os.makedirs(workdir, exist_ok=True)
    records = []
    for run in range(runs):
        for config in configs:
            with tempfile.TemporaryDirectory(dir=workdir) as d:
                cmd = [sys.executable, os.path.abspath(__file__), "--worker", config, "--size", str(size_bytes),
                       "--workdir", d, "--batch", str(batch), "--base", str(base_steps)]
                proc = subprocess.run(cmd, capture_output=True, text=True)
                if proc.returncode != 0:
                    raise RuntimeError(f"{config} (run {run}) failed with code {proc.returncode}:\n{proc.stderr[-4000:]}")
                records.append({**json.loads(proc.stdout.strip().splitlines()[-1]), "run": run})
                print(json.dumps(records[-1]), file=sys.stderr)
    return records


def table(records: list[dict]) -> list[str]:
    """A markdown table of the medians per configuration, with the ratios to the unbudgeted save."""
    configs = list(dict.fromkeys(r["config"] for r in records))
    for r in records:  # what the save cost the training: the call, and the steps beside it beyond their usual time
        r["lost_s"] = (r.get("blocking_s") or 0.0) + r["steps_beside"] * r["step_base_s"] * (r["step_ratio"] - 1)
    med = {c: {k: statistics.median([r[k] for r in records if r["config"] == c and r.get(k) is not None])
               for k in ("peak_extra_x", "blocking_s", "total_s", "step_ratio", "state_bytes", "lost_s")
               if any(r.get(k) is not None for r in records if r["config"] == c)} for c in configs}
    ref = med.get("statekit", {})
    lines = ["| configuration | peak extra RSS / state | blocking s | blocking / unbudgeted | total s to commit "
             "| total / unbudgeted | step beside the save / undisturbed | training time lost s |",
             "|---|---|---|---|---|---|---|---|"]
    for c in configs:
        m = med[c]
        block, total = m.get("blocking_s"), m.get("total_s")
        rb = f"{block / ref['blocking_s']:.2f}x" if block is not None and ref.get("blocking_s") else "-"
        rt = f"{total / ref['total_s']:.2f}x" if total is not None and ref.get("total_s") else "-"
        lines.append(f"| {c} | {m['peak_extra_x']:.3f}x | {block if block is None else f'{block:.3f}'} | {rb} | "
                     f"{total if total is None else f'{total:.2f}'} | {rt} | {m['step_ratio']:.3f}x | {m['lost_s']:.2f} |")
    return lines


def plot(records: list[dict], path: str) -> None:
    """Budget -> (peak extra RSS, blocking, total) as a PNG (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def med(config: str, key: str) -> float:
        return statistics.median([r[key] for r in records if r["config"] == config])

    budgets = sorted({float(r["config"].split("_", 1)[1]) for r in records if r["config"].startswith("budget_")})
    names = [f"budget_{b:g}" for b in budgets]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, key, label in zip(axes, ("peak_extra_x", "blocking_s", "total_s"),
                              ("peak extra RSS / state", "blocking at the call, s", "call to commit, s")):
        ax.plot(budgets, [med(n, key) for n in names], "o-", label="statekit, budget")
        for config, style in (("statekit", "--"), ("dcp", ":")):
            if any(r["config"] == config for r in records):
                ax.axhline(med(config, key), ls=style, color="gray" if config == "statekit" else "tab:red",
                           label=f"{'statekit, no budget' if config == 'statekit' else 'DCP async_save'}")
        if key == "peak_extra_x":
            ax.plot(budgets, budgets, color="tab:green", lw=0.8, label="= budget")
        ax.set_xlabel("host_memory_budget (fraction of the state)")
        ax.set_title(label)
        ax.legend(fontsize=7)
    state = records[0]["state_bytes"] / 2**30
    fig.suptitle(f"async saves under a budget: {state:.2f} GiB state (model + AdamW), local disk, 2 cores, "
                 f"median of {max(r['run'] for r in records) + 1} fresh processes")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="1GiB", help="fp32 weight bytes of the model (state: about 3x)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--budgets", default=",".join(f"{b:g}" for b in BUDGETS))
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "statekit-async-budget"))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--base", type=int, default=5)
    ap.add_argument("--json", help="write the records to this file")
    ap.add_argument("--plot", help="write the plot to this PNG")
    ap.add_argument("--from-json", help="print (and plot) the records of this file instead of running")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, parse_size(args.size), args.workdir, args.batch, args.base)))
        return
    if args.from_json:
        with open(args.from_json) as f:
            records = json.load(f)
    else:
        budgets = tuple(float(b) for b in args.budgets.split(",") if b)
        records = measure(parse_size(args.size), args.runs, args.workdir, budgets, args.batch, args.base)
    print("\n".join(table(records)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    if args.plot:
        plot(records, args.plot)


if __name__ == "__main__":
    main()
