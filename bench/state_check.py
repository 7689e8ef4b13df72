"""What the state check (issue 38) costs a load and a save: the same state saved with the
sampled digest (the CPU default), the full digest, and none (``STATEKIT_STATE_CHECK=off``),
then loaded alternately, in one process; prints the medians and the overhead against the
load without a check.

Usage: ``python bench/state_check.py [--size 256MiB] [--runs 5] [--dir /tmp] [--no-fio] [--device cuda]``

The state is a model of float32 linear layers of about ``--size`` bytes and its AdamW
state (twice that again), so a load reads about three times ``--size``. The loads read
from the page cache (the files were just written), faster than from the disk itself, so
the overhead printed is an upper bound of the overhead at the disk's speed. The check's
own seconds (``statekit.checks.state_check.check``, timed around each call) are also
printed against the load at the disk's read limit: the state's bytes over fio's
sequential ``O_DIRECT`` read throughput of ``--dir``'s disk (``bench/_fio.py``; fio is
installed by ``bench/setup.sh`` when missing; ``--no-fio`` skips it).
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


def build(size: int, device: str = "cpu") -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    width = 2048
    layers = max(1, size // (width * width * 4))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(device)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, width, device=device)).sum().backward()
    optimizer.step()
    return model, optimizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="256MiB", help="model bytes (the optimizer adds twice that)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to save (default: a temporary folder)")
    parser.add_argument("--no-fio", action="store_true", help="skip the disk's read limit")
    parser.add_argument("--device", default="cpu", help="where the state lives (cuda: the full digest on the device)")
    args = parser.parse_args()
    size = parse_size(args.size)
    model, optimizer = build(size, args.device)
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
    checks: dict[str, list[float]] = {mode: [] for mode in urls}
    timed = _time_checks()
    target, target_optimizer = build(size, args.device)
    for _ in range(args.runs):
        for mode, url in urls.items():
            timed.clear()
            started = time.perf_counter()
            statekit.load(url, {"model": target, "optimizer": target_optimizer})
            loads[mode].append(time.perf_counter() - started)
            checks[mode].append(sum(timed))
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3
    disk = None if args.no_fio else _disk_read_seconds(root, nbytes)
    base = statistics.median(loads["off"])
    print(f"state of {nbytes / 2**20:.0f} MiB (model + AdamW), {args.runs} loads each, torch threads {torch.get_num_threads()}")
    if disk is not None:
        print(f"disk read limit (fio, O_DIRECT): {disk:.3f} s for the state ({nbytes / disk / 1e9:.2f} GB/s)")
    print(f"{'digest':<10}{'load median s':>15}{'load overhead':>15}{'check s':>10}{'of disk load':>14}{'save s':>10}")
    for mode in urls:
        median, check = statistics.median(loads[mode]), statistics.median(checks[mode])
        of_disk = f"{check / disk:>13.1%}" if disk is not None else f"{'-':>13}"
        print(f"{mode:<10}{median:>15.3f}{(median / base - 1):>14.1%}{check:>10.3f} {of_disk}{saves[mode][0]:>10.3f}")


def _time_checks() -> list[float]:
    """Time every call of the state check from now on (a list the calls' seconds are appended to)."""
    from statekit.checks import state_check

    seconds: list[float] = []
    check = state_check.check

    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return check(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - started)

    state_check.check = timed
    return seconds


def _disk_read_seconds(directory: str, nbytes: int) -> float | None:
    """Seconds the disk under ``directory`` takes to read ``nbytes`` sequentially (fio), or None."""
    from _fio import ensure_fio, run_fio

    path = os.path.join(directory, "fio-read.bin")
    try:
        fio = ensure_fio()
        run_fio(fio, "write", path, nbytes, "libaio")
        return nbytes / run_fio(fio, "read", path, nbytes, "libaio")["bw_bytes"]
    except (OSError, RuntimeError, ValueError) as exc:
        print(f"(no disk read limit: {exc})")
        return None
    finally:
        if os.path.exists(path):
            os.remove(path)


if __name__ == "__main__":
    main()
