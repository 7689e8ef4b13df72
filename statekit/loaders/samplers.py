"""What a data loader samples with: its torch loader, sampler and generators, and the
batch-sampler wrappers :mod:`statekit.loaders.tracking` replays an epoch with. The one
place statekit looks into a loader's sampling machinery.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch


def inner_loader(loader: Any) -> Any:
    """The torch ``DataLoader`` that builds iterators: Accelerate's adapters wrap one as
    ``base_dataloader`` and delegate reads to it (an attribute set on the adapter would not
    reach it)."""
    base = loader.__dict__.get("base_dataloader")
    return base if base is not None else loader


def generators(loader: Any) -> dict[str, torch.Generator]:
    """The loader's ``torch.Generator`` objects by role: ``"sampler"`` and ``"loader"``."""
    inner = inner_loader(loader)
    found: dict[str, torch.Generator] = {}
    sampler = sampler_of(inner)
    if isinstance(getattr(sampler, "generator", None), torch.Generator):
        found["sampler"] = sampler.generator
    if isinstance(getattr(inner, "generator", None), torch.Generator):
        found["loader"] = inner.generator
    return found


def sampler_of(loader: Any) -> Any:
    """The sampler that draws a data loader's indices (the one holding its generator), looked
    up as ``accelerate.data_loader.get_sampler`` does (through ``BatchSamplerShard`` and a
    ``BatchSampler`` passed as ``sampler=``).

    Args:
        loader: a ``torch.utils.data.DataLoader``, or an Accelerate ``DataLoaderShard`` /
            ``DataLoaderDispatcher``.

    Returns:
        The sampler object, or None if the loader has none.
    """
    inner = inner_loader(loader)
    batch_sampler = getattr(inner, "batch_sampler", None)
    for candidate in (
        getattr(batch_sampler, "sampler", None),
        getattr(getattr(batch_sampler, "batch_sampler", None), "sampler", None),
        getattr(inner, "sampler", None),
    ):
        if candidate is None:
            continue
        if not _is_batch_sampler(candidate):
            return candidate
        nested = getattr(candidate, "sampler", None)
        if nested is not None and not _is_batch_sampler(nested):
            return nested
    return None


def _is_batch_sampler(obj: Any) -> bool:
    return isinstance(obj, torch.utils.data.BatchSampler) or hasattr(obj, "batch_size")


def sampled_epoch_length(loader: Any) -> int | None:
    """Batches per epoch of a plain torch loader over a map-style dataset, else None
    (Accelerate's adapters read one batch ahead already; an iterable dataset's length is a
    hint)."""
    if inner_loader(loader) is not loader or getattr(loader, "batch_sampler", None) is None:
        return None
    if isinstance(getattr(loader, "dataset", None), torch.utils.data.IterableDataset):
        return None
    try:
        return len(loader)
    except TypeError:
        return None


def run_sampler_out(parent: Iterator[Any], position: Any, length: int | None) -> Iterator[Any]:
    """``parent``'s batches; before yielding the epoch's last one, ask for one more, so that
    ``RandomSampler``'s draw at exhaustion happens before a save after the last batch.
    """
    batches = iter(parent)
    for batch in batches:
        if length is not None and position.batches + 1 == length:
            ahead = list(itertools.islice(batches, 1))  # normally empty: the sampler ran out
            yield batch
            yield from ahead
            yield from batches
            return
        yield batch


def wrap_batch_sampler(inner: Any, skip: int, record: Any, innermost: Any = None) -> Any:
    """Wrap the inner loader's batch sampler so its next iterator starts ``skip`` batches
    in and/or passes through ``record`` (the composed wrappers of
    :mod:`statekit.loaders.tracking`: dataset states, random states, indices); returns a function
    that puts the original back (None if nothing was wrapped). ``innermost`` wraps the
    original itself, inside the skip wrapper (it sees the sampler's own first draw). A
    loader without automatic batching (``batch_size=None``) has its ``sampler`` wrapped
    instead (never skipped)."""
    slot = "batch_sampler"
    original = getattr(inner, "batch_sampler", None)
    if original is None and not skip:
        # no automatic batching (batch_size=None): the iterator draws from the sampler
        slot, original = "sampler", inner.__dict__.get("sampler")
    if original is None or (not skip and record is None and innermost is None):
        return None
    base = innermost(original) if innermost is not None else original
    wrapped = SkipBatches(base, skip) if skip else base
    object.__setattr__(inner, slot, record(wrapped) if record is not None else wrapped)

    def restore() -> None:
        object.__setattr__(inner, slot, original)

    return restore


class BatchSamplerWrapper:
    """Base of the batch-sampler wrappers (skip, replay, records): the wrapped one's length and
    attributes show through. ``iter(wrapper)`` calls the wrapped ``iter()`` at once (not in a
    generator), so an eagerly drawing sampler draws exactly when and as often as unwrapped.

    Args:
        batch_sampler: the wrapped batch sampler (or sampler).
    """

    def __init__(self, batch_sampler: Any) -> None:
        self.batch_sampler = batch_sampler

    def __iter__(self) -> Iterator[Any]:
        return self.iterate(iter(self.batch_sampler))

    def iterate(self, items: Iterator[Any]) -> Iterator[Any]:
        """The batches of the wrapper, from ``items`` (the wrapped sampler's iterator)."""
        return items

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __getattr__(self, name: str) -> Any:
        if name == "batch_sampler":  # not set yet (copy, unpickling): no endless recursion
            raise AttributeError(name)
        return getattr(self.batch_sampler, name)


class SkipBatches(BatchSamplerWrapper):
    """A batch sampler that drops the first ``count`` batches of another."""

    def __init__(self, batch_sampler: Any, count: int) -> None:
        super().__init__(batch_sampler)
        self.count = count

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.batch_sampler), self.count, None)

    def __len__(self) -> int:
        return max(len(self.batch_sampler) - self.count, 0)


def dataset_length(loader: Any) -> int | None:
    """``len(loader.dataset)``, or None for a dataset without a length (an iterable one)."""
    try:
        return len(loader.dataset)
    except TypeError:
        return None
