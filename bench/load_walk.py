"""The load walk: which statekit modules one ``statekit.load`` enters, and how often.

Saves a small model, its AdamW optimizer and an LR scheduler with ``statekit.save`` into a
temporary directory, then traces one ``statekit.load`` of them with ``sys.setprofile``
(Python call events only) and prints the number of distinct statekit modules entered and,
per module, how many times control enters it from another module (a re-entry: a call
whose caller's frame is in another module, or outside statekit), most first.

Usage: ``python bench/load_walk.py [--top N] [--layers N] [--width N]``.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
from pathlib import Path
from types import FrameType
from typing import Any

import torch

import statekit


def _module_of(frame: FrameType | None) -> str | None:
    """The statekit (or statekit plugin) module a frame runs in, else None."""
    if frame is None:
        return None
    name = frame.f_globals.get("__name__", "")
    return name if name == "statekit" or name.startswith(("statekit.", "statekit_")) else None


def _objects(layers: int, width: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=10)
    model(torch.randn(4, width)).sum().backward()
    optim.step()
    sched.step()
    return {"model": model, "optim": optim, "sched": sched}


def walk(url: str, state: dict[str, Any]) -> collections.Counter[str]:
    """Trace one ``statekit.load(url, state)``.

    Returns:
        ``module -> entries from another module`` for every statekit module entered.
    """
    entries: collections.Counter[str] = collections.Counter()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        module = _module_of(frame)
        if module is not None and _module_of(frame.f_back) != module:
            entries[module] += 1

    sys.setprofile(profile)
    try:
        statekit.load(url, state)
    finally:
        sys.setprofile(None)
    return entries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=40, help="modules to list (default 40)")
    parser.add_argument("--layers", type=int, default=4, help="Linear layers of the model")
    parser.add_argument("--width", type=int, default=64, help="features of each layer")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        url = str(Path(tmp) / "ckpt")
        statekit.save(url, _objects(args.layers, args.width))
        statekit.load(url, _objects(args.layers, args.width))  # warm: imports and first-call caches
        entries = walk(url, _objects(args.layers, args.width))
    core = [m for m in entries if m == "statekit" or m.startswith("statekit.")]
    print(f"statekit modules entered during one load: {len(entries)} ({len(core)} of the core, "
          f"{len(entries) - len(core)} of installed plugins)")
    print(f"entries from another module, all modules: {sum(entries.values())}")
    print(f"{'module':<44} {'re-entries':>10}")
    for module, count in entries.most_common(args.top):
        print(f"{module:<44} {count:>10}")


if __name__ == "__main__":
    main()
