"""Run by test_rng_world_size.py under ``torch.distributed.run --nproc_per_node=2``.

Every rank seeds its generators differently, saves with statekit (gloo), notes what its
generators give next, scrambles them, loads the checkpoint back with the same world
size, and checks that it gets the same numbers. Rank 0 writes its expected numbers to
``argv[2]`` for the single-process load in the test.

Usage: python -m torch.distributed.run --nproc_per_node=2 _rng_two_ranks.py URL OUT.json
"""

from __future__ import annotations

import json
import random
import sys
import warnings

import numpy as np
import torch
import torch.distributed as dist

import statekit


def draw() -> dict:
    return {"python": random.random(), "numpy": float(np.random.rand()), "torch": torch.rand(3).tolist()}


def main() -> None:
    url, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    random.seed(10 + rank)
    np.random.seed(20 + rank)
    torch.manual_seed(30 + rank)
    manifest = statekit.save(url, {"w": torch.ones(2)})
    expected = draw()
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    with warnings.catch_warnings():
        warnings.simplefilter("error", statekit.StatekitWarning)
        statekit.load(url, {"w": torch.ones(2)})
    got = draw()
    if got != expected:
        raise SystemExit(f"rank {rank}: restored {got}, expected {expected}")
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"expected": expected, "world_size": manifest.world_size}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
