"""What a tracked loader draws and holds, for the resume audit (:mod:`statekit.checks.audit`):
the indices its batch sampler hands out (:class:`IndexLog`), the batch Accelerate's
``DataLoaderShard`` fetched ahead (:func:`accelerate_next_batch`), the sampler's epoch."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from statekit.loaders.samplers import BatchSamplerWrapper


class IndexLog(BatchSamplerWrapper):
    """A batch sampler that records the indices it hands out, by fetch number in the epoch,
    in ``position.drawn`` (consumed ones are dropped by :func:`forget_before`).

    Args:
        batch_sampler: the batch sampler to wrap (skip and replay wrappers applied).
        position: the loader's ``Position``.
        first: fetch number of the first batch this iterator asks for.
        read_ahead: also ask for the next batch's indices (for loaders that do not ask ahead).
        epoch_of: returns the sampler's epoch (:func:`sampler_epoch`), read when the iterator
            takes the batch sampler, before a read-ahead can advance it.
    """

    def __init__(self, batch_sampler: Any, position: Any, first: int, read_ahead: bool, epoch_of: Any = None) -> None:
        super().__init__(batch_sampler)
        self.position = position
        self.first = first
        self.read_ahead = read_ahead
        self.epoch_of = epoch_of

    def __iter__(self) -> Iterator[Any]:
        if self.epoch_of is not None:
            self.position.sampler_epoch_start = self.epoch_of()
        return super().__iter__()

    def iterate(self, items: Iterator[Any]) -> Iterator[Any]:
        drawn: dict[int, Any] = {}
        self.position.drawn = drawn
        self.position.drawn_all = False
        fetched = self.first
        ahead: list[Any] = []
        while True:
            if ahead:
                indices = ahead.pop()
            else:
                try:
                    indices = next(items)
                except StopIteration:
                    self.position.drawn_all = True
                    return
                drawn[fetched] = indices
            if self.read_ahead:
                try:
                    ahead.append(next(items))
                    drawn[fetched + 1] = ahead[0]
                except StopIteration:
                    self.position.drawn_all = True
            fetched += 1
            yield indices


def forget_before(position: Any, batches: int) -> None:
    """Drop the indices of fetches before ``batches`` (consumed: no record needs them)."""
    for fetched in [k for k in position.drawn if k < batches]:
        del position.drawn[fetched]


def accelerate_next_batch(parent: Any, loader: Any) -> tuple[bool, Any]:
    """The batch an Accelerate ``DataLoaderShard`` fetched ahead of the one it yielded last (its
    ``__iter__``'s local ``next_batch``,
    https://github.com/huggingface/accelerate/blob/main/src/accelerate/data_loader.py).

    Returns:
        ``(True, batch)``, or ``(False, None)`` when the loader holds no next batch.
    """
    if getattr(loader, "end_of_dataloader", False):
        return False, None
    frame = getattr(parent, "gi_frame", None)
    if frame is None or type(loader).__mro__[1].__name__ != "DataLoaderShard":
        return False, None
    local = frame.f_locals
    return ("next_batch" in local), local.get("next_batch")


def sampler_epoch(loader: Any, sampler: Any) -> int | None:
    """The epoch the loader's sampler was set to (``sampler.epoch``, as
    ``DistributedSampler.set_epoch`` sets it), else Accelerate's ``iteration``, else None."""
    value = getattr(sampler, "epoch", None)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    value = loader.__dict__.get("iteration") if hasattr(loader, "__dict__") else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None
