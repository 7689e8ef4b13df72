"""Accelerator rows of ``bench/run.py``: staging a state that lives on the GPU.

Usage (run by ``bench/run.py`` when ``torch.accelerator`` has a device; one process)::

    python bench/_accelerator.py DIR SIZE DTYPE RUNS [DEVICE]

The state is ``bench/_workers.py``'s model + AdamW after one step, built on the accelerator
(``DEVICE``, default ``torch.accelerator.current_accelerator()``). Each run measures, in
this order (each op once per run, after one untimed warm-up of each):

- ``pinned-copy d2h``: one plain device-to-host copy of every tensor into pinned host
  buffers allocated beforehand (``copy_(non_blocking=True)``, then one synchronize): the
  floor an async save's blocking time can reach (the bytes have to cross the bus once);
- ``statekit stage``: :meth:`statekit.engine.staging.StagingPool.stage` (and ``settle``) of the same tensors
  into its reused pinned arena;
- ``statekit async_block`` / ``async_total``: ``save_objects(..., blocking=False)`` with a
  reused staging pool: time until it returns (what training waits for), then until it is
  committed on disk;
- ``statekit save`` / ``torch save``: synchronous, durable saves (torch's file fsynced);
- ``statekit load`` / ``torch load``: into a fresh model and AdamW on the accelerator, the
  files dropped from the page cache first (``torch.load(map_location=device)``, then
  ``load_state_dict``).

Device-to-host GB/s is ``state_bytes / seconds``. Prints one line per measurement,
``RESULT {json}`` with ``{"system", "op", "seconds", "state_bytes", "run", "device"}``.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _units import parse_size  # noqa: E402
from _workers import all_tensors, build, drop_cache, fsync_tree, state_nbytes  # noqa: E402


def accelerator_device() -> torch.device | None:
    """The current accelerator (:func:`statekit.devices.current_accelerator_type`), or None."""
    from statekit.devices import current_accelerator_type

    kind = current_accelerator_type()
    return torch.device(kind) if kind is not None else None


def synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device) if hasattr(torch, "accelerator") else torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> float:
    """Seconds ``fn()`` takes, the device idle before and done after."""
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - t0


def pinned_copy(tensors: list[torch.Tensor], device: torch.device):
    """A function copying ``tensors`` into host buffers allocated here once (pinned off the CPU)."""
    pin = device.type != "cpu"
    dests = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in tensors]

    def copy() -> None:
        for dst, src in zip(dests, tensors):
            dst.copy_(src, non_blocking=pin)
        synchronize(device)

    return copy


def main(argv: list[str]) -> None:
    import statekit
    from statekit.api.saveload import save_objects
    from statekit.engine.entries import classify
    from statekit.engine.staging import StagingPool

    d, size, dtype_name, runs = argv[0], parse_size(argv[1]), argv[2], int(argv[3])
    device = torch.device(argv[4]) if len(argv) > 4 else accelerator_device()
    if device is None:
        raise SystemExit("bench/_accelerator.py: no accelerator in this process")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    statekit.hooks.registry.get_plugin_manager()  # plugin discovery before any clock
    model, optim = build(size, dtype, device=str(device))
    state_bytes = state_nbytes(model, optim)
    tensors = list(all_tensors(model, optim).values())
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    copy = pinned_copy(tensors, device)
    pool = StagingPool()
    by_name = dict(all_tensors(model, optim))
    entries = [classify("model", model), classify("optim", optim)]
    os.makedirs(d, exist_ok=True)

    def emit(system: str, op: str, seconds: float, run: int) -> None:
        rec = {"system": system, "op": op, "seconds": seconds, "state_bytes": state_bytes, "run": run, "device": name}
        print("RESULT " + json.dumps(rec), flush=True)

    # warm-up: pinned buffers touched, the pool's arena allocated, CUDA kernels loaded
    copy()
    stage = lambda: (pool.stage("state.safetensors", by_name), pool.settle())  # noqa: E731
    stage()
    save_objects(os.path.join(d, "warm"), entries, blocking=False, staging=pool).wait()
    shutil.rmtree(os.path.join(d, "warm"))
    for run in range(runs):
        emit("pinned-copy", "d2h", timed(copy, device), run)
        emit("statekit", "stage", timed(stage, device), run)
        target = os.path.join(d, f"async-{run}")
        synchronize(device)
        t0 = time.perf_counter()
        pending = save_objects(target, entries, blocking=False, staging=pool)
        emit("statekit", "async_block", time.perf_counter() - t0, run)
        pending.wait()
        emit("statekit", "async_total", time.perf_counter() - t0, run)
        shutil.rmtree(target)
        sk_dir, pt_dir = os.path.join(d, f"statekit-{run}"), os.path.join(d, f"torch-{run}")
        emit("statekit", "save", timed(lambda: statekit.save(sk_dir, {"model": model, "optim": optim}), device), run)
        os.makedirs(pt_dir)
        pt = os.path.join(pt_dir, "state.pt")
        save_torch = lambda: (torch.save({"model": model.state_dict(), "optim": optim.state_dict()}, pt), fsync_tree(pt_dir))  # noqa: E731
        emit("torch", "save", timed(save_torch, device), run)
        for system, load in (
            ("statekit", lambda m, o: statekit.load(sk_dir, {"model": m, "optim": o})),
            ("torch", lambda m, o: _torch_load(pt, m, o, device)),
        ):
            fresh_model, fresh_optim = build(size, dtype, with_state=False, device=str(device))
            drop_cache(sk_dir if system == "statekit" else pt_dir)
            gc.collect()
            emit(system, "load", timed(lambda: load(fresh_model, fresh_optim), device), run)
            if not _same_state(model, optim, fresh_model, fresh_optim):
                raise SystemExit(f"bench/_accelerator.py: {system} load is not exact")
            del fresh_model, fresh_optim
        shutil.rmtree(sk_dir)
        shutil.rmtree(pt_dir)


def _same_state(model, optim, other_model, other_optim) -> bool:
    """Whether two model + optimizer pairs hold identical tensors (weights and moments)."""
    ours, theirs = all_tensors(model, optim), all_tensors(other_model, other_optim)
    return ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def _torch_load(path: str, model: torch.nn.Module, optim: torch.optim.Optimizer, device: torch.device) -> None:
    sd = torch.load(path, map_location=device, weights_only=True)
    model.load_state_dict(sd["model"])
    optim.load_state_dict(sd["optim"])


if __name__ == "__main__":
    main(sys.argv[1:])
