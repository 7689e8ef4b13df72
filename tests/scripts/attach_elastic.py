"""Run under torchrun (gloo, CPU): an attach-mode checkpoint saved mid-epoch by 2 ranks, loaded by 1
(statekit.load_state -> _load_attached, or the attached Accelerator.load_state). MODE attach|attachacc|native."""
import json, os, sys, warnings
import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset
import statekit

L, B, SAVE_AT = 48, 4, 2
phase, root, out, mode = sys.argv[1:5]
set_seed(0)
acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(dispatch_batches=False))
loader = acc.prepare(DataLoader(TensorDataset(torch.arange(L)), batch_size=B, shuffle=True))
if mode in ("attach", "attachacc"):
    statekit.attach(acc)
else:
    pass
    from statekit.loaders import tracking
    tracking.track(loader)
rank = acc.process_index
rec = {}
if phase == "save":
    list(loader)  # epoch 0
    it = iter(loader)
    rec["before"] = [next(it)[0].tolist() for _ in range(SAVE_AT)]
    if mode in ("attach", "attachacc"):
        acc.save_state(f"{root}/c")
    else:
        statekit.save_state(acc, f"{root}/c")
    rec["after"] = [b[0].tolist() for b in it]
else:
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        if mode == "attachacc":
            acc.load_state(f"{root}/c")
        else:
            statekit.load_state(acc, f"{root}/c", allow_pickle=True)
    rec["warnings"] = [str(x.message)[:200] for x in w]
    rec["rest"] = [b[0].tolist() for b in loader]
with open(f"{out}.{phase}.rank{rank}.json", "w") as f:
    json.dump(rec, f)
acc.wait_for_everyone()
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
sys.stdout.flush(); sys.stderr.flush(); os._exit(0)
