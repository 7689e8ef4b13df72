"""Run under torchrun (gloo, CPU): a loader with DataLoader worker processes saved mid-epoch
with one world size and resumed with another, twice (issue 44).

Usage: torchrun --nproc_per_node N elastic_workers.py PHASE ROOT OUT MODE [persistent]
PHASE:
- ``save``: epoch 0 whole, SAVE_AT steps of epoch 1, save, stop as if killed;
- ``resume``: resume, the rest of epoch 1, epoch 2 whole, SAVE_AT steps of epoch 3, save
  again, stop (the checkpoint a later ``resume2`` with another world size starts from);
- ``resume2``: resume from that, the rest of epoch 3, epoch 4 whole.
MODE: ``manager`` (``CheckpointManager.save`` / ``resume()``), ``save_state``
(``statekit.attach(accelerator)``, then ``statekit.save_state`` / ``load_state``) or
``accelerate`` (``statekit.attach(accelerator)``, then Accelerate's own
``accelerator.save_state`` / ``load_state``).
The loader: ``accelerator.prepare`` of a shuffled ``DataLoader`` over the sample ids
0..L-1, batch size B, ``num_workers=2`` (``persistent_workers`` with ``persistent``;
Accelerate's BatchSamplerShard); every step trains a tiny model on the batch. Each rank
writes to OUT.<phase>.rank<r>.json the sample ids of every batch it trained: ``before``
(the steps before its save), ``rest`` (the rest of the resumed epoch), ``next`` (the epoch
after it), and ``start``, the sampler generator's state at the start of the epoch it saved in.
"""

import json
import os
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

import statekit
from statekit.loaders import data

L, B, SAVE_AT = 68, 4, 2  # 17 batches an epoch

phase, root, out, mode = sys.argv[1:5]
persistent = sys.argv[5:] == ["persistent"]
set_seed(0)
accelerator = Accelerator(cpu=True)
model = torch.nn.Linear(1, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
loader = DataLoader(TensorDataset(torch.arange(L)), batch_size=B, shuffle=True, num_workers=2, persistent_workers=persistent)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
if mode in ("save_state", "accelerate"):
    statekit.attach(accelerator)
manager = statekit.CheckpointManager(accelerator, f"{root}/manager") if mode == "manager" else None
rank = accelerator.process_index


def train(batch) -> list[int]:
    ids = batch[0]
    loss = model(ids.float()[:, None]).square().mean()
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    return ids.tolist()


def save(tag: str, step: int) -> None:
    if mode == "manager":
        manager.save(step)
    elif mode == "save_state":
        statekit.save_state(accelerator, f"{root}/{tag}")
    else:
        accelerator.save_state(f"{root}/{tag}")


def resume(tag: str, step: int) -> None:
    if mode == "manager":
        assert manager.resume() == step
    elif mode == "save_state":
        statekit.load_state(accelerator, f"{root}/{tag}")
    else:
        accelerator.load_state(f"{root}/{tag}")


def train_until_save(tag: str, step: int) -> None:
    """SAVE_AT steps of a new epoch, then a save; the iterator is left open, as a killed run leaves it."""
    iterator = iter(loader)
    record["before"] = [train(next(iterator)) for _ in range(SAVE_AT)]
    record["start"] = data.loader_state(loader)["start_states"]["sampler"].tolist()
    save(tag, step)


record: dict = {"world_size": accelerator.num_processes}
if phase == "save":
    [train(b) for b in loader]  # epoch 0
    train_until_save("first", 1)
else:
    resume(*(("first", 1) if phase == "resume" else ("second", 2)))
    record["rest"] = [train(b) for b in loader]
    record["next"] = [train(b) for b in loader]
    if phase == "resume":
        train_until_save("second", 2)
with open(f"{out}.{phase}.rank{rank}.json", "w") as f:
    json.dump(record, f)
accelerator.wait_for_everyone()
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()

# Outputs written, every rank past the barrier: skip interpreter finalization, where gloo
# threads freed out of order can abort a finished process (as in elastic_resume.py).
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
