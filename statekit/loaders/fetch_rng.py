"""Random draws of batches a loader fetched ahead: replayed on resume in their first order.

With ``num_workers=0`` Accelerate's ``DataLoaderShard`` fetches batch ``k + 1`` (its random
transforms) before the step of batch ``k``; a resume fetching it again from later states would
draw other augmentations. :class:`FetchLog` keeps the states before each fetch, a save stores
those of batches fetched but not consumed (:func:`saved_states`), and the resumed iterator
sets each back before refetching. Why: docs/design-notes.md, "Data loaders".
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from statekit.devices import restore_random_states, snapshot_random_states
from statekit.loaders.samplers import BatchSamplerWrapper


class FetchLog(BatchSamplerWrapper):
    """A batch sampler that records the global random states before each fetch in
    ``position.fetch_states`` and, on a resume, sets the recorded states of batches fetched
    ahead before fetching them again.

    Args:
        batch_sampler: the batch sampler to wrap (the skip wrapper already applied).
        position: the loader's ``Position`` (``fetch_states``, ``replay_after``).
        first: fetch number of the first batch this iterator yields.
        replay: fetch number -> the states its first fetch started from (empty: none).
        settle_after: put back the states found at the first replayed fetch once the replayed
            ones are fetched (False under an RNG guard, which puts them back itself).
    """

    def __init__(
        self, batch_sampler: Any, position: Any, first: int, replay: dict[int, dict[str, Any]], settle_after: bool
    ) -> None:
        super().__init__(batch_sampler)
        self.position = position
        self.first = first
        self.replay = dict(replay)
        self.settle_after = settle_after

    def iterate(self, items: Iterator[Any]) -> Iterator[Any]:
        replay, self.replay = self.replay, {}
        for fetched, indices in enumerate(items, start=self.first):
            states = replay.pop(fetched, None)
            if states is not None:
                if self.settle_after and self.position.replay_after is None:
                    self.position.replay_after = snapshot_random_states()  # what the checkpoint restored
                restore_random_states(states)  # this batch's first fetch started here
            elif not replay:
                settle(self.position)
            self.position.fetch_states[fetched] = snapshot_random_states()
            yield indices
        settle(self.position)


def recorder(
    inner: Any, position: Any, first: int, batches: int, replay: list[dict[str, Any]] | None, settle_after: bool
) -> Any:
    """A wrapper for ``inner``'s batch sampler (:class:`FetchLog`), or None when fetches run in
    worker processes.

    Args:
        inner: the torch ``DataLoader``.
        position: its ``Position``.
        first: fetch number of the first batch the new iterator asks for.
        batches: the consumed batches of a resumed epoch; 0 otherwise.
        replay: states saved by :func:`saved_states` for this resume, or None.
        settle_after: see :class:`FetchLog`.
    """
    position.fetch_states = {}
    position.replay_after = None
    if int(getattr(inner, "num_workers", 0) or 0) > 0:
        return None
    by_fetch = {batches + i: states for i, states in enumerate(replay or ())}
    return lambda batch_sampler: FetchLog(batch_sampler, position, first, by_fetch, settle_after)


def settle(position: Any) -> None:
    """After the batches fetched ahead were fetched again: put back the states the
    checkpoint restored (once)."""
    if position.replay_after is not None:
        states, position.replay_after = position.replay_after, None
        restore_random_states(states)


def forget_before(position: Any, batches: int) -> None:
    """Drop the states of fetches before ``batches`` (consumed: no checkpoint needs them)."""
    for fetched in [k for k in position.fetch_states if k < batches]:
        del position.fetch_states[fetched]


def saved_states(position: Any, batches: int) -> list[dict[str, Any]]:
    """The states before each fetch of the batches fetched but not consumed after
    ``batches`` consumed ones, in order (empty when nothing was fetched ahead)."""
    ahead = []
    fetched = batches
    while fetched in position.fetch_states:
        ahead.append(position.fetch_states[fetched])
        fetched += 1
    return ahead
