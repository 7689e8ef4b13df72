"""What the resume audit costs a training run (issue 27: at most 0.5 % of step time).

The audit adds, per batch, one batch-sampler wrapper that keeps the indices handed out until
the batch is consumed (a plain loader asks one batch ahead), and, per save, a digest of the
next batch's indices and content (``statekit/checks/audit.py``). Its per-batch work is
measured where it happens, iterating the resume demo's loader alone (scikit-learn's digits,
shuffled, one thread), alternating in one process:

- ``plain``: the loader, statekit not attached;
- ``no audit``: statekit attached, the audit's index record switched off;
- ``audit``: statekit attached, as shipped;

for an Accelerate-prepared loader and a plain torch ``DataLoader`` (the one that asks ahead),
at batch sizes 32 (the demo's) and 512. The difference per batch is set against the demo's
training step (its CNN, AdamW) timed in the same run: the audit's share of a step. The
per-save record is timed too, and the next-batch record a save leaves beside the checkpoint
(the first batch after the save, digested and written to local disk).

Usage::

    python bench/audit_cost.py [--epochs 3] [--steps 200] [--rounds 9] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import statekit  # noqa: E402
from statekit.loaders import data, tracking  # noqa: E402
from resume_demo import Net, digits  # noqa: E402


def _build(prepared: bool, batch_size: int):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import set_seed

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    set_seed(0)
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    train, _ = digits()
    loader = torch.utils.data.DataLoader(train, batch_size=batch_size, shuffle=True)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if prepared:
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    return accelerator, model, optimizer, loader


def _attach(mode: str, accelerator: Any, loader: Any, prepared: bool) -> None:
    if mode == "plain":
        return
    if prepared:
        statekit.attach(accelerator)
    else:
        statekit.attach(None, {"loader": loader})


def _per_batch(mode: str, prepared: bool, batch_size: int, epochs: int) -> float:
    """Seconds per batch of iterating the loader alone (no training step): where the audit's
    per-batch work is, without the step's noise around it."""
    accelerator, _, _, loader = _build(prepared, batch_size)
    original = tracking.audit_log
    if mode == "no audit":
        tracking.audit_log = lambda *args, **kwargs: None
    try:
        _attach(mode, accelerator, loader, prepared)
        started, count = time.perf_counter(), 0
        for _ in range(epochs):
            for _batch in loader:
                count += 1
        return (time.perf_counter() - started) / count
    finally:
        tracking.audit_log = original


def _step_time(prepared: bool, batch_size: int, steps: int) -> float:
    """Median seconds of the demo's training step (forward, backward, AdamW), attached."""
    accelerator, model, optimizer, loader = _build(prepared, batch_size)
    _attach("audit", accelerator, loader, prepared)
    times: list[float] = []
    while len(times) < steps:
        for x, y in loader:
            started = time.perf_counter()
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss) if prepared else loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            times.append(time.perf_counter() - started)
            if len(times) >= steps:
                break
    return statistics.median(times[len(times) // 4:])


def _index_log_overhead(batch_size: int) -> float:
    """Seconds the audit's index record adds per batch to the demo's batch sampler iterated
    alone, with the one-batch read-ahead (min of 7 repeats of 20 epochs: the least noisy
    figure on a shared machine)."""
    import timeit

    from statekit.loaders import index_log

    train, _ = digits()
    batches = torch.utils.data.BatchSampler(torch.utils.data.RandomSampler(train, generator=torch.Generator().manual_seed(0)), batch_size, False)

    class _Position:
        drawn: dict = {}
        drawn_all = False

    def plain() -> None:
        for _ in batches:
            pass

    def logged() -> None:
        position = _Position()
        for i, _ in enumerate(index_log.IndexLog(batches, position, 0, True)):
            index_log.forget_before(position, i + 1)

    per = {f: min(timeit.repeat(f, number=20, repeat=7)) / 20 / len(batches) for f in (plain, logged)}
    return per[logged] - per[plain]


def _record_time(batch_size: int) -> tuple[float, float]:
    """Seconds of one save's audit record for a prepared loader mid-epoch (median of 200),
    and of the whole per-rank loader state it is part of."""
    accelerator, _, _, loader = _build(True, batch_size)
    statekit.attach(accelerator)
    it = iter(loader)
    next(it)
    position = loader.__dict__["_statekit_position"]
    record, state = [], []
    for _ in range(200):
        started = time.perf_counter()
        data._next_batch(loader, position, position.epoch, position.batches, True)
        record.append(time.perf_counter() - started)
        started = time.perf_counter()
        data.loader_state(loader)
        state.append(time.perf_counter() - started)
    return statistics.median(record), statistics.median(state)


def _next_batch_record_time(batch_size: int) -> float:
    """Seconds of one save's next-batch record (issue 35: the content of the first batch a
    loader yields after the save, digested and written beside the checkpoint on local disk;
    ``statekit.checks.next_batch.Witness``), median of 200: one content digest of a batch of the
    demo's and one small durable file write."""
    import tempfile

    from statekit.checks import next_batch
    from statekit.storage import Storage

    train, _ = digits()
    batch = next(iter(torch.utils.data.DataLoader(train, batch_size=batch_size)))
    times = []
    with tempfile.TemporaryDirectory() as root:
        storage = Storage(root)
        for i in range(200):
            started = time.perf_counter()
            witness = next_batch.Witness("dataloader_0", 0, 1)
            witness.committed(lambda data, rel=f"next-batch/{i}.json": storage.write_bytes(rel, data), "xxh3_64:0")
            witness.observe(0, 1, batch)
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=3, help="epochs of loader iteration per measurement")
    parser.add_argument("--steps", type=int, default=200, help="training steps timed for the step time")
    parser.add_argument("--rounds", type=int, default=9, help="alternating rounds of the three modes")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {"epochs": args.epochs, "steps": args.steps, "rounds": args.rounds, "rows": []}
    for prepared, batch_size in ((True, 32), (True, 512), (False, 32), (False, 512)):
        modes = ("plain", "no audit", "audit")
        per_batch: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(args.rounds):
            for mode in modes:
                per_batch[mode].append(_per_batch(mode, prepared, batch_size, args.epochs))
        median = {m: statistics.median(v) for m, v in per_batch.items()}
        step = _step_time(prepared, batch_size, args.steps)
        overhead = median["audit"] - median["no audit"]
        index_log = _index_log_overhead(batch_size)
        row = {
            "loader": "Accelerate-prepared" if prepared else "plain torch, asks one batch of indices ahead",
            "batch_size": batch_size,
            "per_batch_s": median,
            "audit_overhead_per_batch_s": overhead,
            "training_step_s": step,
            "audit_overhead_vs_step": overhead / step,
            "index_log_per_batch_s": index_log,
            "index_log_vs_step": index_log / step,
        }
        line = (
            f"{row['loader']:<44} batch {batch_size:>3}: loader alone per batch: plain {median['plain'] * 1e6:.0f} us, "
            f"attached {median['no audit'] * 1e6:.0f} us, attached + audit {median['audit'] * 1e6:.0f} us "
            f"(audit {overhead * 1e6:+.0f} us); training step {step * 1e3:.2f} ms; audit / step {overhead / step:+.4f}; "
            f"index record alone {index_log * 1e6:.2f} us per batch ({index_log / step:.5f} of a step)"
        )
        witness_s = _next_batch_record_time(batch_size)
        row["next_batch_record_per_save_s"] = witness_s
        row["next_batch_record_vs_step"] = witness_s / step
        line += f"; next-batch record per save {witness_s * 1e6:.0f} us ({witness_s / step:.3f} steps)"
        if prepared:
            record_s, state_s = _record_time(batch_size)
            row["record_per_save_s"] = record_s
            row["loader_state_per_save_s"] = state_s
            row["record_vs_step"] = record_s / step
            line += f"; per-save record {record_s * 1e6:.0f} us ({record_s / step:.3f} steps)"
        results["rows"].append(row)
        print(line, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
