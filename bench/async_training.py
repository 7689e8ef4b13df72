"""Training throughput during an async save (issue 14, item 2).

Trains a chain of ``nn.Linear(2048, 2048)`` layers with AdamW (model + optimizer state of
about ``--size`` bytes) on ``torch.set_num_threads(2)`` and, in the same worker process,
starts one background save per system while the training goes on:

- ``statekit``: ``CheckpointManager(async_save=True).save(step)``;
- ``dcp_thread``: ``torch.distributed.checkpoint.async_save`` with its default (thread)
  executor, in a single-process gloo group;
- ``dcp_process``: the same with ``AsyncCheckpointerType.PROCESS`` (skipped with a note
  when this torch cannot run it).

Each system saves once to warm up (staging buffers, writer process), then: ``--base``
undisturbed steps, the measured save (its blocking time is the time ``save()`` takes to
return), training steps until the save has committed and at least 20 steps overlap, and
``--base`` undisturbed steps again (the median of the before and after steps is the
reference step time: the machine is shared, its speed drifts). Reported per system and run:

- ``overlap_ratio``: wall time of the overlapping steps / (their count x undisturbed median);
- ``overlap_cost_seconds``: the same difference in seconds (what the save cost the training);
- ``block_over_memcpy``: blocking time / one warm memcpy of the whole state (same run).

Targets of the issue: ``overlap_ratio <= 1.10`` and ``block_over_memcpy <= 1.5``.
``measure(size_bytes, runs, workdir)`` is what ``bench/run.py`` calls; records follow
``bench/run.py``'s ``records_for`` (``system``, ``op``, ``storage``, ``run``, ``seconds``...).
Each run is one fresh worker process (``--worker``), so runs do not share caches or threads.
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
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _units import parse_size  # noqa: E402

SYSTEMS = ("statekit", "dcp_thread", "dcp_process")
MIN_OVERLAP_STEPS = 20
LAYER = 2048


def build(size_bytes: int, batch: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor]:
    """A ReLU chain of ``Linear(2048, 2048)`` whose weights + AdamW state hold about
    ``size_bytes`` bytes (3 x 4 bytes per parameter), one step taken; and an input batch.

    Args:
        size_bytes: target state size in bytes (model + optimizer; at least one layer).
        batch: rows of the input batch (shape ``(batch, 2048)``).
    """
    torch.manual_seed(0)
    per_layer = (LAYER * LAYER + LAYER) * 4 * 3
    layers: list[torch.nn.Module] = []
    for _ in range(max(1, round(size_bytes / per_layer))):
        layers += [torch.nn.Linear(LAYER, LAYER), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    x = torch.randn(batch, LAYER)
    step(model, optim, x)
    return model, optim, x


def step(model: torch.nn.Module, optim: torch.optim.Optimizer, x: torch.Tensor) -> float:
    """One training step (forward, backward, AdamW); returns its wall time in seconds."""
    t0 = time.perf_counter()
    model(x).square().mean().backward()
    optim.step()
    optim.zero_grad(set_to_none=False)
    return time.perf_counter() - t0


def state_tensors(model: torch.nn.Module, optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor of the state (weights, AdamW moments; not the 0-d step counters)."""
    out = list(model.state_dict().values())
    for st in optim.state.values():
        out += [v for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return out


def memcpy_seconds(tensors: list[torch.Tensor], repeats: int = 3) -> float:
    """Median time (seconds) of one warm copy of ``tensors`` into preallocated buffers."""
    dests = [torch.empty_like(t) for t in tensors]
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        for src, dst in zip(tensors, dests):
            dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


class StatekitSaver:
    """statekit's async save through a :class:`statekit.CheckpointManager`."""

    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer, root: str) -> None:
        import statekit

        self.manager = statekit.CheckpointManager({"model": model, "optim": optim}, root, async_save=True, keep_last=2)
        self.n = 0

    def start(self):
        self.n += 1
        return self.manager.save(self.n)

    @staticmethod
    def done(handle) -> bool:
        return handle.done()

    def wait(self, handle) -> None:
        self.manager.wait()

    def close(self) -> None:
        self.manager.wait()


class DcpSaver:
    """torch.distributed.checkpoint's ``async_save`` (thread or process executor)."""

    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer, root: str, kind: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        self.dcp = dcp
        self.kind = AsyncCheckpointerType.PROCESS if kind == "dcp_process" else AsyncCheckpointerType.THREAD
        self.model, self.optim, self.root, self.n = model, optim, root, 0

    def start(self):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self.n += 1
        msd, osd = get_state_dict(self.model, self.optim)
        writer = self.dcp.FileSystemWriter(os.path.join(self.root, f"step{self.n}"), sync_files=True)
        result = self.dcp.async_save({"model": msd, "optim": osd}, storage_writer=writer, async_checkpointer_type=self.kind)
        return getattr(result, "upload_completion", result)

    @staticmethod
    def done(handle) -> bool:
        return handle.done()

    def wait(self, handle) -> None:
        handle.result()

    def close(self) -> None:
        pass


def run_system(system: str, model, optim, x, root: str, base_steps: int) -> dict:
    """Warm-up save, undisturbed steps, the measured save and the overlapping steps.

    Returns:
        ``blocking_seconds``, ``total_seconds`` (until committed), ``base_median``,
        ``overlap_steps``, ``pending_steps`` (steps until the commit was seen),
        ``overlap_seconds`` (wall time of the overlapping steps).
    """
    saver = StatekitSaver(model, optim, root) if system == "statekit" else DcpSaver(model, optim, root, system)
    try:
        saver.wait(saver.start())  # warm: staging buffers, writer process, imports
        base = [step(model, optim, x) for _ in range(base_steps)]
        t0 = time.perf_counter()
        handle = saver.start()
        blocking = time.perf_counter() - t0
        overlap: list[float] = []
        pending_steps, total = None, None
        while pending_steps is None or len(overlap) < max(MIN_OVERLAP_STEPS, pending_steps):
            overlap.append(step(model, optim, x))
            if pending_steps is None and saver.done(handle):
                pending_steps, total = len(overlap), time.perf_counter() - t0
        saver.wait(handle)
        base += [step(model, optim, x) for _ in range(base_steps)]  # before and after: drifts of a shared machine
    finally:
        saver.close()
    return {
        "blocking_seconds": blocking, "total_seconds": total, "base_median": statistics.median(base),
        "overlap_steps": len(overlap), "pending_steps": pending_steps, "overlap_seconds": sum(overlap),
    }


def init_gloo(workdir: str) -> None:
    """A single-process gloo group (DCP's async_save needs a CPU process group)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{os.path.join(workdir, 'pg')}")


def worker(size_bytes: int, workdir: str, run: int, batch: int, base_steps: int, systems: list[str]) -> list[dict]:
    """One run in this process: every system in turn on the same model; returns records."""
    torch.set_num_threads(2)
    torch.set_flush_denormal(True)  # AdamW's second moments go subnormal; x86 slows 10x+ on them
    init_gloo(workdir)
    model, optim, x = build(size_bytes, batch)
    tensors = state_tensors(model, optim)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    memcpy = memcpy_seconds(tensors)
    base = {"storage": "local", "state_bytes": nbytes, "run": run}
    out = [{**base, "system": "limit", "op": "memcpy", "seconds": memcpy}]
    for system in systems:
        root = os.path.join(workdir, f"{system}-{run}")
        shutil.rmtree(root, ignore_errors=True)
        try:
            res = run_system(system, model, optim, x, root, base_steps)
        except Exception as exc:  # noqa: BLE001 - a benchmark row says why it is missing
            out.append({**base, "system": system, "op": "train_async", "seconds": None, "skipped": f"{type(exc).__name__}: {exc}"})
            continue
        finally:
            shutil.rmtree(root, ignore_errors=True)
        undisturbed = res["overlap_steps"] * res["base_median"]
        out += [
            {**base, "system": system, "op": "train_async_block", "seconds": res["blocking_seconds"],
             "block_over_memcpy": res["blocking_seconds"] / memcpy},
            {**base, "system": system, "op": "train_async_total", "seconds": res["total_seconds"]},
            {**base, "system": system, "op": "train_async_overlap", "seconds": res["overlap_seconds"],
             "overlap_cost_seconds": res["overlap_seconds"] - undisturbed,
             "overlap_ratio": res["overlap_seconds"] / undisturbed, "overlap_steps": res["overlap_steps"],
             "pending_steps": res["pending_steps"], "step_median_seconds": res["base_median"]},
        ]
    return out


def measure(size_bytes: int, runs: int, workdir: str, batch: int = 16, base_steps: int = 10,
            systems: tuple[str, ...] = SYSTEMS) -> list[dict]:
    """Run the benchmark ``runs`` times, each in a fresh worker process.

    Args:
        size_bytes: state size in bytes (model + AdamW), e.g. ``2**30``.
        runs: number of runs (each: every system once).
        workdir: a directory on the disk under test (checkpoints are written, then removed).
        batch: input rows per training step.
        base_steps: undisturbed steps whose median is the reference step time.
        systems: subset of :data:`SYSTEMS`.

    Returns:
        Records ``{"system", "op", "storage", "run", "state_bytes", "seconds", ...}``: one
        ``limit/memcpy`` per run, and per system ``train_async_block`` (with
        ``block_over_memcpy``), ``train_async_total`` and ``train_async_overlap`` (with
        ``overlap_ratio``, ``overlap_cost_seconds``, ``overlap_steps``, ``pending_steps``).

    Raises:
        RuntimeError: a worker process failed (its stderr is in the message).
    """
    os.makedirs(workdir, exist_ok=True)
    out: list[dict] = []
    for run in range(runs):
        with tempfile.TemporaryDirectory(dir=workdir) as d:
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--size", str(size_bytes), "--workdir", d,
                   "--run", str(run), "--batch", str(batch), "--base", str(base_steps), "--systems", ",".join(systems)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"async_training worker (run {run}) failed with code {proc.returncode}:\n{proc.stderr[-4000:]}")
            out += json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def summarize(records: list[dict]) -> list[str]:
    """Human-readable lines: min-median-max per system of the two ratios and the cost."""

    def mmm(values: list[float]) -> str:
        return f"{min(values):.3f} / {statistics.median(values):.3f} / {max(values):.3f}"

    lines = []
    for system in SYSTEMS:
        ov = [r for r in records if r["system"] == system and r["op"] == "train_async_overlap"]
        bl = [r for r in records if r["system"] == system and r["op"] == "train_async_block"]
        if not ov:
            skipped = [r["skipped"] for r in records if r["system"] == system and r.get("skipped")]
            lines.append(f"{system:12s} skipped: {skipped[0] if skipped else 'not run'}")
            continue
        lines.append(
            f"{system:12s} overlap/undisturbed {mmm([r['overlap_ratio'] for r in ov])}  "
            f"cost s {mmm([r['overlap_cost_seconds'] for r in ov])}  "
            f"block/memcpy {mmm([r['block_over_memcpy'] for r in bl])}  "
            f"steps {[r['overlap_steps'] for r in ov]} pending {[r['pending_steps'] for r in ov]}  "
            f"step s {mmm([r['step_median_seconds'] for r in ov])}"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workdir", default=os.path.join(HERE, "..", "runs", "async_training"))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--base", type=int, default=10)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--json", help="write the records to this file")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--run", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    size, systems = parse_size(args.size), [s for s in args.systems.split(",") if s]
    if args.worker:
        print(json.dumps(worker(size, args.workdir, args.run, args.batch, args.base, systems)))
        return
    records = measure(size, args.runs, args.workdir, args.batch, args.base, tuple(systems))
    for line in summarize(records):
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
