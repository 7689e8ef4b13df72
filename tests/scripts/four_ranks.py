"""Run under torchrun with 4 ranks (gloo, CPU): Accelerate DDP training with a statekit
CheckpointManager, restarted from a checkpoint (issue 35, item 4).

Usage: torchrun --nproc_per_node 4 four_ranks.py MODE ROOT OUT
MODE: reference (train TOTAL steps), first (save at SAVE_AT, go on 3 steps), resume (a
fresh process resumes and trains to TOTAL), resume-warm (the same after one forward and
backward of the freshly prepared model, before the resume: docs/concepts.md).
Each rank writes OUT.rank<r>.json: per-step (loss, labels), the final weights, and the
StatekitWarnings of the resume.

With more than two ranks gloo sums a gradient bucket in an order that depends on where each
gradient sits in it; a fresh DDP model keeps its first bucket layout for one iteration and
then rebuilds it in the order gradients became ready. A resumed run's first step would use
the first layout where the uninterrupted run used the rebuilt one.
"""

import json
import os
import sys
import warnings

import torch
import torch.nn.functional as F

sys.path.insert(0, __file__.rsplit("/scripts/", 1)[0])
from accelerate_helpers import fresh_accelerator, train_loop  # noqa: E402

import statekit  # noqa: E402

TOTAL, SAVE_AT = 16, 9  # 7 batches per rank per epoch: step 9 is batch 2 of epoch 1

mode, root, out = sys.argv[1:4]
from accelerate.utils import set_seed  # noqa: E402

set_seed(0)
accelerator = fresh_accelerator()
g = torch.Generator().manual_seed(99)
x, y = torch.randn(224, 64, generator=g), torch.randint(0, 10, (224,), generator=g)
# about 50,000 parameters: gloo sums a buffer this size in chunks whose order depends on the
# layout (a model of a few hundred parameters is summed in rank order whatever the layout)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(256, 128),
                            torch.nn.ReLU(), torch.nn.Linear(128, 10))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8, shuffle=True)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
assert accelerator.num_processes == 4, accelerator.num_processes
manager = statekit.CheckpointManager(accelerator, root)
caught: list[str] = []
if mode == "reference":
    seen = train_loop(model, optimizer, loader, TOTAL)
elif mode == "first":
    seen = train_loop(model, optimizer, loader, SAVE_AT, on_step=lambda s: manager.save(s) if s == SAVE_AT else None)
    seen += train_loop(model, optimizer, loader, 3, start=SAVE_AT)
else:
    if mode == "resume-warm":  # the documented recipe: the bucket layout rebuilt before the resume
        F.cross_entropy(model(torch.zeros(2, 64)), torch.zeros(2, dtype=torch.long)).backward()
        optimizer.zero_grad(set_to_none=True)
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        step = manager.resume()
    caught = [str(w.message) for w in records if issubclass(w.category, statekit.StatekitWarning)]
    assert step == SAVE_AT, step
    # a model passed as its DDP wrapper (the mapping API) is checked at the load
    statekit.save(f"{root}-mapping", {"model": model}, overwrite=True)
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        statekit.load(f"{root}-mapping", {"model": model})
    caught += [str(w.message) for w in records if issubclass(w.category, statekit.StatekitWarning)]
    seen = train_loop(model, optimizer, loader, TOTAL - step, start=step)
weights = {k: v.tolist() for k, v in accelerator.unwrap_model(model).state_dict().items()}
with open(f"{out}.rank{accelerator.process_index}.json", "w") as f:
    json.dump({"seen": seen, "weights": weights, "warnings": caught}, f)
accelerator.wait_for_everyone()
torch.distributed.destroy_process_group()

# Outputs written, every rank past the barrier: skip interpreter finalization (gloo threads
# freed out of order can abort a finished process, pytorch/pytorch PR 179291).
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
