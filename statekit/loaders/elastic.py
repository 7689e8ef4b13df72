"""Elastic data position: finish an epoch interrupted with world size N on M ranks, every
sample seen exactly once over all ranks (plus the M-rank run's end padding).

:func:`describe` saves a loader's layout; :func:`plan` computes this rank's rest of the epoch
(index arithmetic: :mod:`statekit.loaders.elastic_layouts`); :func:`install` and
:class:`PlannedBatches` map it to dataset indices. Rule and user documentation:
docs/concepts.md, "Changing the world size". Sources (checked by tests/unit/loaders/test_elastic.py):
https://github.com/huggingface/accelerate/blob/main/src/accelerate/data_loader.py and
https://github.com/pytorch/pytorch/blob/main/torch/utils/data/distributed.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import BatchSampler, DistributedSampler, IterableDataset

from statekit.loaders.iterable import is_accelerate
from statekit.loaders.elastic_layouts import (
    DISPATCH,
    DISTRIBUTED,
    SHARD,
    UNSUPPORTED,
    chunk,
    permutation,
    remaining,
    shard,
)
from statekit.errors import StateMismatchError

_SAME = ("kind", "world_size", "batch_size", "drop_last", "even_batches", "split_batches")


def describe(loader: Any, inner: Any, sampler: Any) -> dict[str, Any]:
    """The layout of a data loader (``inner``: the torch loader that builds iterators; ``sampler``:
    :func:`statekit.loaders.samplers.sampler_of`): how its sampler's permutation is split over ranks.

    Returns:
        Codec-able dict: ``kind`` (``shard``/``dispatch``/``distributed``, or ``unsupported`` with
        a ``reason``), ``world_size``, ``rank``, ``batch_size``, ``drop_last``, ``even_batches``,
        ``split_batches``, ``length`` (samples per epoch) and ``sampler`` (``kind`` ``generator``
        or ``distributed`` with its ``seed``, ``epoch``, ``shuffle``, ``drop_last``).
    """
    name = type(loader).__name__
    dataset = getattr(inner, "dataset", None)
    if isinstance(dataset, IterableDataset):
        return _unsupported(f"{name} over an IterableDataset ({type(dataset).__name__}): no sampler indexes its samples, so "
                            "the samples other ranks consumed cannot be located")
    batch_sampler = getattr(inner, "batch_sampler", None)
    if isinstance(batch_sampler, PlannedBatches):  # restored, not iterated yet
        batch_sampler = batch_sampler.original
    if is_accelerate(batch_sampler, "BatchSamplerShard"):
        layout = _layout(SHARD, batch_sampler.num_processes, batch_sampler.process_index, batch_sampler.even_batches, batch_sampler.split_batches)
        base = batch_sampler.batch_sampler
    elif is_accelerate(loader, "DataLoaderDispatcher"):
        if getattr(loader, "submesh_tp", None) is not None:
            return _unsupported(f"{name} with a tensor-parallel device mesh (torch_device_mesh): ranks share batches")
        layout = _layout(DISPATCH, loader.state.num_processes, loader.state.process_index, True, loader.split_batches)
        base = batch_sampler
    elif isinstance(sampler, DistributedSampler):
        layout = _layout(DISTRIBUTED, sampler.num_replicas, sampler.rank, True, False)
        base = batch_sampler
    else:  # one process, nothing sharded: BatchSamplerShard with one process and no padding
        layout = _layout(SHARD, 1, 0, False, False)
        base = batch_sampler
    if base is None or type(base).__iter__ is not BatchSampler.__iter__ or not isinstance(getattr(base, "batch_size", None), int):
        what = "no batch sampler (batch_size=None)" if base is None else f"the custom batch sampler {type(base).__name__}"
        return _unsupported(f"{name} with {what}: its batches cannot be re-formed for another world size")
    if sampler is None:
        return _unsupported(f"{name} has no sampler")
    if isinstance(sampler, DistributedSampler):
        if layout["kind"] != DISTRIBUTED:
            return _unsupported(f"{name}: a DistributedSampler inside an Accelerate-prepared loader (sharded twice)")
        if type(sampler).__iter__ is not DistributedSampler.__iter__:
            return _unsupported(f"{name}: {type(sampler).__name__} overrides DistributedSampler.__iter__")
        info = {"kind": DISTRIBUTED, "seed": int(sampler.seed), "epoch": int(sampler.epoch), "shuffle": bool(sampler.shuffle), "drop_last": bool(sampler.drop_last)}
        length = len(sampler.dataset)
    else:
        info = {"kind": "generator", "random": hasattr(sampler, "generator")}
        length = len(sampler)
    info["class"] = type(sampler).__name__
    return {**layout, "batch_size": int(base.batch_size), "drop_last": bool(base.drop_last), "length": int(length), "sampler": info}


def _layout(kind: str, world_size: int, rank: int, even: bool, split: bool) -> dict[str, Any]:
    return {"kind": kind, "world_size": int(world_size), "rank": int(rank), "even_batches": bool(even), "split_batches": bool(split)}


def _unsupported(reason: str) -> dict[str, Any]:
    """A layout this module cannot map; its world size is the process group's."""
    dist = torch.distributed.is_available() and torch.distributed.is_initialized()
    world, rank = (torch.distributed.get_world_size(), torch.distributed.get_rank()) if dist else (1, 0)
    return {"kind": UNSUPPORTED, "reason": reason, "world_size": world, "rank": rank}



@dataclass
class Plan:
    """This rank's rest of an interrupted epoch.

    Attributes:
        epoch: the interrupted epoch (epochs completed before it).
        start_states: generator role -> epoch-start state to restore before iterating.
        batches: the positions the live batch sampler yields, by batch (``dispatch``: rank 0's base batches).
        steps: batches this rank yields to the training loop.
        source: the epoch's sampler info (how ``P`` is drawn), from the first segment.
        length: ``L``, samples in the epoch.
        segments: the layouts and per-rank consumed batches so far (saved while the epoch lasts).
    """

    epoch: int
    start_states: dict[str, Any]
    batches: list[list[int]]
    steps: int
    source: dict[str, Any]
    length: int
    segments: list[dict[str, Any]] = field(default_factory=list)


def plan(saved: list[dict[str, Any]], own: dict[str, Any] | None, live: dict[str, Any], name: str) -> Plan | None:
    """Plan the rest of an interrupted epoch from ``saved`` (:func:`statekit.loaders.data.loader_state`
    of each saved rank, index = rank), ``own`` (this rank's, None when the world grew) and ``live``
    (:func:`describe`); ``name`` is the loader's key in messages.

    Returns:
        The plan, or None when the saved positions resume as they are (same layout, no epoch in
        progress, or independent per-rank loaders).

    Raises:
        StateMismatchError: the epoch is in progress and cannot be mapped (an unsupported loader,
            another sampler kind or dataset length, no saved generator, ranks that disagree).
    """
    if not saved or not all(s.get("tracked") for s in saved):
        return None
    epoch = min(int(s["epoch"]) for s in saved)
    history = next((s["history"] for s in saved if s.get("history") and int(s["epoch"]) == epoch), [])
    if not _needs_plan(saved, live, name, history):
        return None
    layout = saved[0]["layout"]
    _check(saved, layout, live, name, epoch)
    return _planned(saved, own, live, epoch, history, layout)


def _needs_plan(saved: list[dict[str, Any]], live: dict[str, Any], name: str, history: list[dict[str, Any]]) -> bool:
    """Whether the saved positions must be mapped onto the live layout (:func:`plan`'s Returns).

    Raises:
        StateMismatchError: a mid-epoch checkpoint without a data layout, resumed with another world size.
    """
    if not history and all(int(s["batches"]) == 0 for s in saved):
        return False  # every rank at an epoch start: nothing to map
    layout = saved[0].get("layout")
    if layout is None:
        if len(saved) != live.get("world_size"):
            raise _refuse(name, len(saved), live, "the checkpoint has no data layout (saved by an older statekit)")
        return False
    if not history and all(layout.get(k) == live.get(k) for k in _SAME) and (layout["kind"] != DISPATCH or len(saved) == 1):
        return False  # same layout: skipping the consumed batches is exact
    if layout["world_size"] != len(saved):
        return False  # one loader per rank, not shards of one epoch: each rank resumes its own
    if layout["kind"] != UNSUPPORTED and live["kind"] != UNSUPPORTED and layout["length"] != live["length"]:
        return False  # another dataset: nothing maps; the epoch restarts (statekit.loaders.data.restore_loader)
    return True


def _planned(
    saved: list[dict[str, Any]], own: dict[str, Any] | None, live: dict[str, Any], epoch: int, history: list[dict[str, Any]],
    layout: dict[str, Any],
) -> Plan:
    """This rank's plan: the epoch's samples no world size consumed yet (earlier segments
    and the saved ranks' counts), sharded over the live layout."""
    counts = [int(s["batches"]) if int(s["epoch"]) == epoch else -1 for s in saved]  # -1: the rank finished the epoch
    segments = [*history, {"layout": layout, "batches": counts}]
    length = int(layout["length"])
    left = remaining(length, segments)
    per_rank = shard(left, live, list(range(length)))
    rank = int(live["rank"])
    base = own if own is not None and int(own["epoch"]) == epoch else next(s for s in saved if int(s["epoch"]) == epoch)
    batches = chunk(left, live["batch_size"], live["drop_last"]) if live["kind"] == DISPATCH else per_rank[rank]
    source = (segments[0]["layout"])["sampler"]
    return Plan(epoch, dict(base.get("start_states") or {}), batches, len(per_rank[rank]), source, length, segments)


def _check(saved: list[dict[str, Any]], layout: dict[str, Any], live: dict[str, Any], name: str, epoch: int) -> None:
    for what in (layout, live):
        if what["kind"] == UNSUPPORTED:
            raise _refuse(name, len(saved), live, what["reason"])
    _check_saved_ranks(saved, layout, live, name, epoch)
    _check_sampler(saved, layout, live, name)


def _check_saved_ranks(saved: list[dict[str, Any]], layout: dict[str, Any], live: dict[str, Any], name: str,
                       epoch: int) -> None:
    """The saved ranks agree: one epoch (or its end) and one data layout."""
    for s in saved:
        if int(s["epoch"]) > epoch + 1 or (int(s["epoch"]) == epoch + 1 and int(s["batches"]) != 0):
            raise _refuse(name, len(saved), live, f"the saved ranks are in different epochs ({[int(x['epoch']) for x in saved]})")
        if {k: (s.get("layout") or {}).get(k) for k in _SAME} != {k: layout.get(k) for k in _SAME}:
            raise _refuse(name, len(saved), live, "the saved ranks have different data layouts")


def _check_sampler(saved: list[dict[str, Any]], layout: dict[str, Any], live: dict[str, Any], name: str) -> None:
    """The live sampler can draw the interrupted epoch's permutation, and the batches split."""
    if layout["sampler"]["kind"] != live["sampler"]["kind"]:
        raise _refuse(
            name, len(saved), live, f"sampler {layout['sampler']['class']} -> {live['sampler']['class']}: the permutation "
            "of the interrupted epoch cannot be drawn by the live sampler",
        )
    if layout["sampler"].get("random") and not any("sampler" in (s.get("start_states") or {}) for s in saved):
        raise _refuse(
            name, len(saved), live, f"the {layout['sampler']['class']} has no generator: its permutation came from the global "
            "RNG and cannot be drawn again by a sampler of another world size (give it one: RandomSampler(..., generator=torch.Generator()))",
        )
    if live["split_batches"] and live["batch_size"] % live["world_size"]:
        raise _refuse(name, len(saved), live, f"split_batches with batch size {live['batch_size']} on {live['world_size']} ranks")


def _refuse(name: str, saved_world: int, live: dict[str, Any], reason: str) -> StateMismatchError:
    error = StateMismatchError(f"data loader {name!r}")
    error.args = (
        f"data loader {name!r} was saved mid-epoch with world size {saved_world} and is resumed with "
        f"{live.get('world_size', '?')}: {reason}; the rest of the epoch cannot be planned without skipping or "
        "repeating samples (resume with the saved world size, or from a checkpoint taken at an epoch end)",
    )
    return error


def install(loader: Any, inner: Any, planned: Plan, sampler: Any) -> None:
    """Make the loader's next epoch (only) yield ``planned``'s batches: ``inner``'s
    ``batch_sampler`` becomes a :class:`PlannedBatches` drawing from ``sampler``, and ``loader`` keeps
    the plan (``__dict__["_statekit_elastic"]``) for :func:`saved_fields`."""
    loader.__dict__["_statekit_elastic"] = planned
    original = inner.__dict__.get("batch_sampler")
    if isinstance(original, PlannedBatches):  # restored twice before iterating
        original = original.original
    object.__setattr__(inner, "batch_sampler", PlannedBatches(original, planned, sampler, inner))


def saved_fields(loader: Any, layout: dict[str, Any], epoch: int, in_epoch: bool) -> dict[str, Any]:
    """What a loader's saved position adds for another world size: ``{"layout": layout}`` and,
    while an epoch planned by :func:`plan` lasts (``epoch``, ``in_epoch``), ``"history"``: what
    earlier world sizes consumed of it."""
    planned = loader.__dict__.get("_statekit_elastic")
    if planned is not None and in_epoch and planned.epoch == epoch:
        return {"layout": layout, "history": planned.segments}
    return {"layout": layout}


class PlannedBatches:
    """A batch sampler that yields a :class:`Plan`'s batches as dataset indices, once: the first
    iterator asked for a batch takes the plan (torch's multi-process iterator calls ``iter()``
    twice), later ones yield the original's; the permutation is drawn from ``sampler`` at the
    first batch. Other attributes are the original's.
    """

    def __init__(self, original: Any, planned: Plan, sampler: Any, owner: Any) -> None:
        self.original, self.planned, self.draw_from, self.owner = original, planned, sampler, owner
        self.used = False  # an iterator started drawing the plan's batches
        self.spent = False  # ... and ended (or was closed): len() is the original's again

    def __iter__(self) -> Iterator[list[int]]:
        object.__setattr__(self.owner, "batch_sampler", self.original)
        if self.used:  # the plan went to an earlier iterator
            return iter(self.original)
        return self._batches()

    def _batches(self) -> Iterator[list[int]]:
        if self.used:  # taken before the plan was drawn from, asked for a batch after: the plan is another's
            yield from self.original
            return
        self.used = True
        try:
            order = permutation(self.planned.source, self.draw_from, self.planned.length)
            for batch in self.planned.batches:
                yield [order[p] for p in batch]
        finally:
            self.spent = True

    def __len__(self) -> int:
        """Batches of the plan until its epoch ended, then the original's."""
        return len(self.original) if self.spent else len(self.planned.batches)

    def __getattr__(self, name: str) -> Any:
        if name in ("original", "planned", "draw_from", "owner", "used", "spent"):
            raise AttributeError(name)
        return getattr(self.original, name)
