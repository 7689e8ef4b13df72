"""Random draws of batches a loader fetched ahead: replayed on resume in their first order.

A loader that reads ahead in the training process draws the random numbers of the batches
it fetched but did not yield yet. Accelerate's ``DataLoaderShard`` fetches batch ``k + 1``
before it yields batch ``k`` (to know where the epoch ends), so with ``num_workers=0`` the
dataset's random transforms for batch ``k + 1`` (``torch.rand`` in ``__getitem__``, the
everyday augmentation) run before the training step of batch ``k``. A checkpoint saved after
that step holds global random states that already include those draws. A resume fetches
batch ``k + 1`` again, from those later states: it gets other augmentations, and every draw
after it shifts (dropout masks too), without a word.

So, while an epoch runs with ``num_workers=0``, the global random states right before each
fetch are kept (:class:`FetchLog`, a batch-sampler wrapper; states of consumed batches are
dropped). A save stores those of the batches fetched but not yet consumed
(:func:`saved_states`). The resumed iterator sets each one back right before it fetches that
batch again, and puts back the states the checkpoint restored right after the last of them
(before the next fetch, or at the first batch it yields when it does not read ahead), which is
where the interrupted run stood.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from statekit.devices import restore_random_states, snapshot_random_states
from statekit.loaders.samplers import BatchSamplerWrapper


class FetchLog(BatchSamplerWrapper):
    """A batch sampler that records the global random states before each fetch in
    ``position.fetch_states`` (by fetch number in the epoch) and, on a resume, sets the
    recorded states of batches the interrupted run had fetched ahead before fetching them
    again.

    With ``num_workers=0`` a ``DataLoader`` iterator fetches a batch right after it asks for
    its indices, so the states when the indices are handed over are the states the fetch
    starts from.

    Args:
        batch_sampler: the batch sampler to wrap (the skip wrapper already applied).
        position: the loader's ``Position`` (``fetch_states``, ``replay_after``).
        first: fetch number of the first batch this iterator yields (the consumed batches
            a resume skips are not fetched).
        replay: fetch number -> the states its first fetch started from (empty: none).
        settle_after: put back the states found at the first replayed fetch once the
            replayed ones are fetched (False when the fetches run under an RNG guard, which
            puts them back itself: the consumed batches re-read by
            :func:`statekit.loaders.iterable.consume`).
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
    """A wrapper for ``inner``'s batch sampler (:class:`FetchLog`), or None when fetches
    run in worker processes (``num_workers > 0``: they draw from the workers' own seeds,
    not from the training process's states).

    Args:
        inner: the torch ``DataLoader``.
        position: its ``Position``.
        first: fetch number of the first batch the new iterator asks for.
        batches: the consumed batches of a resumed epoch (the fetch number of the first
            replayed state); 0 otherwise.
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
