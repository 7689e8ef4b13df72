"""Bytes and time per save of a LoRA-shaped run through ``CheckpointManager`` (issue 29).

Usage::

    python bench/incremental.py [--base 1GiB] [--saves 10] [--remote] [--no-fio]

The state: ``--base`` bytes of frozen ``nn.Linear`` weights (4096 x 4096 fp32 layers, no
bias), each layer with a LoRA adapter (``A``: rank x 4096, ``B``: 4096 x rank, trainable,
about 1 % of the base at rank 16) between the frozen weights in the state dict, and AdamW on
the adapters. ``--saves`` saves through ``CheckpointManager.save`` (synchronous, local disk,
every checkpoint kept) with one training step between them.

Per save it prints the seconds ``save()`` blocked and two byte counts:

* **new bytes**: the size of every file of the new checkpoint whose inode no earlier
  checkpoint of the run holds (a hard link of an unchanged file is not new);
* **disk writes**: ``write_bytes`` of ``/proc/self/io`` across the save (what the kernel
  sent to the block layer, so the metadata too).

Against them: the **changed bytes** (adapters, their AdamW moments and counters: what a
save must write), the disk's write limit (fio, ``bench/_fio.py``; ``--no-fio`` skips it),
the XXH3-64 hash rate of the base in memory on one core, and the resume time of the last
checkpoint against a full checkpoint of the same state written by ``statekit.save``. With
``--remote`` it also replicates to a moto S3 server on 127.0.0.1 and prints the bytes
uploaded per save (request bodies of ``PutObject``/``UploadPart``; a server-side copy
uploads nothing).

``--full-training`` measures the other end instead: the benchmark state of
``bench/_workers.py`` (every tensor trainable, ``--base`` bytes with AdamW's moments), a
training step before each save, saved through the manager alternately with
``incremental=True`` and ``incremental=False`` (each save changes every file: the
incremental save must not be slower than a full one).

The targets of issue 29: new bytes per save after the first <= 1.05x the changed bytes plus
metadata; time per save after the first <= 1.25x (changed bytes / write limit) + hash time;
resume within 1.10x of a full checkpoint; uploaded bytes <= 1.05x the changed bytes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import torch
import xxhash
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _units import parse_size  # noqa: E402

import statekit  # noqa: E402

WIDTH = 4096


class LoRALinear(nn.Module):
    """A frozen ``WIDTH x WIDTH`` weight with a trainable low-rank adapter ``B @ A``."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.base = nn.Linear(WIDTH, WIDTH, bias=False)
        self.base.weight.requires_grad_(False)
        self.lora_A = nn.Parameter(torch.randn(rank, WIDTH) * 0.01)
        self.lora_B = nn.Parameter(torch.zeros(WIDTH, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_A.T) @ self.lora_B.T


def build(base_bytes: int, rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The LoRA-shaped model (``base_bytes`` of frozen weights) and AdamW on its adapters."""
    layers = max(1, base_bytes // (WIDTH * WIDTH * 4))
    model = nn.Sequential(*(LoRALinear(rank) for _ in range(layers)))
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    return model, optim


def step(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    """One training step on a random batch of 4."""
    loss = model(torch.randn(4, WIDTH)).square().mean()
    loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)


def changed_bytes(model: nn.Module, optim: torch.optim.Optimizer) -> int:
    """Bytes a save must write because they changed: trainable parameters and optimizer tensors."""
    params = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    moments = sum(t.numel() * t.element_size() for s in optim.state.values() for t in s.values() if torch.is_tensor(t))
    return params + moments


def hash_rate(model: nn.Module) -> tuple[float, int]:
    """XXH3-64 over every frozen weight in memory, streamed in 16 MiB pieces as an
    incremental save compares a file (``format.tensors.compare_file``), one core:
    (bytes per second, bytes); best of three."""
    frozen = [memoryview(p.detach().numpy()).cast("B") for p in model.parameters() if not p.requires_grad]
    total = sum(len(v) for v in frozen)
    step = 16 * 1024 * 1024
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        hasher = xxhash.xxh3_64()
        for view in frozen:
            for start in range(0, len(view), step):
                hasher.update(view[start : start + step])
        best = min(best, time.perf_counter() - started)
    return total / best, total


def disk_writes() -> int:
    """``write_bytes`` of this process so far (``/proc/self/io``)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("write_bytes:"):
                return int(line.split()[1])
    return 0


def new_bytes(checkpoint: str, seen: set[tuple[int, int]]) -> int:
    """Bytes of ``checkpoint``'s files whose inode is not in ``seen`` (then added to it)."""
    total = 0
    for dirpath, _, names in os.walk(checkpoint):
        for name in names:
            st = os.stat(os.path.join(dirpath, name))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


class UploadCounter:
    """Counts the request-body bytes of ``PutObject``/``UploadPart`` calls made through s3fs."""

    def __init__(self) -> None:
        import s3fs
        from fsspec.asyn import sync_wrapper

        self.bytes = 0
        self._original = s3fs.S3FileSystem._call_s3
        counter = self

        async def counting(fs, method, *args, **kwargs):  # noqa: ANN001, ANN202
            if method in ("put_object", "upload_part"):
                body = kwargs.get("Body")
                counter.bytes += len(body) if body is not None and hasattr(body, "__len__") else 0
            return await counter._original(fs, method, *args, **kwargs)

        self._original_sync = s3fs.S3FileSystem.call_s3
        s3fs.S3FileSystem._call_s3 = counting
        s3fs.S3FileSystem.call_s3 = sync_wrapper(counting)  # what s3fs's files call

    def close(self) -> None:
        import s3fs

        s3fs.S3FileSystem._call_s3 = self._original
        s3fs.S3FileSystem.call_s3 = self._original_sync


def full_training(size: int, saves: int) -> None:
    """Manager saves of a state whose every tensor changes, incremental and full, alternating."""
    import _workers

    torch.set_num_threads(1)
    model, optim = _workers.build(size, torch.float32)
    work = tempfile.mkdtemp(prefix="statekit-bench-incremental-", dir=os.path.join(os.path.dirname(__file__), ".."))
    times: dict[bool, list[float]] = {True: [], False: []}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            managers = {flag: statekit.CheckpointManager({"model": model, "optim": optim}, os.path.join(work, str(flag)),
                                                         keep_last=1, incremental=flag) for flag in (True, False)}
            for n in range(1, saves + 1):
                for flag in (True, False) if n % 2 else (False, True):
                    _workers.one_step(model, optim)
                    started = time.perf_counter()
                    managers[flag].save(n)
                    times[flag].append(time.perf_counter() - started)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    later = {flag: t[1:] for flag, t in times.items()}  # the first save of each warms up
    for flag, label in ((True, "incremental"), (False, "full")):
        t = later[flag]
        print(f"{label:12s} save {min(t):.3f} / {statistics.median(t):.3f} / {max(t):.3f} s (min / median / max, {len(t)} saves)")
    print(f"ratio incremental / full (medians) {statistics.median(later[True]) / statistics.median(later[False]):.3f}")


def _mib(n: float) -> str:
    return f"{n / 2**20:9.1f} MiB"


def main() -> None:
    """Run the measurement (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="1GiB")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--saves", type=int, default=10)
    ap.add_argument("--remote", action="store_true", help="replicate to a moto S3 server and count uploads")
    ap.add_argument("--no-fio", action="store_true", help="skip the disk's write limit (fio)")
    ap.add_argument("--full-training", action="store_true", help="every tensor changes: incremental against full saves")
    args = ap.parse_args()
    if args.full_training:
        full_training(parse_size(args.base), args.saves)
        return
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model, optim = build(parse_size(args.base), args.rank)
    step(model, optim)
    objects = {"model": model, "optim": optim}
    changed = changed_bytes(model, optim)
    rate, frozen = hash_rate(model)
    work = tempfile.mkdtemp(prefix="statekit-bench-incremental-", dir=os.path.join(os.path.dirname(__file__), ".."))
    limit = None
    if not args.no_fio:
        import _fio

        measured = _fio.measure_limits(_fio.ensure_fio(), work, 1 << 30)
        if measured.get("write"):
            limit = (1 << 30) / measured["write"]["seconds"]
    server = counter = None
    if args.remote:
        from statekit.testing import start_moto_server

        server_cm = start_moto_server()
        server = server_cm.__enter__()
        server.filesystem().mkdir("bench-incremental")
        counter = UploadCounter()
    root = os.path.join(work, "run")
    rows = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            manager = statekit.CheckpointManager(
                objects, root, replicate_to="s3://bench-incremental/run" if server else None
            )
            seen: set[tuple[int, int]] = set()
            for n in range(1, args.saves + 1):
                before_disk = disk_writes()
                before_up = counter.bytes if counter else 0
                started = time.perf_counter()
                manager.save(n)
                blocked = time.perf_counter() - started
                disk = disk_writes() - before_disk
                if server:
                    manager.wait()
                uploaded = (counter.bytes - before_up) if counter else None
                fresh = new_bytes(os.path.join(root, f"checkpoint-{n:08d}"), seen)
                rows.append((n, blocked, fresh, disk, uploaded))
                up = f"  uploaded {_mib(uploaded)}" if uploaded is not None else ""
                print(f"save {n:2d}  blocked {blocked:7.3f} s  new {_mib(fresh)}  disk writes {_mib(disk)}{up}", flush=True)
                step(model, optim)
            last = os.path.join(root, f"checkpoint-{args.saves:08d}")
            full = os.path.join(work, "full")
            statekit.save(full, objects)
            resume = {"incremental": [], "full": []}
            for _ in range(7):  # alternating; loads of 1 GiB vary by +-0.1 s on this VM: a median of 7
                for label, path in (("incremental", last), ("full", full)):
                    fresh_model, fresh_optim = build(parse_size(args.base), args.rank)
                    started = time.perf_counter()
                    statekit.load(path, {"model": fresh_model, "optim": fresh_optim})
                    resume[label].append(time.perf_counter() - started)
    finally:
        if counter:
            counter.close()
        if server:
            server_cm.__exit__(None, None, None)
        shutil.rmtree(work, ignore_errors=True)

    later = rows[1:]
    med = statistics.median
    print(f"\nbase {_mib(frozen)} frozen, changed per save {_mib(changed)} (adapters + AdamW moments)")
    print(f"hash rate (XXH3-64, one core) {rate / 1e9:.2f} GB/s; hashing the base takes {frozen / rate:.3f} s")
    if later:
        print(f"new bytes per save after the first: median {_mib(med(r[2] for r in later))}, "
              f"{med(r[2] for r in later) / changed:.2f}x the changed bytes (target <= 1.05x + metadata)")
        print(f"disk writes per save after the first: median {_mib(med(r[3] for r in later))}")
        blocked = med(r[1] for r in later)
        if limit:
            budget = 1.25 * changed / limit + frozen / rate
            print(f"save time after the first: median {blocked:.3f} s; budget 1.25x changed/limit + hash = {budget:.3f} s "
                  f"(write limit {limit / 1e9:.2f} GB/s): ratio {blocked / budget:.2f}")
        else:
            print(f"save time after the first: median {blocked:.3f} s (no fio limit)")
        if server:
            print(f"uploaded per save after the first: median {_mib(med(r[4] for r in later))}, "
                  f"{med(r[4] for r in later) / changed:.2f}x the changed bytes (target <= 1.05x)")
    ratio = med(resume["incremental"]) / med(resume["full"])
    print(f"resume: last checkpoint {med(resume['incremental']):.3f} s, full checkpoint {med(resume['full']):.3f} s: "
          f"ratio {ratio:.2f} (target <= 1.10)")


if __name__ == "__main__":
    main()
