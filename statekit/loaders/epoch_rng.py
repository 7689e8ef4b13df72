"""The global random draws that start an epoch: recorded when it starts, replayed on resume.

A ``DataLoader`` without a ``generator`` draws its workers' base seed from the global torch
generator when an iterator is built (``_BaseDataLoaderIter.__init__``), and a
``RandomSampler`` without one draws its permutation seed from it when the first batch's
indices are asked for; a custom sampler may draw from Python's or NumPy's global generator
in its ``__iter__``. So the order of an epoch is fixed by the global random states *at the
epoch start*, which a checkpoint saved mid-epoch no longer holds (statekit-rng saves the
states at save time).

statekit does not give loaders generators of their own for this (that would change the
data order of a run the moment statekit is attached, against a run without it). Instead
:mod:`statekit.loaders.tracking` snapshots the global states (:func:`statekit.devices.snapshot_random_states`)
right before each epoch's iterator is built, and saves them with the position. A resume
replays the epoch start (:func:`replay`): it sets those states back, lets the iterator and
the sampler make the draws they made in the saved run, and puts back the states the
checkpoint restored right after the sampler handed over the first batch's indices, before
anything is fetched: the iterator takes ``iter(batch_sampler)`` before it draws the base
seed, and the sampler draws when it is first asked (:class:`ReplayEpochStart`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from statekit.devices import restore_random_states, snapshot_random_states
from statekit.loaders.samplers import BatchSamplerWrapper


class ReplayEpochStart(BatchSamplerWrapper):
    """The outermost batch sampler (or sampler) wrapper of a resumed epoch's first iterator.

    ``iter()`` of it keeps the global random states found then in ``position.resume_rng``
    and sets the saved epoch start's; torch's iterator calls it before it draws the base
    seed, so that draw is replayed too. :class:`SettleAfterFirst`, the innermost wrapper,
    puts the kept states back as soon as the sampler handed over the first batch.

    Args:
        wrapped: the wrapped batch sampler.
        start: the global states at the saved epoch's start (:func:`~statekit.devices.snapshot_random_states`).
        position: the loader's ``Position``.
        at_first_batch: set the states when the first batch is asked for, not at ``iter()``,
            and put back those found at ``iter()``: the saved epoch ran on an iterator built
            before it (``statekit.loaders.tracking._prebuilt``, or persistent workers started in
            an earlier epoch), which drew no base seed at the recorded start; the iterator
            built now draws one between ``iter()`` and the first batch, and that draw must
            not shift the replay or the run after it.
    """

    def __init__(self, wrapped: Any, start: dict[str, Any], position: Any, at_first_batch: bool = False) -> None:
        super().__init__(wrapped)
        self.start = start
        self.position = position
        self.used = False
        self.at_first_batch = at_first_batch
        self.kept: dict[str, Any] | None = None

    def __iter__(self) -> Iterator[Any]:
        # once: torch's multi-process iterator calls iter() twice while it is built (its
        # __init__ and _reset), and an iterator with persistent workers keeps this object as
        # its index sampler for every later epoch, which must not go back to this epoch's start
        if self.used:
            return iter(self.batch_sampler)
        if self.at_first_batch:
            # the states to put back are those found now, before the iterator draws its base
            # seed (a draw the saved epoch did not make); the epoch start's are set when the
            # first batch is asked for, by whichever iterator asks (the first built may be dropped)
            if self.kept is None:
                self.kept = snapshot_random_states()
            return self._start_at_first_batch(iter(self.batch_sampler))
        self._start(snapshot_random_states())
        return iter(self.batch_sampler)

    def _start(self, kept: dict[str, Any]) -> None:
        self.used = True
        self.position.resume_rng = kept
        restore_random_states(self.start)

    def _start_at_first_batch(self, items: Iterator[Any]) -> Iterator[Any]:
        if not self.used:
            self._start(self.kept)
        yield from items


class SettleAfterFirst(BatchSamplerWrapper):
    """The innermost wrapper (inside the skip wrapper): once the sampler handed over the
    first batch of the resumed iterator, the global states :class:`ReplayEpochStart` kept
    are put back (:func:`settle`), before the batch is fetched."""

    def __init__(self, wrapped: Any, position: Any) -> None:
        super().__init__(wrapped)
        self.position = position

    def iterate(self, items: Iterator[Any]) -> Iterator[Any]:
        try:
            first = next(items)
        except StopIteration:
            settle(self.position)
            return
        settle(self.position)
        yield first
        yield from items


def settle(position: Any) -> None:
    """Put back the states a :class:`ReplayEpochStart` kept (once); nothing when none waits."""
    states = getattr(position, "resume_rng", None)
    if states is not None:
        position.resume_rng = None
        restore_random_states(states)


def wrapper(position: Any, start: dict[str, Any] | None, at_first_batch: bool = False) -> Any:
    """The outermost wrapper (:class:`ReplayEpochStart`) for
    :func:`statekit.loaders.samplers.wrap_batch_sampler`, or None when the saved position has
    no epoch-start states (saved by an older statekit, or at an epoch boundary, where the
    checkpoint's global states are the next epoch's start). ``at_first_batch``: see
    :class:`ReplayEpochStart`."""
    position.resume_rng = None
    if not start:
        return None
    return lambda batch_sampler: ReplayEpochStart(batch_sampler, start, position, at_first_batch)


class SeedProbe(BatchSamplerWrapper):
    """The innermost wrapper for a ``RandomSampler`` without a generator: right before the
    sampler's first draw of the epoch, work out the generator it is about to seed and keep
    its state as the epoch's ``"sampler"`` start state.

    ``RandomSampler.__iter__`` without a generator draws ``seed`` from the global torch
    generator and shuffles with ``torch.Generator().manual_seed(seed)``
    (https://github.com/pytorch/pytorch/blob/main/torch/utils/data/sampler.py). The same draw
    on a copy of the global state gives that generator without drawing anything, so a
    resume with another world size, whose sampler has a generator (Accelerate gives one
    to a sharded sampler), draws this epoch's permutation again
    (:mod:`statekit.loaders.elastic`).
    """

    def __init__(self, wrapped: Any, position: Any) -> None:
        super().__init__(wrapped)
        self.position = position

    def iterate(self, items: Iterator[Any]) -> Iterator[Any]:
        probe = torch.Generator()
        probe.set_state(torch.get_rng_state())
        seed = int(torch.empty((), dtype=torch.int64).random_(generator=probe).item())
        self.position.start_states["sampler"] = torch.Generator().manual_seed(seed).get_state()
        yield from items


def draws_seed_from_global(sampler: Any) -> bool:
    """True for a ``torch.utils.data.RandomSampler`` (or subclass) without a generator."""
    return isinstance(sampler, torch.utils.data.RandomSampler) and getattr(sampler, "generator", None) is None


def innermost(position: Any, sampler: Any, replaying: bool) -> Any:
    """The wrappers around the original batch sampler (inside the skip wrapper): the seed
    probe of a global-drawing ``RandomSampler``, and, on a replayed epoch start,
    :class:`SettleAfterFirst`; None when neither applies."""
    probe = draws_seed_from_global(sampler)
    if not probe and not replaying:
        return None

    def wrap(batch_sampler: Any) -> Any:
        if probe:
            batch_sampler = SeedProbe(batch_sampler, position)
        return SettleAfterFirst(batch_sampler, position) if replaying else batch_sampler

    return wrap
