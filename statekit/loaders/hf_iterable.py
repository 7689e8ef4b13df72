"""What a Hugging Face ``datasets.IterableDataset``'s own state can and cannot restore
(datasets 3.0 to 5.x, ``datasets/iterable_dataset.py``): ``load_state_dict`` applies to every
later ``iter()`` of the same epoch (:func:`forget_loaded` drops it), ``state_dict()`` between
epochs is the last epoch's end (:func:`epoch_start_state` is None), and a shuffle buffer is
not in the state (:func:`inexact_state`; the resume re-reads the stream instead).
User documentation: docs/concepts.md, "Data stacks: what each one gets". ``datasets`` is
never imported here.
"""

from __future__ import annotations

import copy
from typing import Any

_MODULE = "datasets.iterable_dataset"


def is_hf_iterable(dataset: Any) -> bool:
    """True for a ``datasets.IterableDataset`` (found by module and class name)."""
    return any(c.__name__ == "IterableDataset" and c.__module__ == _MODULE for c in type(dataset).__mro__)


def _examples_iterables(node: Any) -> list[Any]:
    """The examples iterables a ``datasets`` examples iterable reads from (``ex_iterable``,
    ``ex_iterables``, an interleaving's shards)."""
    children: list[Any] = []
    for name in ("ex_iterable", "_interleaved"):
        child = getattr(node, name, None)
        if child is not None:
            children.append(child)
    children.extend(getattr(node, "ex_iterables", None) or [])
    return children


def inexact_state(dataset: Any) -> str | None:
    """Why ``dataset.state_dict()`` cannot restore the stream's exact position, or None.

    Args:
        dataset: any dataset; only a ``datasets.IterableDataset`` can give a reason.

    Returns:
        A phrase for messages (a shuffle buffer; a batched ``map`` over Arrow-formatted
        examples), or None.
    """
    if not is_hf_iterable(dataset):
        return None
    seen: set[int] = set()
    todo = [getattr(dataset, "_ex_iterable", None)]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        kind = type(node).__name__
        if kind == "BufferShuffledExamplesIterable":
            return (
                f"its shuffle buffer (IterableDataset.shuffle(buffer_size={getattr(node, 'buffer_size', '?')})) is not "
                "part of its state_dict(), so a loaded state would refill the buffer with other examples"
            )
        formatting = getattr(node, "formatting", None)
        if kind == "MappedExamplesIterable" and getattr(node, "batched", False) and getattr(formatting, "is_table", False):
            return "a batched map() over Arrow-formatted examples may skip one batch when its state is loaded (datasets documents this)"
        todo.extend(_examples_iterables(node))
    return None


def epoch_start_state(dataset: Any) -> Any:
    """The state that restarts ``dataset``'s current epoch, or None when a fresh ``iter()`` does.

    Args:
        dataset: a dataset with ``state_dict()`` (torchdata's Stateful protocol).
    """
    if is_hf_iterable(dataset):
        return None
    return copy.deepcopy(dataset.state_dict())


def forget_loaded(dataset: Any, loaded: Any) -> None:
    """Drop a state statekit loaded into a ``datasets.IterableDataset`` once its epoch started
    (a state someone else loaded is kept).

    Args:
        dataset: the dataset (only a ``datasets.IterableDataset`` keeps states).
        loaded: the object statekit passed to ``load_state_dict`` (compared by identity).
    """
    if loaded is not None and is_hf_iterable(dataset) and getattr(dataset, "_starting_state_dict", None) is loaded:
        dataset._starting_state_dict = None
