"""Dev tool: where a cold statekit load spends its time, and which read strategy is fastest.

Usage::

    .venv/bin/python bench/load_profile.py [--size 256MiB] [--runs 2] [--dir /tmp/statekit-lp]
        [--strategies buffered,touched,direct,...]

Saves the benchmark state of ``bench/_workers.py`` (large ``nn.Linear`` layers + AdamW
after one step) once with statekit, then for every run and strategy starts a fresh
interpreter that drops the files from the page cache (``posix_fadvise(DONTNEED)`` after
``fsync``) and reads both tensor files of the checkpoint: the model file into touched
tensors (as a resume fills existing parameters) and the optimizer file into fresh memory
(as a resume of a fresh AdamW), hashing every byte with XXH3-64 as the load does.
Strategies (raw reads, outside statekit, to choose one):

- ``buffered``: ``readinto`` 16 MiB at a time into fresh ``torch.empty`` (the old path);
- ``touched``: the same into pre-touched memory (what first-touch costs);
- ``direct``: statekit's :class:`~statekit.storage.direct.DirectReader` (``O_DIRECT``
  through huge-page bounce buffers) into the targets, without the rest of a load;
- ``statekit``: a whole ``statekit.load`` of the checkpoint, and ``torch`` a
  ``torch.load`` of the same state (``torch.save``-written), and ``limit`` the
  benchmark's cold read limit (one buffered pass into touched memory).

Prints one line per run and strategy and the min / median / max seconds. Timings on a
shared machine are noisy: compare strategies within one invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import xxhash

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _workers  # noqa: E402
from _units import parse_size  # noqa: E402

CHUNK = 16 * 1024 * 1024


def prepare(d: str, size: int) -> None:
    """Save the benchmark state once under ``d`` (statekit checkpoint + torch file)."""
    import statekit

    if os.path.exists(os.path.join(d, "done")):
        return
    os.makedirs(d, exist_ok=True)
    model, optim = _workers.build(size, torch.float32)
    statekit.api.saveload.save(os.path.join(d, "ck"), {"model": model, "optim": optim})
    torch.save({"model": model.state_dict(), "optim": optim.state_dict()}, os.path.join(d, "torch.pt"))
    with open(os.path.join(d, "read.bin"), "wb") as f:
        for t in _workers.all_tensors(model, optim).values():
            f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    _workers.fsync_tree(d)
    open(os.path.join(d, "done"), "w").close()


def _raw_read(path: str, fresh: bool, touched: bool) -> None:
    from statekit.format.header import read_header

    h = xxhash.xxh3_64()
    with open(path, "rb", buffering=0) as f:
        header = read_header(f, path, None, h)
        for e in header.entries:
            t = torch.empty(e.end - e.begin, dtype=torch.uint8)
            if touched or not fresh:
                t.fill_(1)
            view = memoryview(t.numpy())
            done = 0
            while done < len(view):
                got = f.readinto(view[done : done + CHUNK])
                h.update(view[done : done + got])
                done += got


def _direct_read(path: str, fresh: bool) -> None:
    from statekit.format.tensors import read_tensors
    from statekit.storage.direct import DirectReader

    h = xxhash.xxh3_64()
    with DirectReader(path) as f:
        into = None
        if not fresh:
            from statekit.format.header import read_header

            with open(path, "rb") as g:
                header = read_header(g, path)
            into = {e.name: torch.empty(e.shape, dtype=e.dtype).fill_(1) for e in header.entries}
        read_tensors(f, path, os.path.getsize(path), into=into, hasher=h)


def trial(d: str, strategy: str) -> float:
    """One cold measurement in this (fresh) process; returns seconds."""
    ck = os.path.join(d, "ck")
    model_file, optim_file = os.path.join(ck, "model.safetensors"), os.path.join(ck, "optim.safetensors")
    torch.set_num_threads(1)
    import statekit

    statekit.hooks.registry.get_plugin_manager()
    model = optim = None
    if strategy in ("statekit", "torch"):
        size = json.load(open(os.path.join(d, "size.json")))["size"]
        model, optim = _workers.build(size, torch.float32, with_state=False)
    dest = None
    if strategy == "limit":
        dest = torch.empty(os.path.getsize(os.path.join(d, "read.bin")), dtype=torch.uint8).fill_(1)
    _workers.drop_cache(d)
    t0 = time.perf_counter()
    if strategy in ("buffered", "touched"):
        _raw_read(model_file, fresh=False, touched=True)
        _raw_read(optim_file, fresh=True, touched=strategy == "touched")
    elif strategy == "direct":
        _direct_read(model_file, fresh=False)
        _direct_read(optim_file, fresh=True)
    elif strategy == "statekit":
        statekit.api.loading.load(ck, {"model": model, "optim": optim})
    elif strategy == "torch":
        state = torch.load(os.path.join(d, "torch.pt"), weights_only=True)
        model.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])
    elif strategy == "limit":
        mv = memoryview(dest.numpy())
        with open(os.path.join(d, "read.bin"), "rb", buffering=0) as f:
            done = 0
            while got := f.readinto(mv[done : done + CHUNK]):
                done += got
    else:
        raise SystemExit(f"unknown strategy {strategy!r}")
    return time.perf_counter() - t0


def main() -> None:
    """Run the comparison (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="256MiB")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--dir", default="/tmp/statekit-lp")
    ap.add_argument("--strategies", default="limit,buffered,touched,direct,statekit,torch")
    ap.add_argument("--trial", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    d = os.path.join(args.dir, args.size)
    if args.trial:
        print(f"SECONDS {trial(d, args.trial)}")
        return
    prepare(d, parse_size(args.size))
    with open(os.path.join(d, "size.json"), "w") as f:
        json.dump({"size": parse_size(args.size)}, f)
    results: dict[str, list[float]] = {s: [] for s in args.strategies.split(",")}
    for run in range(args.runs):
        for s in results:
            out = subprocess.run(
                [sys.executable, __file__, "--size", args.size, "--dir", args.dir, "--trial", s],
                capture_output=True, text=True, check=True,
            ).stdout
            seconds = float(out.split("SECONDS")[-1])
            results[s].append(seconds)
            print(f"run {run} {s:10s} {seconds:.3f} s", flush=True)
    for s, v in results.items():
        print(f"{s:10s} min {min(v):.3f}  median {statistics.median(v):.3f}  max {max(v):.3f} s")


if __name__ == "__main__":
    main()
