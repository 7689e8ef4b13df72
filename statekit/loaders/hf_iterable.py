"""What a Hugging Face ``datasets.IterableDataset``'s own state can and cannot restore.

A ``datasets.IterableDataset`` follows torchdata's Stateful protocol in name, with three
differences that decide how :mod:`statekit.loaders.iterable` resumes it
(``datasets/iterable_dataset.py``, ``IterableDataset.state_dict``/``load_state_dict``/
``_prepare_ex_iterable_for_iteration``, datasets 3.0 to 5.x):

- ``load_state_dict(state)`` only stores ``state`` (``_starting_state_dict``); *every* later
  ``__iter__`` applies it again while ``dataset.epoch == state["epoch"]``. Without a
  ``set_epoch`` call between epochs (a plain loop), each epoch after a resume would start at
  the saved position. statekit forgets the state it loaded once the resumed epoch's
  iterator started (:func:`forget_loaded`), as torchdata's protocol has it (a state applies
  to the next ``iter()`` only).
- ``state_dict()`` between epochs is where the last epoch *ended*, not where the next one
  starts: every ``__iter__`` starts its epoch afresh (the order depends on ``set_epoch``
  only). So the epoch-start state of such a dataset is "nothing loaded"
  (:func:`epoch_start_state` is None).
- The state does not hold a shuffle buffer's content (``.shuffle(seed, buffer_size)``:
  ``BufferShuffledExamplesIterable``; datasets logs "examples from shuffle buffers are
  lost" through its own logger): :func:`inexact_state` names it, and the resume re-reads
  the epoch's stream from its start instead (exact; the cost is the re-read).

``datasets`` is never imported here: its classes are recognised by module and name.
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
        examples, which datasets documents "may skip one batch"), or None.
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
    """The state that restarts ``dataset``'s current epoch, or None when a fresh ``iter()``
    does (a ``datasets.IterableDataset``: see the module docstring).

    Args:
        dataset: a dataset with ``state_dict()`` (torchdata's Stateful protocol).
    """
    if is_hf_iterable(dataset):
        return None
    return copy.deepcopy(dataset.state_dict())


def forget_loaded(dataset: Any, loaded: Any) -> None:
    """Drop a state statekit loaded into a ``datasets.IterableDataset`` once the epoch it
    positions has started, so the next epochs start afresh (``datasets`` would apply it to
    every later ``iter()`` of the same ``epoch``). A state someone else loaded is kept.

    Args:
        dataset: the dataset (anything: only a ``datasets.IterableDataset`` keeps states).
        loaded: the object statekit passed to ``load_state_dict`` (compared by identity).
    """
    if loaded is not None and is_hf_iterable(dataset) and getattr(dataset, "_starting_state_dict", None) is loaded:
        dataset._starting_state_dict = None
