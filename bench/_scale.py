"""One scale measurement under torchrun: every rank saves its share of the state.

Usage (run by ``bench/run.py``)::

    torchrun --nproc-per-node=N bench/_scale.py DIR TOTAL_BYTES DTYPE RESULT_JSON

Each rank builds ``TOTAL_BYTES / N`` of model+AdamW state (as ``bench/_workers.py``) and
saves it as per-rank state with ``statekit.api.saveload.save(..., per_rank=("shard",))``; the
time is from a barrier before the save to the end of the save on rank 0 (the commit).
Rank 0 writes ``{"seconds", "state_bytes", "per_rank_bytes", "peak_rss_bytes"}``.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _workers import all_tensors, build, peak_bytes, reset_peak, rss_bytes, state_nbytes  # noqa: E402


def main() -> None:
    d, total, dtype_name, result = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    model, optim = build(total // world, dtype)
    shard = dict(all_tensors(model, optim))
    per_rank = state_nbytes(model, optim)
    import statekit

    reset_peak()
    base = rss_bytes()
    dist.barrier()
    t0 = time.perf_counter()
    statekit.api.saveload.save(d, {"shard": shard}, per_rank=("shard",))
    seconds = time.perf_counter() - t0
    peak = peak_bytes() - base
    sizes = [None] * world
    dist.all_gather_object(sizes, per_rank)
    if rank == 0:
        with open(result, "w") as f:
            json.dump({"seconds": seconds, "state_bytes": sum(sizes), "per_rank_bytes": per_rank, "peak_rss_bytes": peak}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
