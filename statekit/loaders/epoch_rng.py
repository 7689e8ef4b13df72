"""The global random draws that start an epoch: recorded when it starts, replayed on resume.

A loader or ``RandomSampler`` without a generator draws the epoch's seeds from the global
generators, so the epoch's order is fixed by the global states at its start.
:mod:`statekit.loaders.tracking` snapshots them before each epoch's iterator is built; a
resume sets them back, lets the sampler draw, then puts the checkpoint's states back before
the first fetch (:class:`ReplayEpochStart`, :class:`SettleAfterFirst`).
Why: docs/design-notes.md, "Data loaders" (no generators of statekit's own).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from statekit.devices import restore_random_states, snapshot_random_states
from statekit.loaders.samplers import BatchSamplerWrapper


class ReplayEpochStart(BatchSamplerWrapper):
    """The outermost wrapper of a resumed epoch's first iterator: ``iter()`` of it keeps the live
    global states in ``position.resume_rng`` and sets the saved epoch start's (before torch
    draws the base seed).

    Args:
        wrapped: the wrapped batch sampler.
        start: the global states at the saved epoch's start (:func:`~statekit.devices.snapshot_random_states`).
        position: the loader's ``Position``.
        at_first_batch: set the states at the first batch instead, and put back those found at
            ``iter()``: the saved epoch ran on an iterator built before it (prebuilt, or
            persistent workers), whose base seed was not drawn at the recorded start.
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
    """The innermost wrapper for a ``RandomSampler`` without a generator: before its first draw,
    work out the generator it is about to seed (the same draw on a copy of the global state,
    https://github.com/pytorch/pytorch/blob/main/torch/utils/data/sampler.py) and keep its
    state as the epoch's ``"sampler"`` start state (for :mod:`statekit.loaders.elastic`).
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
