"""One Trainer run under torchrun (gloo, CPU): ``ddp_run.py OUT_DIR RESULT_FILE [--stop-at K] [--resume]``.

Each rank records its micro-batch losses; rank 0 writes them (all ranks') and the final
weights to RESULT_FILE (torch.save of tensors and lists only, read back by the test).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import trainer_runs as tr  # noqa: E402


def main() -> None:
    out, result_file = sys.argv[1], sys.argv[2]
    stop_at = int(sys.argv[sys.argv.index("--stop-at") + 1]) if "--stop-at" in sys.argv else None
    resume = "--resume" in sys.argv
    result = tr.run(out, resume=True if resume else None, stop_at=stop_at, ddp_backend="gloo",
                    per_device_train_batch_size=2)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result.losses)
    if dist.get_rank() == 0:
        torch.save({"losses": gathered, "weights": result.weights}, result_file)
    dist.barrier()
    dist.destroy_process_group()  # every group (statekit's gloo group too): no thread left to abort at exit


if __name__ == "__main__":
    main()
