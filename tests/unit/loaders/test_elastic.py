"""Elastic data position (issue 13 item 4): an epoch saved mid-way with N ranks continues
on M ranks with no sample skipped or seen twice.

Fast tests run the ranks of one run in one process (Accelerate's ``prepare_data_loader``
with explicit ``num_processes``/``process_index``, torch ``DistributedSampler`` with explicit
``num_replicas``/``rank``: the same objects torchrun ranks build). Real gloo processes
through ``CheckpointManager.resume()``: ``integration/torchrun/test_elastic_resume.py``.
"""

from __future__ import annotations

import itertools
import json
import math
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, TensorDataset

import statekit
from statekit.loaders import data, elastic, elastic_layouts, samplers, tracking

accelerate_data = pytest.importorskip("accelerate.data_loader")
L, B = 30, 4
DATASET = TensorDataset(torch.arange(L))


def _ids(batch) -> list[int]:
    return batch[0].tolist()


# --- the layout model against the real samplers (uninterrupted epochs) ---


@pytest.mark.parametrize("split", [False, True])
def test_shard_model_equals_batch_sampler_shard(split):
    """shard() of a whole epoch is what Accelerate's BatchSamplerShard yields, rank by rank."""
    cases = 0
    for length, size, n, even, drop in itertools.product([1, 5, 7, 12, 13, 31], [1, 2, 4], [1, 2, 3, 4], [True, False], [True, False]):
        if split and size % n:
            continue
        layout = {"kind": "shard", "world_size": n, "batch_size": size, "drop_last": drop, "even_batches": even, "split_batches": split}
        model = elastic_layouts.shard(list(range(length)), layout, list(range(length)))
        for r in range(n):
            real = accelerate_data.BatchSamplerShard(BatchSampler(range(length), size, drop), n, r, split, even)
            assert [list(b) for b in real] == model[r], (length, size, n, even, drop, r)
            cases += 1
    assert cases > 200


def test_distributed_model_equals_distributed_sampler():
    for length, size, n, drop, sampler_drop in itertools.product([2, 5, 7, 12, 13], [1, 2, 4], [1, 2, 3, 4], [True, False], [True, False]):
        layout = {"kind": "distributed", "world_size": n, "batch_size": size, "drop_last": drop, "sampler": {"drop_last": sampler_drop}}
        model = elastic_layouts.shard(list(range(length)), layout, list(range(length)))
        for r in range(n):
            real = BatchSampler(DistributedSampler(range(length), n, r, shuffle=False, drop_last=sampler_drop), size, drop)
            assert list(real) == model[r], (length, size, n, drop, sampler_drop, r)


def test_dispatch_model_slices_concatenated_batches_and_pads_from_the_first_samples():
    layout = {"kind": "dispatch", "world_size": 2, "batch_size": 3, "drop_last": False, "split_batches": False}
    # base batches [0,1,2] [3,4,5] | [6,7,8] [9]: the last step has 4 samples -> 2 each;
    per_rank = elastic_layouts.shard(list(range(10)), layout, list(range(10)))
    assert per_rank == [[[0, 1, 2], [6, 7]], [[3, 4, 5], [8, 9]]]
    # 3 samples in the last step: padded with the first 2 samples of the iteration, 2 each
    per_rank = elastic_layouts.shard(list(range(9)), layout, list(range(9)))
    assert per_rank == [[[0, 1, 2], [6, 7]], [[3, 4, 5], [8, 0]]]
    split = {**layout, "batch_size": 4, "split_batches": True}
    assert elastic_layouts.shard(list(range(6)), split, list(range(6))) == [[[0, 1], [4]], [[2, 3], [5]]]


# --- real loaders, ranks of one run simulated in one process ---


def _accelerate_loader(n: int, r: int, seed: int = 7, even_batches: bool = True):
    loader = DataLoader(DATASET, batch_size=B, shuffle=True, generator=torch.Generator().manual_seed(seed))
    prepared = accelerate_data.prepare_data_loader(loader, num_processes=n, process_index=r, put_on_device=False, even_batches=even_batches)
    tracking.track(prepared)
    return prepared


def _torch_loader(n: int, r: int, seed: int = 3):
    loader = DataLoader(DATASET, batch_size=B, sampler=DistributedSampler(DATASET, n, r, shuffle=True, seed=seed))
    tracking.track(loader)
    return loader


def _set_epoch(loader, epoch: int) -> None:
    if isinstance(loader.sampler, DistributedSampler):
        loader.sampler.set_epoch(epoch)


def _save(make, n: int, k: int):
    """N ranks: epoch 0 whole, k batches of epoch 1, then every rank's saved position."""
    loaders = [make(n, r) for r in range(n)]
    seen, running = [], []  # the ranks' iterators stay alive until the save, as a training loop's do
    for loader in loaders:
        _set_epoch(loader, 0)
        list(loader)
        _set_epoch(loader, 1)
        running.append(iter(loader))
        seen += [_ids(next(running[-1])) for _ in range(k)]
    return [data.loader_state(loader) for loader in loaders], seen


def _resume(make, saved, m: int, seed: int):
    """M ranks restored from ``saved`` (ranks beyond it have no state of their own): per
    rank, the batches of the rest of epoch 1 and of epoch 2."""
    rest, following = [], []
    for r in range(m):
        loader = make(m, r, seed)  # another seed: only the saved state may decide the order
        assert data.restore_loader(loader, saved[r] if r < len(saved) else None, name="dataloader_0", ranks=saved)
        _set_epoch(loader, 1)
        rest.append([_ids(b) for b in loader])
        _set_epoch(loader, 2)
        following.append([_ids(b) for b in loader])
    return rest, following


def _reference_orders(epochs: int = 3) -> list[list[int]]:
    """The permutations an uninterrupted run draws (one process: the same draws as any N)."""
    loader = DataLoader(DATASET, batch_size=B, shuffle=True, generator=torch.Generator().manual_seed(7))
    return [[i for b in loader for i in _ids(b)] for _ in range(epochs)]


def _shard_padding(remaining: int, m: int) -> int:
    """Samples an M-rank BatchSamplerShard (even_batches) adds to ``remaining`` samples; one rank adds none."""
    if m == 1:
        return 0
    return math.ceil(math.ceil(remaining / B) / m) * m * B - remaining


@pytest.mark.parametrize("n, m, k", [(2, 1, 1), (1, 2, 3), (2, 3, 1), (3, 2, 1), (2, 2, 2)])
def test_accelerate_shard_epoch_continues_on_another_world_size(n, m, k):
    saved, before = _save(_accelerate_loader, n, k)
    rest, following = _resume(_accelerate_loader, saved, m, seed=123)
    orders = _reference_orders()
    seen = Counter(i for b in before for i in b) + Counter(i for rank in rest for b in rank for i in b)
    pad = _shard_padding(L - len(before) * B, m)
    assert seen == Counter(orders[1]) + Counter(orders[1][:pad])  # one epoch + the padding an M-rank run adds
    assert all(len(b) == B for rank in rest for b in rank) or m == 1
    assert len({len(rank) for rank in rest}) == 1  # even_batches: every rank the same number of steps
    for r in range(m):  # the next epoch: an uninterrupted M-rank epoch of the same generator
        expected = accelerate_data.BatchSamplerShard(BatchSampler(orders[2], B, False), m, r) if m > 1 else BatchSampler(orders[2], B, False)
        assert following[r] == [list(b) for b in expected], r


@pytest.mark.parametrize("n, m", [(2, 1), (1, 2)])
def test_split_batches_epoch_continues_on_another_world_size(n, m):
    """split_batches: each batch of B is cut in N slices; the rest goes out in batches of B cut in M."""
    def make(world, r, seed=7):
        loader = DataLoader(DATASET, batch_size=B, shuffle=True, generator=torch.Generator().manual_seed(seed))
        prepared = accelerate_data.prepare_data_loader(loader, num_processes=world, process_index=r, put_on_device=False, split_batches=True)
        tracking.track(prepared)
        return prepared

    saved, before = _save(make, n, 2)
    rest, _ = _resume(make, saved, m, seed=1)
    order = _reference_orders()[1]
    consumed = len(before) * len(before[0])
    assert consumed == 2 * B  # two steps of one batch of B, whatever N
    remaining = L - consumed  # 22: 5 full batches and one of 2, padded to B from the epoch's first batch when M > 1
    pad = (-remaining) % B if m > 1 else 0
    seen = Counter(i for b in before for i in b) + Counter(i for rank in rest for b in rank for i in b)
    assert seen == Counter(order) + Counter(order[:pad])
    assert {len(b) for rank in rest for b in rank[:-1]} == {B // m}


def test_checkpoint_without_layout_refuses_another_world_size():
    saved, _ = _save(_accelerate_loader, 2, 1)
    old = [{k: v for k, v in s.items() if k != "layout"} for s in saved]  # as an older statekit saved it
    with pytest.raises(statekit.StateMismatchError, match=r"'dataloader_0' was saved mid-epoch with world size 2 and is resumed with 1: the checkpoint has no data layout"):
        data.restore_loader(_accelerate_loader(1, 0), old[0], name="dataloader_0", ranks=old)


def test_uneven_batches_without_padding():
    saved, before = _save(lambda n, r: _accelerate_loader(n, r, even_batches=False), 2, 1)
    rest, _ = _resume(lambda m, r, seed: _accelerate_loader(m, r, seed, even_batches=False), saved, 3, seed=5)
    seen = Counter(i for b in before for i in b) + Counter(i for rank in rest for b in rank for i in b)
    assert seen == Counter(range(L))  # no padding at all
    assert [len(rank) for rank in rest] == [2, 2, 2]  # 22 samples: 6 batches, the last one short


@pytest.mark.parametrize("n, m", [(2, 1), (1, 2), (2, 3)])
def test_distributed_sampler_epoch_continues_on_another_world_size(n, m):
    saved, before = _save(_torch_loader, n, 2)
    rest, following = _resume(_torch_loader, saved, m, seed=3)
    g = torch.Generator().manual_seed(3 + 1)
    order = torch.randperm(L, generator=g).tolist()
    remaining = L - len(before) * B
    pad = math.ceil(remaining / m) * m - remaining  # DistributedSampler pads to a multiple of M, from the epoch's start
    seen = Counter(i for b in before for i in b) + Counter(i for rank in rest for b in rank for i in b)
    assert seen == Counter(order) + Counter(order[:pad])
    for r in range(m):
        sampler = DistributedSampler(DATASET, m, r, shuffle=True, seed=3)
        sampler.set_epoch(2)
        assert following[r] == list(BatchSampler(sampler, B, False))


def test_chained_resumes_2_to_3_to_1_see_every_sample_once():
    saved, before = _save(_accelerate_loader, 2, 1)  # 8 samples
    middle = [_accelerate_loader(3, r, seed=11) for r in range(3)]
    seen, running = [i for b in before for i in b], []
    for r, loader in enumerate(middle):
        data.restore_loader(loader, saved[r] if r < 2 else None, name="dataloader_0", ranks=saved)
        running.append(iter(loader))  # alive until the save, as a training loop's iterator is
        seen += _ids(next(running[-1]))  # one step on 3 ranks: 12 more samples
    again = [data.loader_state(loader) for loader in middle]
    assert all("history" in s for s in again)
    last = _accelerate_loader(1, 0, seed=99)
    data.restore_loader(last, again[0], name="dataloader_0", ranks=again)
    tail = [i for b in last for i in _ids(b)]
    assert Counter(seen + tail) == Counter(range(L))
    assert tail == [i for i in _reference_orders()[1] if i not in seen]  # the rest, in the epoch's order


def test_same_world_size_keeps_the_skip_path():
    saved, _ = _save(_accelerate_loader, 2, 1)
    assert elastic.plan(saved, saved[0], saved[0]["layout"], "dataloader_0") is None
    assert saved[0]["layout"]["kind"] == "shard" and saved[0]["layout"]["world_size"] == 2


# --- refusals ---


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(L))


class _Buckets(BatchSampler):
    def __iter__(self):
        yield from ([i, i + 1] for i in range(0, L, 2))


def _saved_position(loader, batches: int = 2) -> dict:
    return {"tracked": True, "epoch": 0, "batches": batches, "start_states": {},
            "layout": elastic.describe(loader, samplers.inner_loader(loader), samplers.sampler_of(loader))}


def test_iterable_dataset_refuses_another_world_size():
    saved = [_saved_position(DataLoader(_Stream(), batch_size=B)) for _ in range(2)]
    saved = [{**s, "layout": {**s["layout"], "world_size": 2}} for s in saved]  # as two torchrun ranks save it
    live = DataLoader(_Stream(), batch_size=B)
    with pytest.raises(statekit.StateMismatchError, match=r"'dataloader_0' was saved mid-epoch with world size 2 and is resumed with .*IterableDataset \(_Stream\)"):
        data.restore_loader(live, None, name="dataloader_0", ranks=saved)


def test_custom_batch_sampler_refuses_another_world_size():
    saved, _ = _save(_accelerate_loader, 2, 1)
    live = DataLoader(DATASET, batch_sampler=_Buckets(range(L), 2, False))
    with pytest.raises(statekit.StateMismatchError, match=r"custom batch sampler _Buckets: its batches cannot be re-formed"):
        data.restore_loader(live, saved[0], name="dataloader_0", ranks=saved)


def test_sampler_without_generator_resumes_on_another_world_size():
    """A RandomSampler without a generator seeds a generator of its own from the global one
    each epoch; statekit records that generator's state, so a sharded sampler (which has a
    generator) of another world size draws the same permutation."""
    torch.manual_seed(0)
    loader = DataLoader(DATASET, batch_size=B, shuffle=True)  # RandomSampler drawing its seed from the global RNG
    tracking.track(loader)
    it = iter(loader)
    first = _ids(next(it))
    saved = [data.loader_state(loader)]
    assert "sampler" in saved[0]["start_states"]
    rest = [i for b in it for i in _ids(b)]
    live = [_accelerate_loader(2, r, seed=123) for r in range(2)]
    for r, shard in enumerate(live):
        data.restore_loader(shard, saved[0] if r == 0 else None, name="dataloader_0", ranks=saved)
    resumed = [i for shard in live for b in shard for i in _ids(b)]
    # every sample the interrupted epoch had left, once, plus the padding a 2-rank epoch adds
    assert Counter(rest) <= Counter(resumed) and len(resumed) == len(rest) + _shard_padding(len(rest), 2)


def test_sampler_kind_change_refuses():
    saved, _ = _save(_torch_loader, 2, 1)
    with pytest.raises(statekit.StateMismatchError, match=r"sampler DistributedSampler -> RandomSampler"):
        data.restore_loader(_accelerate_loader(1, 0), saved[0], name="dataloader_0", ranks=saved)
