"""What the state check (issue 38) costs a load and a save: the same state saved with the
sampled digest (the CPU default), the full digest, and none (``STATEKIT_STATE_CHECK=off``),
then loaded alternately, in one process; prints the medians and the overhead against the
load without a check.

Usage: ``python bench/state_check.py [--size 256MiB] [--runs 5] [--dir /tmp]``

The state is a model of float32 linear layers of about ``--size`` bytes and its AdamW
state (twice that again), so a load reads about three times ``--size``. The loads read
from the page cache (the files were just written), faster than from the disk itself, so
the overhead printed is an upper bound of the overhead at the disk's speed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

import statekit  # noqa: E402
from _units import parse_size  # noqa: E402


def build(size: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    width = 2048
    layers = max(1, size // (width * width * 4))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()
    return model, optimizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="256MiB", help="model bytes (the optimizer adds twice that)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to save (default: a temporary folder)")
    args = parser.parse_args()
    size = parse_size(args.size)
    model, optimizer = build(size)
    state = {"model": model, "optimizer": optimizer}
    root = tempfile.mkdtemp(dir=args.dir)
    saves: dict[str, list[float]] = {}
    urls = {}
    for mode in ("off", "sampled", "full"):
        os.environ["STATEKIT_STATE_CHECK"] = mode
        urls[mode] = f"{root}/{mode}"
        started = time.perf_counter()
        statekit.save(urls[mode], state)
        saves[mode] = [time.perf_counter() - started]
    os.environ.pop("STATEKIT_STATE_CHECK")
    loads: dict[str, list[float]] = {mode: [] for mode in urls}
    target, target_optimizer = build(size)
    for _ in range(args.runs):
        for mode, url in urls.items():
            started = time.perf_counter()
            statekit.load(url, {"model": target, "optimizer": target_optimizer})
            loads[mode].append(time.perf_counter() - started)
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3
    base = statistics.median(loads["off"])
    print(f"state of {nbytes / 2**20:.0f} MiB (model + AdamW), {args.runs} loads each, torch threads {torch.get_num_threads()}")
    print(f"{'digest':<10}{'load median s':>15}{'load overhead':>15}{'save s':>10}")
    for mode in urls:
        median = statistics.median(loads[mode])
        print(f"{mode:<10}{median:>15.3f}{(median / base - 1):>14.1%}{saves[mode][0]:>10.3f}")


if __name__ == "__main__":
    main()
