"""Benchmark: peak memory of ``statekit.export_pretrained`` (docs/export.md, Memory).

Each step runs in a fresh Python process, so each peak RSS is its own:

1. **save**: a stack of ``Linear(HIDDEN, HIDDEN)`` fp32 layers (``HIDDEN=8192``: 256 MiB of
   weight each; ``--size-gib 2.25`` gives 9 layers, 2.25 GiB), built layer by layer in code,
   saved with ``statekit.save``. With ``--fsdp``, the same layers under FSDP2 (``fully_shard``
   per layer, a CPU mesh) saved by 2 ranks (torchrun, gloo): a statekit-fsdp checkpoint.
2. **export**: ``statekit.export_pretrained(ckpt, out, max_shard_size=...)`` (verification on:
   every source file's checksum read first, every tensor digested and compared with the
   state digest). Its peak RSS above the baseline (the same process just before the
   export: interpreter, torch, statekit imported) is printed next to the largest tensor
   and the shard size. The bound the export keeps: 2 x the largest tensor + one shard
   buffer (it holds none: each shard is streamed as its tensors arrive).
3. **check**: every exported tensor read back with ``safetensors.safe_open`` and compared
   with ``torch.equal`` to the checkpoint's, one at a time (``--no-check`` skips it).

Peak RSS: ``VmHWM`` of ``/proc/self/status`` after ``clear_refs`` (bench/_workers.py).
Everything goes under one temporary directory, removed at the end (``--keep`` keeps it).

Usage::

    python bench/export.py                       # 2.25 GiB model, 1 GB shards
    python bench/export.py --fsdp --size-gib 1   # a 2-rank statekit-fsdp checkpoint
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HIDDEN = 8192
"""Width of every layer: a weight is HIDDEN x HIDDEN fp32 = 256 MiB."""

GIB = 1024**3
MIB = 1024**2
HERE = os.path.dirname(os.path.abspath(__file__))


def _model(layers: int):
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential()
    for _ in range(layers):
        model.append(torch.nn.Linear(HIDDEN, HIDDEN))
    return model


def step_save(ckpt: str, layers: int) -> None:
    import statekit

    statekit.save(ckpt, {"model": _model(layers)})


def step_save_fsdp(ckpt: str, layers: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import statekit

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _model(layers)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    statekit.save(ckpt, {"model": model})
    dist.destroy_process_group()


def step_export(ckpt: str, out: str, max_shard_size: str) -> dict:
    sys.path.insert(0, HERE)
    from _workers import peak_bytes, reset_peak

    import statekit
    from statekit.api.export import parse_shard_size

    reset_peak()
    baseline = peak_bytes()
    start = time.perf_counter()
    result = statekit.export_pretrained(ckpt, out, max_shard_size=max_shard_size)
    seconds = time.perf_counter() - start
    peak = peak_bytes() - baseline
    return {"seconds": seconds, "peak_above_baseline": peak, "tensors": result.tensors, "total_size": result.total_size,
            "files": len(result.files), "digests_compared": result.digests_compared,
            "shard_bytes": parse_shard_size(max_shard_size)}


def step_check(ckpt: str, out: str) -> dict:
    import torch
    from safetensors import safe_open

    from statekit.api.export import model_source
    from statekit.engine.context import Checkpoint
    from statekit.format.manifest import read_manifest
    from statekit.storage import Storage

    index_path = os.path.join(out, "model.safetensors.index.json")
    if os.path.exists(index_path):
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
    else:
        weight_map = None
    storage = Storage(ckpt)
    checkpoint = Checkpoint(storage, mode="load", manifest=read_manifest(storage))
    source = model_source(checkpoint, "model")
    largest = 0
    equal = 0
    try:
        for t in source.tensors:
            largest = max(largest, t.nbytes)
            file = weight_map[t.name] if weight_map else "model.safetensors"
            with safe_open(os.path.join(out, file), "pt") as f:
                exported = f.get_tensor(t.name)
            expected = source.read(t.name)
            if not torch.equal(exported, expected):
                raise SystemExit(f"{t.name}: exported tensor differs from the checkpoint's")
            equal += 1
            del exported, expected
    finally:
        source.close()
    return {"largest_tensor": largest, "equal": equal}


def _run(*args: str) -> dict:
    done = subprocess.run([sys.executable, os.path.abspath(__file__), *args], check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gib", type=float, default=2.25, help="model size in GiB (multiples of 0.25)")
    parser.add_argument("--max-shard-size", default="1GB")
    parser.add_argument("--fsdp", action="store_true", help="a 2-rank statekit-fsdp checkpoint (torchrun, gloo)")
    parser.add_argument("--no-check", action="store_true")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--dir", default=None, help="where to write (default: a new temporary directory)")
    parser.add_argument("--step", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    layers = max(1, round(args.size_gib * GIB / (HIDDEN * HIDDEN * 4)))
    if args.step == "save":
        step_save(args.ckpt, layers)
        print("{}")
        return
    if args.step == "save-fsdp":
        step_save_fsdp(args.ckpt, layers)
        return
    if args.step == "export":
        print(json.dumps(step_export(args.ckpt, args.out, args.max_shard_size)))
        return
    if args.step == "check":
        print(json.dumps(step_check(args.ckpt, args.out)))
        return

    root = args.dir or tempfile.mkdtemp(prefix="statekit-bench-export-")
    ckpt, out = os.path.join(root, "ckpt"), os.path.join(root, "hf")
    try:
        size = args.size_gib
        if args.fsdp:
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", os.path.abspath(__file__),
                            "--step", "save-fsdp", "--ckpt", ckpt, "--size-gib", str(size)], check=True)
        else:
            _run("--step", "save", "--ckpt", ckpt, "--size-gib", str(size))
        exported = _run("--step", "export", "--ckpt", ckpt, "--out", out, "--max-shard-size", args.max_shard_size,
                        "--size-gib", str(size))
        largest = HIDDEN * HIDDEN * 4
        record = {"kind": "statekit-fsdp, 2 ranks" if args.fsdp else "statekit.save", "model_bytes": exported["total_size"],
                  **exported, "largest_tensor": largest}
        if not args.no_check:
            checked = _run("--step", "check", "--ckpt", ckpt, "--out", out, "--size-gib", str(size))
            record.update(checked)
        peak = record["peak_above_baseline"]
        bound = 2 * record["largest_tensor"] + CHUNK_BOUND
        print(json.dumps(record))
        print(f"{record['kind']}: {record['model_bytes'] / GIB:.2f} GiB in {record['files']} files "
              f"({args.max_shard_size} shards), {record['seconds']:.1f} s; peak RSS above baseline {peak / MIB:.0f} MiB = "
              f"{peak / record['largest_tensor']:.2f} x the largest tensor ({record['largest_tensor'] / MIB:.0f} MiB), "
              f"{peak / record['shard_bytes']:.2f} x the shard size; bound 2 x largest + 16 MiB = {bound / MIB:.0f} MiB: "
              f"{'within' if peak <= bound else 'ABOVE'}; {record['digests_compared']} digests compared"
              + (f"; {record['equal']} tensors torch.equal" if "equal" in record else ""))
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


CHUNK_BOUND = 16 * MIB
"""One write chunk (statekit's ``CHUNK_BYTES``)."""


if __name__ == "__main__":
    main()
