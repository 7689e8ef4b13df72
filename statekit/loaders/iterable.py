"""Data position of iterable datasets and of loaders with worker processes, where skipping
indices is not exact. :func:`plan` picks how a restored loader's next iterator continues:
``"dataset"`` (a Stateful iterable dataset's state after the consumed batches, torchdata's
protocol: https://github.com/pytorch/data/blob/main/torchdata/stateful_dataloader/README.md),
``"indices"`` (map-style without workers) or ``"consume"`` (re-read and discard under
:func:`statekit.devices.rng_guard`). What each covers: docs/concepts.md, "Iterable datasets
and workers".
"""

from __future__ import annotations

import copy
import itertools
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from statekit.devices import restore_random_states, rng_guard
from statekit.loaders import hf_iterable
from statekit.loaders.samplers import BatchSamplerWrapper
from statekit.errors import StatekitWarning

DATASET, INDICES, CONSUME = "dataset", "indices", "consume"
"""How a restored loader skips its consumed batches (see the module docstring)."""


def is_stateful(dataset: Any) -> bool:
    """True if ``dataset`` follows torchdata's Stateful protocol (callable ``state_dict``
    and ``load_state_dict``)."""
    return callable(getattr(dataset, "state_dict", None)) and callable(getattr(dataset, "load_state_dict", None))


def stateful_dataset(inner: Any) -> Any:
    """The Stateful dataset behind the torch loader ``inner`` (its dataset, or the one inside
    Accelerate's ``IterableDatasetShard``), or None.
    """
    dataset = getattr(inner, "dataset", None)
    if is_stateful(dataset):
        return dataset
    wrapped = getattr(dataset, "dataset", None) if _is_shard(dataset) else None
    return wrapped if is_stateful(wrapped) else None


def _is_shard(dataset: Any) -> bool:
    return is_accelerate(dataset, "IterableDatasetShard")


def is_accelerate(obj: Any, name: str) -> bool:
    """True if ``obj`` is an instance of Accelerate's class ``name`` (or a subclass),
    found by name so Accelerate need not be imported."""
    return any(c.__name__ == name and c.__module__.startswith("accelerate") for c in type(obj).__mro__)


def is_iterable(inner: Any) -> bool:
    """True if the torch loader ``inner`` reads a ``torch.utils.data.IterableDataset``."""
    return isinstance(getattr(inner, "dataset", None), torch.utils.data.IterableDataset)


def num_workers(inner: Any) -> int:
    """``inner.num_workers`` (0 when the loader has none)."""
    return int(getattr(inner, "num_workers", 0) or 0)


def _dispatches(loader: Any) -> bool:
    """True for an Accelerate ``DataLoaderDispatcher`` over more than one process: rank 0
    reads for all ranks, so every rank must skip the same way (collectives)."""
    return is_accelerate(loader, "DataLoaderDispatcher") and int(getattr(getattr(loader, "state", None), "num_processes", 1)) > 1


def records_dataset(loader: Any, inner: Any) -> bool:
    """True if the dataset's state after each batch is recorded (the ``"dataset"`` resume)."""
    return (
        is_iterable(inner)
        and is_stateful(inner.dataset)
        and hf_iterable.inexact_state(inner.dataset) is None
        and num_workers(inner) == 0
        and getattr(inner, "batch_sampler", None) is not None
        and not _dispatches(loader)
    )


def plan(
    loader: Any, inner: Any, position: Any, pending: dict[str, Any] | None, skip: int, name: str, prebuilt: bool = False
) -> str | None:
    """Prepare the dataset for the epoch the next iterator starts and say how to skip: load a
    saved Stateful dataset state, snapshot the epoch-start state, note ``position.workers_epoch``,
    warn about what keeps the resume from being exact.

    Args:
        loader: the tracked loader.
        inner: the torch loader that builds iterators.
        position: the loader's :class:`statekit.loaders.tracking.Position`.
        pending: the restored position, or None for an epoch that is not a resume.
        skip: batches of this epoch consumed before the checkpoint.
        name: the loader's name in messages.
        prebuilt: the epoch runs on an iterator built before it: a dataset state cannot
            position it (``"consume"``).

    Returns:
        ``"dataset"``, ``"indices"`` or ``"consume"`` when ``skip > 0``, else None.
    """
    dataset = stateful_dataset(inner)
    how = None
    position.dataset_loaded = None
    if pending is not None:
        _warn_workers(inner, pending, name)
        if skip:
            how = _method(loader, inner, pending)
            if prebuilt and how == DATASET:
                how = CONSUME
        saved = pending.get("dataset_after" if how == DATASET else "dataset_start")
        if saved is not None and dataset is not None:
            position.dataset_loaded = copy.deepcopy(saved)
            dataset.load_state_dict(position.dataset_loaded)
    if how == DATASET:
        position.dataset_start = pending.get("dataset_start")
    else:
        position.dataset_start = hf_iterable.epoch_start_state(dataset) if dataset is not None else None
    position.dataset_log = {}
    if num_workers(inner) > 0 and getattr(inner, "persistent_workers", False) and getattr(inner, "_iterator", None) is None:
        position.workers_epoch = position.epoch
    return how


def _method(loader: Any, inner: Any, pending: dict[str, Any]) -> str:
    if records_dataset(loader, inner) and pending.get("dataset_after") is not None:
        return DATASET
    if not is_iterable(inner) and num_workers(inner) == 0 and getattr(inner, "batch_sampler", None) is not None:
        return INDICES
    return CONSUME


def _warn_workers(inner: Any, pending: dict[str, Any], name: str) -> None:
    workers = num_workers(inner)
    started = pending.get("workers_epoch")
    if workers and getattr(inner, "persistent_workers", False) and started is not None and started != pending["epoch"]:
        warnings.warn(
            f"{name}: persistent_workers=True with num_workers={workers}: the saved run started its workers in "
            f"epoch {started}, this run starts them in epoch {pending['epoch']}; random draws inside the workers "
            "(augmentations in __getitem__/__iter__) carry over from earlier epochs in the saved run and cannot be "
            "restored, so the resumed batches are exact only if the dataset draws no random numbers in its workers",
            StatekitWarning,
            stacklevel=4,
        )
    if workers and getattr(inner, "in_order", True) is False:
        warnings.warn(
            f"{name}: in_order=False with num_workers={workers}: batches arrive in the order the workers finish "
            "them, so the batches after the resume are not those the saved run would have seen",
            StatekitWarning,
            stacklevel=4,
        )


def recorder(loader: Any, inner: Any, position: Any, first: int) -> Any:
    """A wrapper for ``inner``'s batch sampler that records the dataset's state after each batch
    into ``position.dataset_log``, or None (:func:`records_dataset`). ``first``: batches of the
    epoch fetched before the iterator starts.
    """
    if not records_dataset(loader, inner):
        return None
    position.dataset_fetched = first
    return lambda batch_sampler: _RecordDatasetState(batch_sampler, inner.dataset, position, first)


class _RecordDatasetState(BatchSamplerWrapper):
    """A batch sampler that records ``dataset.state_dict()`` before yielding each batch,
    and counts the batches asked for in ``position.dataset_fetched``."""

    def __init__(self, batch_sampler: Any, dataset: Any, position: Any, first: int) -> None:
        super().__init__(batch_sampler)
        self.dataset = dataset
        self.position = position
        self.first = first

    def iterate(self, items: Iterator[Any]) -> Iterator[Any]:
        for fetched, indices in enumerate(items, start=self.first):
            self.position.dataset_log[fetched] = copy.deepcopy(self.dataset.state_dict())
            self.position.dataset_fetched = fetched + 1
            yield indices


def forget_before(position: Any, batches: int) -> None:
    """Drop recorded dataset states before ``batches`` (no checkpoint can need them)."""
    for fetched in [k for k in position.dataset_log if k < batches]:
        del position.dataset_log[fetched]


def consume(iterator: Iterator[Any], count: int, epoch: int, name: str, inner: Any, after: dict[str, Any] | None = None) -> int:
    """Read and discard the first ``count`` batches of a re-created epoch ``iterator`` (the loader
    the training loop iterates); ``after``: the global random states to put back afterwards (None:
    those on entry). Returns the batches discarded (fewer if the iterator ended first).

    Warns:
        StatekitWarning: always, with the count, the seconds and why; when the iterator ends
            first, that the dataset's order is not reproducible."""
    started = time.perf_counter()
    with rng_guard():
        done = sum(1 for _ in itertools.islice(iterator, count))
    if after is not None:
        restore_random_states(after)
    seconds = time.perf_counter() - started
    if done < count:
        warnings.warn(
            f"{name}: the re-created iterator of epoch {epoch} ended after {done} of the {count} batches consumed "
            "before the checkpoint: the dataset does not repeat its order (give it state_dict()/load_state_dict(), "
            "or make its iteration depend only on the loader's generators); the resumed epoch ends here",
            StatekitWarning,
            stacklevel=3,
        )
    else:
        warnings.warn(
            f"{name}: resumed epoch {epoch} at batch {count} by re-reading and discarding {count} batches "
            f"in {seconds:.2f} s ({_reason(inner)})",
            StatekitWarning,
            stacklevel=3,
        )
    return done


def _reason(inner: Any) -> str:
    workers = num_workers(inner)
    if workers:
        return f"num_workers={workers}: the workers load the consumed samples again so their random draws repeat exactly"
    if is_iterable(inner) and _is_shard(inner.dataset):
        return "Accelerate's IterableDatasetShard reads the whole stream on every rank: the dataset restarts the epoch and the slices are re-read"
    if is_iterable(inner):
        inexact = hf_iterable.inexact_state(inner.dataset)
        if inexact is not None:
            return f"the dataset's own state cannot restore its position exactly: {inexact}"
        return "the IterableDataset has no state_dict()/load_state_dict() (torchdata's Stateful protocol) to restore its position"
    return "the loader has no batch sampler whose indices could be skipped"


def saved_fields(inner: Any, position: Any, batches: int, in_epoch: bool) -> dict[str, Any]:
    """What :func:`plan` needs at the next resume for a state saved now: ``dataset_start``,
    ``dataset_after`` and ``workers_epoch``.
    """
    dataset = stateful_dataset(inner)
    fields: dict[str, Any] = {"workers_epoch": position.workers_epoch}
    if dataset is None:
        return fields
    if in_epoch:
        fields["dataset_start"] = position.dataset_start
        if batches and dataset is getattr(inner, "dataset", None):  # recorded only when read directly
            after = position.dataset_log.get(batches)
            if after is None and position.dataset_fetched == batches:  # nothing read ahead: the state now
                after = copy.deepcopy(dataset.state_dict())
            fields["dataset_after"] = after
    else:
        fields["dataset_start"] = hf_iterable.epoch_start_state(dataset)
    return fields


def started(inner: Any, position: Any) -> None:
    """The epoch's iterator started reading: a state loaded for this epoch only is forgotten."""
    if position.dataset_loaded is not None:
        dataset = stateful_dataset(inner)
        hf_iterable.forget_loaded(dataset, position.dataset_loaded)
        position.dataset_loaded = None
