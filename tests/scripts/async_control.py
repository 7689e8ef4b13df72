"""Two ranks, async saves with back-pressure "skip" and the save on a signal's step
boundary at every step: the training thread's agreements (the signal flag, "has every
rank's previous save finished") run while the writer threads of async saves run the saves'
own collectives. Rank 0 holds the bigger state (its writer is slower), so the two ranks'
threads reach the collectives in different orders. Each rank writes <out>/rank<r>.json
with the steps committed and its model's state after the run.
Usage: torchrun --nproc_per_node=2 async_control.py <root> <out>
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import statekit

dist.init_process_group("gloo")
rank = dist.get_rank()
root, out = sys.argv[1], Path(sys.argv[2])
torch.manual_seed(rank)
model = torch.nn.Linear(2048 if rank == 0 else 8, 1024 if rank == 0 else 8)  # 8 MiB against a few bytes
optim = torch.optim.SGD(model.parameters(), lr=0.1)
outcomes = []
with statekit.CheckpointManager({"model": model, "optim": optim}, root,
                                async_save=statekit.AsyncPolicy(backpressure="skip"),
                                save_on_signal=statekit.PreemptionPolicy(check_every=1)) as manager:
    step = 0
    # at least 40 steps, and on until a save after the first committed: a loaded machine's
    # first write may outlast 40 steps (every later one skipped); the skips are agreed, so
    # every rank leaves the loop at the same step
    while step < 40 or (not any(outcomes[1:]) and step < 100_000):
        step += 1
        model(torch.randn(4, model.in_features)).square().mean().backward()
        optim.step()
        optim.zero_grad()
        outcomes.append(manager.save(step) is not None)
        manager.step_boundary(step)
    manager.wait()
    committed = [i.step for i in manager.list() if i.committed]
state = {k: v.tolist() for k, v in model.state_dict().items()}
(out / f"rank{rank}.json").write_text(json.dumps({"committed": committed, "outcomes": outcomes, "state": state}))
dist.destroy_process_group()
