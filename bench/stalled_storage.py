"""Training with the remote tier frozen: step time against the undisturbed run (issue 30).

Usage::

    python bench/stalled_storage.py [--freeze 60] [--size 64MiB] [--save-every 10]

Starts a moto S3 server on 127.0.0.1 (the tests' server) and trains a stack of
``nn.Linear`` layers (``--size`` bytes of weights, AdamW) with a ``CheckpointManager``
saving every ``--save-every`` steps asynchronously to a local root replicated to that
server (``replicate_to``). First ``--freeze`` seconds undisturbed, then ``--freeze``
seconds with the server stopped (SIGSTOP; SIGCONT after). A step's time includes its
``save()`` call, so it is what the training loop felt. Prints the mean and median step
time of both phases, their ratio (done when <= 1.05), the longest ``save()`` blocking time
from ``manager.stats()`` (done when < 1 s) and the stats as JSON.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
import uuid
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _units import parse_size  # noqa: E402

import statekit  # noqa: E402
from statekit.testing import start_moto_server  # noqa: E402


def _phase(seconds: float, train_step, manager, save_every: int, step: int) -> tuple[list[float], int]:
    """Train for ``seconds``; return each step's wall time (its save included) and the last step."""
    times: list[float] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        started = time.monotonic()
        train_step()
        step += 1
        if step % save_every == 0:
            manager.save(step)
        times.append(time.monotonic() - started)
    return times, step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--freeze", type=float, default=60.0, help="seconds of each phase (default 60)")
    parser.add_argument("--size", default="64MiB", help="bytes of weights (default 64MiB)")
    parser.add_argument("--save-every", type=int, default=10, help="steps between saves (default 10)")
    args = parser.parse_args(argv)
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

    with start_moto_server(environment=False) as server, tempfile.TemporaryDirectory() as local:
        options = {**server.storage_options, "skip_instance_cache": True,
                   "config_kwargs": {"connect_timeout": 5, "read_timeout": 10, "retries": {"max_attempts": 1}}}
        import s3fs

        s3fs.S3FileSystem(**options).mkdir("stall")
        remote = f"s3://stall/run-{uuid.uuid4().hex[:6]}"
        warnings.simplefilter("ignore")  # the retries' warnings while frozen
        manager = statekit.CheckpointManager({"model": model, "optimizer": optimizer}, local, async_save=True,
                                             keep_last=2, replicate_to=remote, replicate_options=options)
        manager.replicator.backoff_seconds = 0.5
        print(f"{layers} x Linear({width}, {width}) + AdamW, save every {args.save_every} steps, "
              f"phases of {args.freeze:g} s", flush=True)
        undisturbed, step = _phase(args.freeze, train_step, manager, args.save_every, 0)
        server.process.send_signal(signal.SIGSTOP)
        try:
            frozen, step = _phase(args.freeze, train_step, manager, args.save_every, step)
            backlog = manager.stats().replication
        finally:
            server.process.send_signal(signal.SIGCONT)
        manager.wait(timeout=300)
        stats = manager.stats()
    ratio_mean = statistics.mean(frozen) / statistics.mean(undisturbed)
    ratio_median = statistics.median(frozen) / statistics.median(undisturbed)
    print(f"undisturbed: {len(undisturbed)} steps, mean {statistics.mean(undisturbed) * 1e3:.1f} ms, "
          f"median {statistics.median(undisturbed) * 1e3:.1f} ms")
    print(f"frozen:      {len(frozen)} steps, mean {statistics.mean(frozen) * 1e3:.1f} ms, "
          f"median {statistics.median(frozen) * 1e3:.1f} ms; backlog at the thaw {backlog}")
    print(f"ratio frozen/undisturbed: mean {ratio_mean:.3f}, median {ratio_median:.3f} (target <= 1.05)")
    print(f"longest save() blocking: {stats.blocking_s_max:.3f} s over {stats.save_count} saves "
          f"({stats.skipped_saves} skipped; target < 1 s)")
    print({k: v for k, v in stats.to_dict().items() if k != "saves"})
    return 0 if ratio_mean <= 1.05 and stats.blocking_s_max < 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
