"""Under torchrun (2 ranks, gloo, CPU): lineage with every rank (tests/integration/torchrun/test_lineage_ranks.py).

Saves steps 1 to 3, rolls back to step 1 with ``resume(step=1)`` and saves 2 and 3 again on
the new branch (``shared``: one root every rank shares; ``local``: each rank its own root,
as on nodes without a shared disk, replicated to one remote tier, ``<root>/remote``), then a
new manager resumes. Each rank writes
``<out>.rank<r>.json``: the folders it wrote under its root and the checkpoint the last resume took."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import statekit


def objects() -> dict:
    model = torch.nn.Linear(3, 2)
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)}


def replicated(manager: statekit.CheckpointManager) -> None:
    """Wait until the remote tier holds every save so far (with replicate_to)."""
    replicator = manager.plugin_state.get("replicate")
    assert replicator is None or replicator.wait(timeout=120) == []
    dist.barrier()


def main(root: str, out: str, layout: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    options = {}
    if layout == "local":
        root, options = f"{root}/rank{rank}", {"replicate_to": f"{root}/remote"}
    torch.manual_seed(0)
    state = objects()
    first = statekit.CheckpointManager(state, root, **options)
    for step in (1, 2, 3):
        with torch.no_grad():
            state["model"].weight.fill_(step)
        first.save(step)
        replicated(first)
    rolled = statekit.CheckpointManager(state, root, **options)
    assert rolled.resume(step=1) == 1
    for step in (2, 3):
        with torch.no_grad():
            state["model"].weight.fill_(10 + step)
        rolled.save(step)
        replicated(rolled)
    fresh = objects()
    later = statekit.CheckpointManager(fresh, root, **options)
    resumed = later.resume()
    saved = sorted(p.name for p in Path(root).iterdir() if p.name.startswith("checkpoint-"))  # what this rank wrote
    result = {"saved": saved, "resumed": resumed, "resumed_from": later.resumed_from,
              "weight": float(fresh["model"].weight[0, 0]), "run": later.lineage_run_id}
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
