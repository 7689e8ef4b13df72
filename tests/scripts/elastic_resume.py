"""Run under torchrun (gloo, CPU): three data loaders saved mid-epoch with one world size
and resumed with another (issue 13 item 4).

Usage: torchrun --nproc_per_node N elastic_resume.py PHASE ROOT OUT
PHASE: save (epoch 0 whole, SAVE_AT batches of epoch 1, save, stop as if killed) or
resume (resume, the rest of epoch 1, then epoch 2).
Loaders over the sample ids 0..L-1, batch size B, shuffled:
- shard: ``accelerator.prepare`` (Accelerate's BatchSamplerShard; one process: no shard);
- dispatch: ``accelerator.prepare`` with ``dispatch_batches=True`` (DataLoaderDispatcher);
- torch: a plain DataLoader with a DistributedSampler (not prepared), saved by a
  CheckpointManager of its own.
Each rank writes the sample ids of every batch to OUT.rank<r>.json.
"""

import json
import os
import sys

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import statekit
from statekit.loaders import data

L, B, SAVE_AT = 48, 4, 2

phase, root, out = sys.argv[1:4]
set_seed(0)
accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(dispatch_batches=False))
dataset = TensorDataset(torch.arange(L))
shard = accelerator.prepare(DataLoader(dataset, batch_size=B, shuffle=True))
accelerator.dataloader_config.dispatch_batches = True
dispatch = accelerator.prepare(DataLoader(dataset, batch_size=B, shuffle=True))
world, rank = accelerator.num_processes, accelerator.process_index
plain = DataLoader(dataset, batch_size=B, sampler=DistributedSampler(dataset, world, rank, shuffle=True, seed=7))
loaders = {"shard": shard, "dispatch": dispatch, "torch": plain}
managers = [statekit.CheckpointManager(accelerator, f"{root}/accelerate"), statekit.CheckpointManager({"loader": plain}, f"{root}/torch")]


def ids(batch) -> list[int]:
    return batch[0].tolist()


record: dict = {"world_size": world}
if phase == "save":
    for loader in loaders.values():
        plain.sampler.set_epoch(0)
        list(loader)
    plain.sampler.set_epoch(1)
    iterators = {k: iter(loader) for k, loader in loaders.items()}
    record["before"] = {k: [ids(next(it)) for _ in range(SAVE_AT)] for k, it in iterators.items()}
    # the sampler generators at the start of epoch 1 (the test draws epochs 1 and 2 from them):
    # Accelerate's synchronized generator, or the one a RandomSampler without a generator
    # seeded from the global generator (what statekit saves as the epoch's sampler state)
    # (a dispatcher's other ranks draw nothing: rank 0 reads for all; the test reads rank 0's)
    states = {k: data.loader_state(loaders[k])["start_states"].get("sampler") for k in ("shard", "dispatch")}
    record["start"] = {k: state.tolist() for k, state in states.items() if state is not None}
    for manager in managers:
        manager.save(1)
else:
    for manager in managers:
        assert manager.resume() == 1
    plain.sampler.set_epoch(1)
    record["rest"] = {k: [ids(b) for b in loader] for k, loader in loaders.items()}
    plain.sampler.set_epoch(2)
    record["next"] = {k: [ids(b) for b in loader] for k, loader in loaders.items()}
with open(f"{out}.rank{rank}.json", "w") as f:
    json.dump(record, f)
accelerator.wait_for_everyone()
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()

# Outputs written, every rank past the barrier: skip interpreter finalization, where gloo
# threads freed out of order can abort a finished process ("terminate called without an
# active exception", pytorch/pytorch PR 179291); the test checks the outputs, not teardown.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
