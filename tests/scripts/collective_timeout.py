"""Two ranks; rank 1 never reaches the save (it waits on a training barrier instead).

Rank 0's ``manager.save`` must fail within STATEKIT_COLLECTIVE_TIMEOUT with a
CollectiveTimeoutError naming the collective; it writes the error to <out>/rank0.json,
then joins rank 1's barrier so both processes end.
Usage: torchrun --nproc_per_node=2 collective_timeout.py <root> <out> <first|later>
(first: the stuck save is the run's first, which creates statekit's group; later: both
ranks saved step 1 before).
"""

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import statekit

dist.init_process_group("gloo")
rank = dist.get_rank()
root, out, mode = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
manager = statekit.CheckpointManager({"model": torch.nn.Linear(4, 4)}, f"{root}/rank{rank}")
step = 1
if mode == "later":
    manager.save(1)
    step = 2
if rank == 0:
    started = time.monotonic()
    try:
        manager.save(step)
        result = {"error": None}
    except statekit.CollectiveTimeoutError as exc:
        result = {"error": type(exc).__name__, "message": str(exc), "collective": exc.collective,
                  "timeout_s": exc.timeout_s, "ranks": exc.ranks}
    result["seconds"] = time.monotonic() - started
    result["committed"] = [(i.step, i.committed) for i in manager.list()]
    (out / "rank0.json").write_text(json.dumps(result))
dist.barrier()  # rank 1 waits here from the start: it never reaches the save
dist.destroy_process_group()
