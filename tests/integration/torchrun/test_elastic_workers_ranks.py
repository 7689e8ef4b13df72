"""Elastic resume of a loader with DataLoader worker processes, real gloo ranks (issue 44):
an epoch saved mid-way by N torchrun ranks with ``num_workers=2`` continues on M ranks with
every sample of the interrupted epoch trained exactly once, plus the padding an M-rank
``BatchSamplerShard`` adds (docs/concepts.md, "Changing the world size"), through
``CheckpointManager.save``/``resume()`` and through ``statekit.attach`` +
``accelerator.save_state``/``load_state`` (``scripts/elastic_workers.py``): 4 -> 2, then
the resumed run's own mid-epoch checkpoint 2 -> 4.

The regression it guards: torch's multi-process iterator calls ``iter()`` of its batch
sampler twice while it is built and draws from the second; the planned rest of the epoch
went to the first, and the drawing iterator yielded a whole M-rank epoch, so every sample
the N ranks had consumed was trained again (4 -> 2: 32 of 68 here, 2 -> 4: 16). The
in-process counterpart (persistent workers too) is ``unit/loaders/test_elastic_workers.py``.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils.data import BatchSampler, RandomSampler

from accelerate_helpers import torchrun

accelerate_data = pytest.importorskip("accelerate.data_loader")

L, B, SAVE_AT = 68, 4, 2  # as in tests/scripts/elastic_workers.py


def _ranks(out: Path, phase: str, nproc: int) -> list[dict]:
    return [json.loads(Path(f"{out}.{phase}.rank{r}.json").read_text()) for r in range(nproc)]


def _orders(start_state: list[int]) -> tuple[list[int], list[int]]:
    """Epochs 1 and 2 of a RandomSampler whose generator starts epoch 1 at ``start_state``."""
    g = torch.Generator()
    g.set_state(torch.tensor(start_state, dtype=torch.uint8))
    sampler = RandomSampler(range(L), generator=g)
    return list(sampler), list(sampler)


def _check(saved: list[dict], resumed: list[dict]) -> None:
    n, m = len(saved), len(resumed)
    order, following = _orders(saved[0]["start"])
    before = [i for rank in saved for b in rank["before"] for i in b]
    assert len(before) == n * SAVE_AT * B and len(set(before)) == len(before)
    rest = [i for rank in resumed for b in rank["rest"] for i in b]
    remaining = [i for i in order if i not in set(before)]
    # BatchSamplerShard (even_batches): whole steps of M batches, padded from the epoch's start
    pad = order[: math.ceil(math.ceil(len(remaining) / B) / m) * m * B - len(remaining)]
    trained = Counter(before) + Counter(rest)
    twice = sum(c - 1 for i, c in trained.items() if c > 1) - len(pad)
    assert trained == Counter(order) + Counter(pad), f"{n} -> {m}: {twice} samples trained twice beyond the padding"
    assert len({len(rank["rest"]) for rank in resumed}) == 1  # every rank the same number of steps
    for r in range(m):  # the next epoch: what an uninterrupted M-rank run yields on rank r
        shard = accelerate_data.BatchSamplerShard(BatchSampler(following, B, False), m, r, split_batches=False, even_batches=True)
        assert resumed[r]["next"] == [list(b) for b in shard], (n, m, r)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["manager", "accelerate"])
def test_elastic_resume_with_workers_trains_every_sample_once(tmp_path, mode):
    """4 ranks save after SAVE_AT steps of epoch 1; 2 ranks resume (9 batches left: the last
    step padded with one), train epoch 2, save after SAVE_AT steps of epoch 3; 4 ranks resume
    that (13 batches left: padded with 3) and train epoch 4."""
    out = tmp_path / "out"
    torchrun("elastic_workers.py", "save", str(tmp_path), str(out), mode, nproc=4)
    torchrun("elastic_workers.py", "resume", str(tmp_path), str(out), mode, nproc=2)
    torchrun("elastic_workers.py", "resume2", str(tmp_path), str(out), mode, nproc=4)
    _check(_ranks(out, "save", 4), _ranks(out, "resume", 2))  # 4 -> 2
    _check(_ranks(out, "resume", 2), _ranks(out, "resume2", 4))  # 2 -> 4
