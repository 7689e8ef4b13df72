"""What the resume audit costs a training run (issue 27: at most 0.5 % of step time).

The audit adds, per batch, one batch-sampler wrapper that keeps the indices handed out until
the batch is consumed (a plain loader asks one batch ahead), and, per save, a digest of the
next batch's indices and content (``statekit/engine/audit.py``). This times the resume
demo's training step (its CNN on scikit-learn's digits, AdamW, an Accelerate-prepared
shuffled loader, one thread) in one process, alternating:

- ``plain``: Accelerate alone, statekit not attached;
- ``no audit``: statekit attached, the audit's index record switched off;
- ``audit``: statekit attached, as shipped;

and a plain torch ``DataLoader`` (the loader that asks ahead) tracked with and without it.
It prints the median step time of each, the ratios in the same run, and the time of the
per-save record against the step time.

Usage::

    python bench/audit_cost.py [--steps 400] [--rounds 7] [--json OUT]
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
from statekit.engine import data  # noqa: E402
from resume_demo import Net, digits  # noqa: E402


def _loop_time(mode: str, batch_size: int, steps: int, prepared: bool) -> float:
    """Seconds per step of the whole loop (data loading included), over ``steps`` steps."""
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
    original = data.audit_log
    if mode == "no audit":
        data.audit_log = lambda *args, **kwargs: None
    try:
        if mode != "plain":
            if prepared:
                statekit.attach(accelerator)
            else:
                statekit.attach(None, {"loader": loader})
        done = 0
        started = time.perf_counter()
        while done < steps:
            for x, y in loader:
                loss = F.cross_entropy(model(x), y)
                accelerator.backward(loss) if prepared else loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                done += 1
                if done >= steps:
                    break
        return (time.perf_counter() - started) / steps
    finally:
        data.audit_log = original


def _record_time(batch_size: int) -> tuple[float, float]:
    """Seconds of one save's audit record for a prepared loader mid-epoch (median of 200),
    and of the whole per-rank loader state it is part of."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True)
    train, _ = digits()
    loader = accelerator.prepare(torch.utils.data.DataLoader(train, batch_size=batch_size, shuffle=True))
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400, help="training steps per measurement")
    parser.add_argument("--rounds", type=int, default=7, help="alternating rounds of the three modes")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {"steps": args.steps, "rounds": args.rounds, "rows": []}
    for batch_size, prepared in ((32, True), (512, True), (32, False), (512, False)):
        modes = ("plain", "no audit", "audit")
        loops: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(args.rounds):
            for mode in modes:
                loops[mode].append(_loop_time(mode, batch_size, args.steps, prepared))
        median = {m: statistics.median(v) for m, v in loops.items()}
        row = {
            "loader": "Accelerate-prepared" if prepared else "plain torch (asks one batch of indices ahead)",
            "batch_size": batch_size,
            "step_s": median,
            "audit_vs_no_audit": median["audit"] / median["no audit"],
            "audit_vs_plain": median["audit"] / median["plain"],
        }
        if prepared:
            record_s, state_s = _record_time(batch_size)
            row["record_per_save_s"] = record_s
            row["loader_state_per_save_s"] = state_s
            row["record_vs_step"] = record_s / median["audit"]
        results["rows"].append(row)
        print(
            f"{row['loader']:<45} batch {batch_size:>3}: step (loop) plain {median['plain'] * 1e3:.3f} ms, "
            f"attached no audit {median['no audit'] * 1e3:.3f} ms, audit {median['audit'] * 1e3:.3f} ms; "
            f"audit / no audit {row['audit_vs_no_audit']:.4f}, audit / plain {row['audit_vs_plain']:.4f}"
            + (f"; per-save record {row['record_per_save_s'] * 1e6:.0f} us ({row['record_vs_step']:.3f} of a step)" if prepared else "")
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
