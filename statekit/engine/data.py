"""Data loader position: exact mid-epoch resume for plain and Accelerate-prepared loaders.

A shuffled loader fixes the order of an epoch when its iterator is built: the sampler
draws a permutation from its generator (or from the global torch RNG when it has none),
and the iterator draws ``_base_seed`` from the loader's generator. Replaying an epoch
exactly therefore needs (1) the generator states *at the start of that epoch* and (2)
how many batches of it were consumed. Redrawing the permutation (what Accelerate's
``load_state`` does with a StatefulDataLoader, accelerate#2016) resumes on other batches.

:func:`track` (called by :func:`statekit.attach` and the manager) makes a loader record
both: its class is swapped for a subclass whose ``__iter__`` snapshots the sampler and
loader generators before delegating, and counts the batches it yields. After
:func:`restore_loader`, the next ``iter(loader)`` sets the generators back to the
epoch-start states and skips the consumed batches at the index level (the batch sampler
is wrapped while the iterator is built, so skipped samples are never loaded and random
transforms draw nothing).

statekit-rng gives samplers and loaders generators of their own at attach time, so
building an iterator never draws from the global RNG (which would shift dropout masks).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from statekit.engine import elastic, fetch_rng, iterable
from statekit.engine.samplers import (
    dataset_length,
    generators,
    inner_loader as _inner,
    run_sampler_out,
    sampled_epoch_length,
    sampler_of,
    wrap_batch_sampler,
)
from statekit.errors import StatekitWarning, StateMismatchError

_CLASS_SLOT = object.__dict__["__class__"]  # assigns __class__ even where a class overrides it (Accelerate adapters)
_subclasses: dict[type, type] = {}


@dataclass
class Position:
    """Where a tracked loader is.

    Attributes:
        epoch: epochs completed before the current one.
        batches: batches of the current epoch already yielded to the training loop.
        start_states: generator role -> ``torch.Generator.get_state()`` at the epoch start.
        pending: a restored position waiting for the next ``iter()``.
        dataset_start: a Stateful dataset's ``state_dict()`` at the epoch start.
        dataset_log: a Stateful iterable dataset's state after ``n`` batches of the epoch,
            by ``n`` (:func:`statekit.engine.iterable.recorder`); ``dataset_fetched``: the
            batches of the epoch its iterator asked for so far.
        workers_epoch: the epoch in which the loader's persistent workers started.
        fetch_states: the global random states before each fetch of the epoch not consumed
            yet, by fetch number (:mod:`statekit.engine.fetch_rng`); ``replay_after``: the
            states a resume puts back once it fetched the read-ahead batches again.
        name: the loader's checkpoint key, for messages (set when it is restored).
    """

    epoch: int = 0
    batches: int = 0
    start_states: dict[str, torch.Tensor] = field(default_factory=dict)
    pending: dict[str, Any] | None = None
    in_epoch: bool = False
    foreign: bool = False
    dataset_start: Any = None
    dataset_log: dict[int, Any] = field(default_factory=dict)
    dataset_fetched: int = 0
    workers_epoch: int | None = None
    fetch_states: dict[int, Any] = field(default_factory=dict)
    replay_after: Any = None
    name: str | None = None


def is_tracked(loader: Any) -> bool:
    """True if :func:`track` was applied to the loader."""
    return "_statekit_position" in loader.__dict__


def track(loader: Any) -> Position:
    """Start recording the loader's epoch-start generator states and consumed batches.

    Args:
        loader: a ``torch.utils.data.DataLoader`` or an Accelerate ``DataLoaderShard`` /
            ``DataLoaderDispatcher``. Idempotent.

    Returns:
        The loader's :class:`Position`.
    """
    if is_tracked(loader):
        return loader.__dict__["_statekit_position"]
    real = type(loader)
    sub = _subclasses.get(real)
    if sub is None:
        sub = type(real.__name__, (real,), {"__iter__": _tracked_iter, "__module__": real.__module__})
        _subclasses[real] = sub
    position = Position(epoch=int(getattr(loader, "iteration", 0) or 0))
    loader.__dict__["_statekit_position"] = position
    _CLASS_SLOT.__set__(loader, sub)
    return position


def _tracked_iter(self: Any) -> Iterator[Any]:
    position: Position = self.__dict__["_statekit_position"]
    inner = _inner(self)
    pending, position.pending = position.pending, None
    skip = _apply_pending(self, position, pending) if pending is not None else _start_fresh(inner, position)
    name = describe(self)
    how = iterable.plan(self, inner, position, pending, skip, name)
    position.start_states = {role: gen.get_state() for role, gen in generators(self).items()}
    position.batches = skip
    position.in_epoch = True
    # before the iterator is built: it takes iter(batch_sampler) when it is built
    record = iterable.recorder(self, inner, position, first=skip if how == iterable.DATASET else 0)
    skips = how in (iterable.INDICES, iterable.DATASET)  # the consumed batches are not fetched again
    replay = (pending or {}).get("fetch_states")
    # re-read batches are fetched under an RNG guard (iterable.consume), which puts the states back itself
    log = fetch_rng.recorder(inner, position, skip if skips else 0, skip, replay, settle_after=how != iterable.CONSUME)
    if log is not None:  # outermost: its states are taken right before the fetch
        dataset_record = record
        record = log if dataset_record is None else (lambda batch_sampler: log(dataset_record(batch_sampler)))
    # the whole epoch's length, before the skip wrapper shortens the batch sampler:
    # position.batches counts from the start of the epoch (it starts at ``skip``)
    length = sampled_epoch_length(self)
    restore = wrap_batch_sampler(inner, skip if how == iterable.INDICES else 0, record)
    parent = super(type(self), self).__iter__()
    try:
        if how == iterable.CONSUME:
            iterable.consume(parent, skip, position.epoch, name, inner)
        for batch in run_sampler_out(parent, position, length):
            if restore is not None:
                restore()
                restore = None
            position.batches += 1
            iterable.forget_before(position, position.batches)
            fetch_rng.forget_before(position, position.batches)
            fetch_rng.settle(position)  # a loader that does not read ahead: the restored states now
            yield batch
    finally:
        if restore is not None:
            restore()
    position.in_epoch = False
    position.foreign = False
    position.epoch += 1
    position.batches = 0


def _apply_pending(loader: Any, position: Position, pending: dict[str, Any]) -> int:
    """Set the generators and the epoch counters to a restored position; returns the
    batches of that epoch to skip."""
    for role, gen in generators(loader).items():
        state = pending.get("start_states", {}).get(role)
        if state is not None:
            gen.set_state(state)
    position.epoch = pending["epoch"]
    if hasattr(loader, "iteration"):
        loader.iteration = pending["epoch"]
    inner = _inner(loader)
    if callable(getattr(inner, "load_state_dict", None)):
        # A StatefulDataLoader builds an iterator in advance (its state_dict() does, and
        # Accelerate calls it in prepare()); that iterator ignores the skip.
        inner.load_state_dict({})
        # A position Accelerate's own load_state restored (``next_iter_state``) would
        # skip the consumed batches a second time: statekit's position replaces it.
        if getattr(inner, "next_iter_state", None) is not None:
            inner.next_iter_state = None
    return pending["batches"]


def _start_fresh(inner: Any, position: Position) -> int:
    """An epoch that is not a resume: returns 0 (nothing to skip)."""
    if getattr(inner, "next_iter_state", None) is not None:
        # A StatefulDataLoader restored by someone else (Accelerate's load_state of an
        # Accelerate checkpoint): it continues from its own state, so until this epoch
        # ends its position is its own state_dict(), not statekit's counters.
        position.foreign = True
    elif getattr(inner, "_initial_iter_for_state_dict", False):
        # An iterator a StatefulDataLoader built in advance drew its workers' base seed
        # before the epoch-start snapshot below; a resume builds it after. Build it here too.
        inner.load_state_dict({})
    return 0


def describe(loader: Any) -> str:
    """The loader's name in messages: its checkpoint key (when restored by key) and classes."""
    position = loader.__dict__.get("_statekit_position")
    kind = f"{type(loader).__name__} over {type(getattr(loader, 'dataset', None)).__name__}"
    name = getattr(position, "name", None)
    return f"{name} ({kind})" if name else kind


def loader_state(loader: Any, name: str | None = None) -> dict[str, Any]:
    """The position of a loader, as codec-able state (per rank).

    For a tracked loader: ``{"epoch", "batches", "start_states"}``, normalised so a
    finished epoch is saved as the start of the next one. For an untracked loader: the
    epoch counter Accelerate keeps (``iteration``) and, for a ``StatefulDataLoader``, its
    own ``state_dict()`` (resume then depends on that loader's own logic); without one,
    ``"epoch_only": True`` and a :class:`statekit.StatekitWarning` when the loader may be
    inside an epoch (its position there is not known, see :func:`_untracked_state`).

    Args:
        loader: the data loader.
        name: its checkpoint key (``dataloader_0``), named in warnings.
    """
    if not is_tracked(loader):
        return _untracked_state(loader, name)
    position: Position = loader.__dict__["_statekit_position"]
    if position.pending is not None and "saved" in position.pending:
        # restored and not iterated since: the restored position still holds (saving the
        # current generators as "epoch start" would lose it)
        return dict(position.pending["saved"])
    epoch, batches, states = position.epoch, position.batches, position.start_states
    restored = getattr(_inner(loader), "next_iter_state", None)
    if (position.foreign and position.in_epoch) or (restored is not None and not position.in_epoch and position.pending is None):
        # a loader resumed by its own state (see _tracked_iter): save that state
        own = loader.state_dict() if position.in_epoch else restored  # the adapter: its snapshot, not the prefetching iterator
        return {"tracked": False, "epoch": epoch, "stateful": own}
    in_epoch = position.in_epoch
    if not in_epoch:
        batches, states = 0, {role: gen.get_state() for role, gen in generators(loader).items()}
    else:
        try:
            length = len(loader)
        except TypeError:
            length = None
        if length is not None and batches >= length:
            # every batch was delivered: the generators already hold the next epoch's start state
            epoch, batches, in_epoch = epoch + 1, 0, False
            states = {role: gen.get_state() for role, gen in generators(loader).items()}
    # the dataset's length lets a restore see that the saved position no longer maps (see restore_loader)
    state = {"tracked": True, "epoch": epoch, "batches": batches, "start_states": states, "dataset_length": dataset_length(loader)}
    state.update(iterable.saved_fields(_inner(loader), position, batches, in_epoch))  # dataset states, workers
    ahead = fetch_rng.saved_states(position, batches) if in_epoch else []  # random states of batches fetched ahead
    if ahead:
        state["fetch_states"] = ahead
    # how the epoch is split over ranks, and (after a resume with another world size) what
    # earlier world sizes consumed of it: lets any world size continue it (engine/elastic.py)
    state.update(elastic.saved_fields(loader, elastic.describe(loader, _inner(loader), sampler_of(loader)), epoch, in_epoch))
    return state


def _untracked_state(loader: Any, name: str | None) -> dict[str, Any]:
    """The state of a loader statekit never tracked (``statekit.save``/``save_state``
    without :func:`statekit.attach` or a manager): a position inside an epoch was never
    recorded, so saying nothing would resume the epoch from its start in a new order."""
    state: dict[str, Any] = {"tracked": False, "epoch": int(getattr(loader, "iteration", 0) or 0)}
    # Accelerate adapters always have state_dict(); it works only for stateful loaders
    if callable(getattr(loader, "state_dict", None)) and getattr(loader, "use_stateful_dataloader", True):
        state["stateful"] = loader.state_dict()
        return state
    state["epoch_only"] = True
    gradient_state = getattr(loader, "gradient_state", None)  # an Accelerate adapter knows when it iterates
    if gradient_state is None or loader in getattr(gradient_state, "dataloader_references", [loader]):
        warnings.warn(
            f"{name or describe(loader)}: statekit does not track this data loader, so its position inside "
            f"the current epoch is not saved: a resume from this checkpoint starts epoch {state['epoch']} "
            "over from its first batch, in a new order. Track it from the first epoch on: "
            "statekit.attach(accelerator) after prepare(), or a statekit.CheckpointManager",
            StatekitWarning,
            stacklevel=2,
        )
    return state


def restore_loader(
    loader: Any, state: dict[str, Any] | None, name: str | None = None, ranks: list[dict[str, Any]] | None = None
) -> bool:
    """Put a loader back at a saved position; the next ``iter(loader)`` continues there
    (how it skips the consumed batches: :mod:`statekit.engine.iterable`).

    Args:
        loader: the loader (tracked or not).
        state: what :func:`loader_state` returned at save time on this rank, or None
            when the checkpoint has no state for this rank (it was saved by fewer ranks).
        name: the loader's checkpoint key (``dataloader_0``), named in warnings.
        ranks: the saved states of every saved rank (index = saved rank), when known.
            With another world size they plan this rank's rest of the interrupted epoch
            (:mod:`statekit.engine.elastic`).

    Returns:
        False when nothing was restored (``state`` is None and no plan applies).

    Raises:
        StateMismatchError: the world size changed mid-epoch and this loader's setup
            cannot continue the epoch exactly (see :func:`statekit.engine.elastic.plan`).
    """
    planned = elastic.plan(ranks, state, elastic.describe(loader, _inner(loader), sampler_of(loader)), name or "data loader") if ranks else None
    if planned is not None:  # another world size: this rank yields its share of what no saved rank consumed
        state = {**(state or ranks[0]), "epoch": planned.epoch, "batches": 0, "start_states": planned.start_states}
        elastic.install(loader, _inner(loader), planned, sampler_of(loader))
    elif state is None:
        return False
    if state.get("tracked"):
        batches = int(state["batches"])
        saved_length, live_length = state.get("dataset_length"), dataset_length(loader)
        if saved_length is not None and live_length is not None and saved_length != live_length:
            # Another dataset length draws another permutation and other batches: the
            # consumed-batch count no longer names the consumed samples, so the interrupted
            # epoch restarts from its first batch (the resume fingerprint warns about it).
            batches = 0
        position = track(loader)
        position.pending = {
            "epoch": int(state["epoch"]),
            "batches": batches,
            "start_states": dict(state.get("start_states") or {}),
            **{k: state.get(k) for k in ("dataset_start", "dataset_after", "workers_epoch", "fetch_states")},
        }
        if batches != int(state["batches"]) or planned is not None:
            position.pending["fetch_states"] = None  # no batch fetched ahead is fetched next
        if batches != int(state["batches"]):
            position.pending["dataset_after"] = None  # the epoch restarts: from its start state
        elif planned is None:  # a save before the next iter() saves this same position
            position.pending["saved"] = dict(state)
        position.name = name or position.name
        position.epoch = int(state["epoch"])
        position.batches = batches
        if hasattr(loader, "iteration"):
            loader.iteration = int(state["epoch"])
        return True
    if hasattr(loader, "iteration") and "epoch" in state:
        loader.iteration = int(state["epoch"])
    if state.get("epoch_only"):
        warnings.warn(
            f"{name or describe(loader)}: the checkpoint holds only the epoch of this data loader "
            f"(it was saved untracked, see statekit.attach): epoch {state.get('epoch', 0)} restarts from its first batch",
            StatekitWarning,
            stacklevel=2,
        )
    if "stateful" in state and callable(getattr(loader, "load_state_dict", None)) and getattr(
        loader, "use_stateful_dataloader", True
    ):
        loader.load_state_dict(state["stateful"])
    return True


def skip_after_resume(loader: Any, num_batches: int) -> bool:
    """Decide a ``skip_first_batches(loader, num_batches)`` call (Accelerate's resume idiom).

    Returns:
        True when ``loader`` is tracked and holds a restored position that skips exactly
        ``num_batches`` batches: the caller should iterate the loader itself (a
        :class:`statekit.StatekitWarning` says so); False when nothing is restored.

    Raises:
        StateMismatchError: a restored position skips another number of batches: skipping
            on top of it would skip twice or replay batches, in a redrawn order.
    """
    if not is_tracked(loader) or num_batches <= 0:
        return False
    position: Position = loader.__dict__["_statekit_position"]
    if position.pending is None:
        return False
    restored = int(position.pending.get("batches", 0))
    if restored != num_batches:
        raise StateMismatchError(
            f"{describe(loader)}: skip_first_batches({num_batches}) after a statekit resume that already "
            f"continues epoch {position.pending.get('epoch')} at batch {restored}: skipping on top of it would "
            "skip twice and redraw the order; iterate the loader itself (no skip_first_batches needed)"
        )
    warnings.warn(
        f"{describe(loader)}: statekit's resume already continues epoch {position.pending.get('epoch')} at batch "
        f"{restored}; skip_first_batches({num_batches}) returns the loader itself so no batch is skipped twice",
        StatekitWarning,
        stacklevel=3,
    )
    return True


def is_loader(obj: Any) -> bool:
    """True for a ``torch.utils.data.DataLoader`` (Accelerate's adapters included)."""
    return isinstance(obj, torch.utils.data.DataLoader)
