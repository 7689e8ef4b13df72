"""Training with the remote tier frozen: step time against honest baselines (issue 30).

Usage::

    python bench/stalled_storage.py [--freeze 60] [--phase 30] [--block 5] [--size 16MiB] [--save-every 20] [--no-pin]

Starts a moto S3 server on 127.0.0.1 (the tests' server) and trains a stack of
``nn.Linear`` layers (``--size`` bytes of weights, AdamW) with a ``CheckpointManager``
saving every ``--save-every`` steps asynchronously. A step's time includes its ``save()``
call, so it is what the training loop felt. Four phases, in this order:

1. ``local``: the same training and saves to a local root with **no remote tier**
   (``--phase`` seconds): the work a frozen remote tier leaves, with nothing else.
2. ``replicating``: a second manager, local root replicated to the moto server
   (``replicate_to``), the server running (``--phase`` seconds): the undisturbed run with
   its uploads (moto parsing them, the replicator thread reading and checksumming).
3. ``frozen``: the server stopped (SIGSTOP; ``--freeze`` seconds, then SIGCONT). Training
   alternates blocks of ``--block`` seconds between the replicated manager (its copies
   stall; client timeouts and retries run in the background) and the local-only manager:
   the ``frozen`` steps and the ``local, same minute`` steps.
4. ``local`` again (``--phase`` seconds) after the thawed backlog was copied.

Before phase 1 each manager trains and saves three times (warm-up: allocator, staging
buffers, the first upload), not measured.

Methodology. The first version compared the frozen phase with phase 2 only and got 0.42:
on a 2-core machine moto's uploads compete with training for the CPUs, so the undisturbed
phase is *slower* and the ratio says nothing about stalls. The question is whether a
frozen tier costs training anything beyond what checkpoints cost without a remote tier,
so the baseline is the same training and saves with no remote tier. It is measured twice:
interleaved with the frozen steps in the same minute (``frozen / local, same minute``, the
done-when ratio, <= 1.05: the load of other processes on a shared machine drifts by 2-10x
over minutes and hits both alike; the frozen manager's stalled background threads run
during both kinds of block, and they use next to no CPU while stalled), and in the separate
phases 1 and 4 before and after (``frozen / local phases``: also counts the frozen
manager's background work, but only honest on an otherwise idle machine).
``frozen / replicating`` is informative (below 1 where uploads compete for the CPUs). With
``--pin`` (the default where there are 2 CPUs or more) training and everything in its
process, replicator included, run on CPU 0 with one torch thread, and the moto server on
CPU 1, so the server's work does not land on the training core; other processes on the
machine are not controlled (their load is why phase 4 repeats phase 1). The longest
``save()`` blocking time of the frozen phase (``manager.stats()``, done when < 1 s) and
the longest step of each phase, its steps over 1 s and the mean of each 10 s of it are
printed too, and the
stats as JSON (``--json``: everything).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import uuid
import warnings
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _units import parse_size  # noqa: E402

import statekit  # noqa: E402
from statekit.testing import start_moto_server  # noqa: E402


def _phase(seconds: float, train_step, manager, save_every: int, step: int) -> tuple[list[float], int, int]:
    """Train for ``seconds``; return each step's wall time (its save included), the last
    step and the index of the phase's first record in ``manager.stats().saves``."""
    first_record = len(manager.stats().saves)
    times: list[float] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        started = time.monotonic()
        train_step()
        step += 1
        if step % save_every == 0:
            manager.save(step)
        times.append(time.monotonic() - started)
    return times, step, first_record


def _windows(times: list[float], seconds: float = 10.0) -> list[float]:
    """Mean step time (ms) of each consecutive ``seconds`` of a phase: where in the phase
    the time went (the start of a freeze, or all along)."""
    means, window, elapsed = [], [], 0.0
    for t in times:
        window.append(t)
        elapsed += t
        if elapsed >= seconds:
            means.append(statistics.mean(window) * 1e3)
            window, elapsed = [], 0.0
    if window:
        means.append(statistics.mean(window) * 1e3)
    return means


def _summary(name: str, times: list[float]) -> dict[str, Any]:
    row = {"steps": len(times), "mean_ms": statistics.mean(times) * 1e3, "median_ms": statistics.median(times) * 1e3,
           "max_ms": max(times) * 1e3, "steps_over_1s": sum(t > 1.0 for t in times),
           "window_means_ms": [round(m, 1) for m in _windows(times)]}
    print(f"{name:<18} {row['steps']:>6} steps  mean {row['mean_ms']:7.1f} ms  median {row['median_ms']:7.1f} ms  "
          f"longest {row['max_ms']:7.1f} ms  per 10 s: {' '.join(f'{m:.0f}' for m in row['window_means_ms'])}",
          flush=True)
    return row


def _interleaved(seconds: float, block: float, train_step, managers, save_every: int, step: int):
    """Train for ``seconds``, alternating ``block``-second blocks between the managers;
    return each manager's step times, the last step and each manager's first record index."""
    times: list[list[float]] = [[] for _ in managers]
    blocks: list[list[float]] = [[] for _ in managers]
    firsts = [len(m.stats().saves) for m in managers]
    end = time.monotonic() + seconds
    turn = 0
    while time.monotonic() < end:
        block_times, step, _ = _phase(min(block, end - time.monotonic()), train_step, managers[turn], save_every, step)
        times[turn] += block_times
        if block_times:
            blocks[turn].append(statistics.mean(block_times))
        turn = (turn + 1) % len(managers)
    return times, blocks, step, firsts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--freeze", type=float, default=60.0, help="seconds the server stays frozen (default 60)")
    parser.add_argument("--phase", type=float, default=30.0, help="seconds of each baseline phase (default 30)")
    parser.add_argument("--block", type=float, default=5.0,
                        help="seconds of each block of the interleaved frozen phase (default 5)")
    parser.add_argument("--size", default="16MiB", help="bytes of weights (default 16MiB; AdamW triples the state)")
    parser.add_argument("--save-every", type=int, default=20, help="steps between saves (default 20)")
    parser.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin training and moto to CPUs")
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args(argv)
    pin = args.pin and hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) >= 2
    width = 1024
    layers = max(1, parse_size(args.size) // (width * width * 4))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randn(64, width)

    def train_step() -> None:
        loss = model(batch).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    warnings.simplefilter("ignore")  # the retries' warnings while frozen, the RNG plugin's absence
    with start_moto_server(environment=False) as server, tempfile.TemporaryDirectory() as work:
        cpus = sorted(os.sched_getaffinity(0)) if pin else []
        if pin:  # before any thread of ours starts: the replicator and writer threads inherit CPU 0
            os.sched_setaffinity(server.process.pid, {cpus[1]})
            os.sched_setaffinity(0, {cpus[0]})
            torch.set_num_threads(1)
        options = {**server.storage_options, "skip_instance_cache": True,
                   "config_kwargs": {"connect_timeout": 5, "read_timeout": 10, "retries": {"max_attempts": 1}}}
        import s3fs

        s3fs.S3FileSystem(**options).mkdir("stall")
        remote = f"s3://stall/run-{uuid.uuid4().hex[:6]}"
        objects = {"model": model, "optimizer": optimizer}
        local_only = statekit.CheckpointManager(objects, os.path.join(work, "local-only"), async_save=True, keep_last=2)
        replicated = statekit.CheckpointManager(objects, os.path.join(work, "replicated"), async_save=True,
                                                keep_last=2, replicate_to=remote, replicate_options=options)
        replicated.plugin_state["replicate"].backoff_seconds = 0.5
        print(f"{layers} x Linear({width}, {width}) + AdamW, save every {args.save_every} steps, baseline phases of "
              f"{args.phase:g} s, freeze {args.freeze:g} s, "
              + (f"training on CPU {cpus[0]} (1 torch thread), moto on CPU {cpus[1]}" if pin else "not pinned"),
              flush=True)
        for manager in (local_only, replicated):  # warm-up: allocator, staging buffers, each manager's first saves
            for warm in range(3 * args.save_every):
                train_step()
                if warm % args.save_every == 0:
                    manager.save(warm + 1)
            manager.wait(timeout=600)
        local1, step, _ = _phase(args.phase, train_step, local_only, args.save_every, 1000)  # after the warm-up steps
        local_only.wait()
        undisturbed, step, _ = _phase(args.phase, train_step, replicated, args.save_every, step)
        server.process.send_signal(signal.SIGSTOP)
        try:
            (frozen, same_minute), (frozen_blocks, local_blocks), step, (first_frozen, first_local) = _interleaved(
                args.freeze, args.block, train_step, (replicated, local_only), args.save_every, step)
            backlog = replicated.stats().replication
        finally:
            server.process.send_signal(signal.SIGCONT)
        frozen_saves = replicated.stats().saves[first_frozen:]
        same_minute_saves = local_only.stats().saves[first_local:]
        replicated.wait(timeout=600)
        local2, step, _ = _phase(args.phase, train_step, local_only, args.save_every, step)
        local_only.wait()
        stats = replicated.stats()
    print()
    rows = {"local (1)": _summary("local (1)", local1), "replicating": _summary("replicating", undisturbed),
            "frozen": _summary("frozen", frozen), "same minute": _summary("local, same minute", same_minute),
            "local (2)": _summary("local (2)", local2)}
    local = local1 + local2
    rows["local"] = _summary("local phases", local)
    ratio_same = statistics.mean(frozen) / statistics.mean(same_minute)
    ratio_same_median = statistics.median(frozen) / statistics.median(same_minute)
    ratio_local = statistics.mean(frozen) / statistics.mean(local)
    ratio_local_median = statistics.median(frozen) / statistics.median(local)
    ratio_replicating = statistics.mean(frozen) / statistics.mean(undisturbed)
    blocking_frozen = max((r.blocking_s for r in frozen_saves), default=0.0)
    print(f"frozen / local, same minute:  mean {ratio_same:.3f}, median {ratio_same_median:.3f} (target <= 1.05)")
    print(f"frozen / local phases:        mean {ratio_local:.3f}, median {ratio_local_median:.3f}")
    print(f"frozen / replicating:         mean {ratio_replicating:.3f} "
          f"(informative: uploads compete for the CPUs when the server runs)")
    pairs = sorted(f / b for f, b in zip(frozen_blocks, local_blocks))
    print(f"block pairs (a frozen block / the local block after it): {len(pairs)}, ratio min {pairs[0]:.3f} "
          f"median {statistics.median(pairs):.3f} max {pairs[-1]:.3f}: the noise of one comparison")
    save_frozen = statistics.mean(r.blocking_s for r in frozen_saves) if frozen_saves else 0.0
    save_local = statistics.mean(r.blocking_s for r in same_minute_saves) if same_minute_saves else 0.0
    print(f"mean save() blocking in the freeze: replicated (frozen) {save_frozen * 1e3:.1f} ms, "
          f"local-only {save_local * 1e3:.1f} ms")
    print(f"steps over 1 s while frozen: {sum(t > 1.0 for t in frozen)}")
    print(f"longest save() blocking while frozen: {blocking_frozen:.3f} s over {len(frozen_saves)} saves "
          f"({sum(r.outcome == 'skipped' for r in frozen_saves)} skipped; target < 1 s); backlog at the thaw {backlog}")
    print({k: v for k, v in stats.to_dict().items() if k != "saves"})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "pinned": pin, "phases": rows,
                       "ratio_frozen_same_minute_mean": ratio_same, "ratio_frozen_same_minute_median": ratio_same_median,
                       "ratio_frozen_local_mean": ratio_local,
                       "block_pair_ratios": pairs, "save_blocking_mean_s_frozen": save_frozen,
                       "save_blocking_mean_s_same_minute_local": save_local,
                       "ratio_frozen_local_median": ratio_local_median, "ratio_frozen_replicating_mean": ratio_replicating,
                       "blocking_s_max_frozen": blocking_frozen, "backlog_at_thaw": backlog,
                       "stats": {k: v for k, v in stats.to_dict().items() if k != "saves"}}, f, indent=2)
    return 0 if ratio_same <= 1.05 and blocking_frozen < 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
