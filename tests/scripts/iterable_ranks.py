"""Run under torchrun (gloo, CPU): an IterableDataset loader prepared by Accelerate on two
ranks (issue 13: exact mid-epoch resume with iterable datasets, several processes).

Usage: torchrun --nproc_per_node 2 iterable_ranks.py MODE STATEFUL DATASET ROOT OUT
MODE: dispatch (DataLoaderDispatcher, rank 0 reads and sends each rank its part) or shard
(IterableDatasetShard, ``dispatch_batches=False``); STATEFUL: 0/1 (torchdata's loader);
DATASET: stream (no state: re-read) or stateful (torchdata's Stateful protocol).
A reference run, a run that saves mid-epoch and goes on, and a fresh run resumed from the
checkpoint, all in this process; each rank writes OUT.rank<r>.json with the reference and
the interrupted + resumed per-step (loss, labels), and whether the final states are equal.
"""

import json
import os
import sys

import torch

sys.path.insert(0, __file__.rsplit("/scripts/", 1)[0])
import iterable_helpers as t  # noqa: E402

from statekit.testing import assert_state_equal  # noqa: E402

mode, stateful, dataset, root, out = sys.argv[1], sys.argv[2] == "1", sys.argv[3], sys.argv[4], sys.argv[5]
dataset_cls = {"stream": t.Stream, "stateful": t.StatefulStream}[dataset]
reference = t.Run(dataset_cls, stateful, mode, f"{root}/ref")
rank = reference.accelerator.process_index
assert reference.accelerator.num_processes == 2
expected = reference.train(t.TOTAL)
first = t.Run(dataset_cls, stateful, mode, f"{root}/run")
got = first.train(t.SAVE_AT, save_at=t.SAVE_AT)
first.train(3, start=t.SAVE_AT)
resumed = t.Run(dataset_cls, stateful, mode, f"{root}/run")
resumed.resume()
got += resumed.train(t.TOTAL - t.SAVE_AT, start=t.SAVE_AT)
same = True
try:
    assert_state_equal(resumed.model.state_dict(), reference.model.state_dict())
    assert_state_equal(resumed.optimizer.state_dict(), reference.optimizer.state_dict())
except AssertionError:
    same = False
with open(f"{out}.rank{rank}.json", "w") as f:
    json.dump({"expected": expected, "got": got, "same_state": same}, f)
resumed.accelerator.wait_for_everyone()
torch.distributed.destroy_process_group()

# Outputs written, every rank past the barrier: skip interpreter finalization, where gloo
# threads freed out of order can abort a finished process ("terminate called without an
# active exception", pytorch/pytorch PR 179291); the test checks the outputs, not teardown.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
