"""Elastic resume with DataLoader worker processes (issue 44), the ranks of one run in one
process (as in ``test_elastic.py``): the planned rest of an interrupted epoch goes to the
iterator that draws batches, not to the first ``iter()`` of the batch sampler.

torch's multi-process iterator calls ``iter()`` of its batch sampler twice while it is built
(``_BaseDataLoaderIter.__init__`` and ``_reset``) and draws from the second; statekit's
batch-sampler wrappers pass each call through at once. ``PlannedBatches`` spent its plan at
the first call, so a resumed rank with workers yielded a whole epoch of the new world size
and every sample the saved ranks had consumed was trained again. Real gloo processes:
``integration/torchrun/test_elastic_workers_ranks.py``.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler, SequentialSampler, TensorDataset

from statekit.loaders import data, elastic, tracking

accelerate_data = pytest.importorskip("accelerate.data_loader")
L, B = 36, 4  # 9 batches per epoch
DATASET = TensorDataset(torch.arange(L))


def _ids(batch) -> list[int]:
    return batch[0].tolist()


def _loader(n: int, r: int, workers: int, seed: int = 7, persistent: bool = False):
    # the sampler's own generator (as Accelerate's prepare() gives one): the workers' base seed,
    # which a persistent iterator draws once, comes from the global generator, not from the order's
    sampler = RandomSampler(DATASET, generator=torch.Generator().manual_seed(seed))
    loader = DataLoader(DATASET, batch_size=B, sampler=sampler, num_workers=workers, persistent_workers=persistent)
    prepared = accelerate_data.prepare_data_loader(loader, num_processes=n, process_index=r, put_on_device=False)
    tracking.track(prepared)
    return prepared


def _epoch_orders() -> tuple[list[int], list[int]]:
    """Epochs 1 and 2 of the uninterrupted run (its sampler's generator seeded 7)."""
    sampler = RandomSampler(DATASET, generator=torch.Generator().manual_seed(7))
    list(sampler)  # epoch 0
    return list(sampler), list(sampler)


@pytest.mark.parametrize("n, m, k, persistent", [(4, 2, 1, False), (2, 4, 2, False), (4, 2, 1, True)])
def test_resumed_ranks_with_workers_train_every_sample_once(n, m, k, persistent):
    """N ranks save after k batches of epoch 1 (no workers); M ranks with num_workers=2
    train the rest exactly once (plus BatchSamplerShard's padding from the epoch's start),
    then a plain M-rank epoch (with persistent workers: on the resumed epoch's iterator,
    which keeps the planned batch sampler as its index sampler)."""
    loaders = [_loader(n, r, workers=0) for r in range(n)]
    before, running = [], []
    for loader in loaders:
        list(loader)
        running.append(iter(loader))
        before += [i for _ in range(k) for i in _ids(next(running[-1]))]
    saved = [data.loader_state(loader) for loader in loaders]
    rest, following = [], []
    for r in range(m):
        loader = _loader(m, r, workers=2, seed=123, persistent=persistent)  # only the checkpoint may decide the order
        assert data.restore_loader(loader, saved[r] if r < n else None, name="dataloader_0", ranks=saved)
        rest.append([_ids(b) for b in loader])
        following.append([_ids(b) for b in loader])
        if persistent:
            loader.base_dataloader._iterator._shutdown_workers()
    order, next_order = _epoch_orders()
    remaining = [i for i in order if i not in set(before)]
    pad = order[: math.ceil(math.ceil(len(remaining) / B) / m) * m * B - len(remaining)]
    trained = Counter(before) + Counter(i for rank in rest for b in rank for i in b)
    assert trained == Counter(order) + Counter(pad)
    assert len({len(rank) for rank in rest}) == 1
    for r in range(m):
        shard = accelerate_data.BatchSamplerShard(BatchSampler(next_order, B, False), m, r, False, True)
        assert following[r] == [list(b) for b in shard]


def _distributed_loader(n: int, r: int, workers: int) -> DataLoader:
    loader = DataLoader(DATASET, batch_size=B, sampler=DistributedSampler(DATASET, n, r, shuffle=True, seed=3), num_workers=workers)
    tracking.track(loader)
    return loader


@pytest.mark.parametrize("n, m", [(4, 2), (2, 4)])
def test_distributed_sampler_ranks_with_workers_train_every_sample_once(n, m):
    """torch's DistributedSampler in a plain loader: the same with num_workers=2 on the resumed ranks."""
    before, running, saved = [], [], []
    for r in range(n):
        loader = _distributed_loader(n, r, workers=0)
        list(loader)
        loader.sampler.set_epoch(1)
        running.append(iter(loader))
        before += _ids(next(running[-1]))
        saved.append(loader)
    saved = [data.loader_state(loader) for loader in saved]
    rest, following = [], []
    for r in range(m):
        loader = _distributed_loader(m, r, workers=2)
        assert data.restore_loader(loader, saved[r] if r < n else None, name="loader", ranks=saved)
        loader.sampler.set_epoch(1)
        rest += [i for b in loader for i in _ids(b)]
        loader.sampler.set_epoch(2)
        following.append([_ids(b) for b in loader])
    order = torch.randperm(L, generator=torch.Generator().manual_seed(3 + 1)).tolist()
    remaining = L - len(before)
    pad = order[: math.ceil(remaining / m) * m - remaining]  # padded to a multiple of M from the epoch's start
    assert Counter(before) + Counter(rest) == Counter(order) + Counter(pad)
    for r in range(m):
        sampler = DistributedSampler(DATASET, m, r, shuffle=True, seed=3)
        sampler.set_epoch(2)
        assert following[r] == list(BatchSampler(sampler, B, False))


def _planned(batches: list[list[int]]) -> tuple[elastic.PlannedBatches, DataLoader]:
    owner = DataLoader(DATASET, batch_size=B)
    plan = elastic.Plan(epoch=0, start_states={}, batches=batches, steps=len(batches), source={"kind": "generator"}, length=L)
    planned = elastic.PlannedBatches(owner.batch_sampler, plan, SequentialSampler(DATASET), owner)
    return planned, owner


def test_planned_batches_go_to_the_iterator_that_draws():
    """iter() twice, then batches drawn from the second (torch's multi-process iterator):
    the second yields the plan; a third iter() yields the original batch sampler's epoch."""
    planned, owner = _planned([[5, 6], [7]])
    first, second = iter(planned), iter(planned)
    assert owner.batch_sampler is planned.original  # taken: the next epochs are plain ones
    assert len(planned) == 2
    assert list(second) == [[5, 6], [7]]
    assert len(planned) == len(planned.original) == math.ceil(L / B)
    assert list(first) == list(planned.original)  # asked only after the plan was drawn
    assert list(iter(planned)) == list(planned.original)


def test_planned_batches_with_no_batch_for_this_rank_are_spent():
    """A rank with nothing left of the epoch: its drawing iterator ends at once, the next is plain."""
    planned, _ = _planned([])
    iter(planned)
    assert list(iter(planned)) == []
    assert list(iter(planned)) == list(planned.original)
