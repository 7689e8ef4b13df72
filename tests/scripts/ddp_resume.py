"""Run under torchrun (gloo, CPU): Accelerate DDP training with a statekit CheckpointManager.

Usage: torchrun --nproc_per_node 2 ddp_resume.py MODE ROOT OUT [ACCUM]
MODE: reference (train TOTAL steps), first (save at SAVE_AT, go on 3 steps), resume.
ACCUM > 1: gradient_accumulation_steps, and the steps are micro-batches inside
``accelerator.accumulate`` (SAVE_AT 9 is then 2 micro-batches into a window).
Each rank writes its per-step losses to OUT.rank<r>.json.
A ``{rank}`` in ROOT gives each rank its own local root (standing in for a node's disk);
with STATEKIT_TEST_REPLICATE_TO set the manager replicates there (two tiers), ``first``
waits for the replication and ``resume`` must resume from the remote tier;
STATEKIT_TEST_ASYNC=1 saves with ``async_save=True``.
"""

import json
import os
import sys

import torch

sys.path.insert(0, __file__.rsplit("/scripts/", 1)[0])
from accelerate_helpers import build, train_micro_batches, train_steps  # noqa: E402

import statekit  # noqa: E402

TOTAL, SAVE_AT = 16, 9  # 7 batches per rank per epoch: step 9 is batch 2 of epoch 2

mode, root, out = sys.argv[1:4]
accum = int(sys.argv[4]) if len(sys.argv) > 4 else 1
if accum > 1:
    train_steps = train_micro_batches  # noqa: F811
run = build(seed=0, n=112, batch_size=8, accum=accum)
accelerator = run[0]
assert accelerator.num_processes == 2, accelerator.num_processes
remote = os.environ.get("STATEKIT_TEST_REPLICATE_TO")
manager = statekit.CheckpointManager(accelerator, root.format(rank=accelerator.process_index), replicate_to=remote,
                                     async_save=os.environ.get("STATEKIT_TEST_ASYNC") == "1")
losses = []
if mode == "reference":
    losses = train_steps(run, TOTAL)
elif mode == "first":
    losses = train_steps(run, SAVE_AT, on_step=lambda s: manager.save(s) if s == SAVE_AT else None)
    losses += train_steps(run, 3, start=SAVE_AT)
    manager.wait()  # an async save's commit
    replicator = manager.plugin_state.get("replicate")  # the replicate plugin's, with replicate_to
    assert replicator is None or replicator.wait(timeout=120) == []
else:
    step = manager.resume()
    assert step == SAVE_AT, step
    assert not remote or manager.resumed_from.startswith(remote), manager.resumed_from
    losses = train_steps(run, TOTAL - step, start=step)
weights = {k: v.tolist() for k, v in accelerator.unwrap_model(run[1]).state_dict().items()}
with open(f"{out}.rank{accelerator.process_index}.json", "w") as f:
    json.dump({"losses": losses, "weights": weights}, f)
accelerator.wait_for_everyone()
torch.distributed.destroy_process_group()

# Outputs written, every rank past the barrier: skip interpreter finalization, where gloo
# threads freed out of order can abort a finished process ("terminate called without an
# active exception", pytorch/pytorch PR 179291); the test checks the outputs, not teardown.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
