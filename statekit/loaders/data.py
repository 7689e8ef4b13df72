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

Loaders keep the generators they have (none are given at attach: that would change the
run's order against a run without statekit); a loader or sampler drawing from the global
RNG is replayed from the global states at the epoch start (:mod:`statekit.loaders.epoch_rng`).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from statekit.checks import audit, next_batch
from statekit.loaders import elastic, epoch_rng, fetch_rng, index_log, iterable, own_skip
from statekit.devices import snapshot_random_states
from statekit.loaders.samplers import (
    SkipBatches,
    dataset_length,
    generators,
    inner_loader,
    run_sampler_out,
    sampled_epoch_length,
    sampler_of,
    wrap_batch_sampler,
)
from statekit.errors import StatekitWarning, StateMismatchError, warn_user

logger = logging.getLogger(__name__)

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
            by ``n`` (:func:`statekit.loaders.iterable.recorder`); ``dataset_fetched``: the
            batches of the epoch its iterator asked for so far; ``dataset_loaded``: the state
            statekit loaded into the dataset for this epoch, until the epoch's iterator started.
        workers_epoch: the epoch in which the loader's persistent workers started.
        fetch_states: the global random states before each fetch of the epoch not consumed
            yet, by fetch number (:mod:`statekit.loaders.fetch_rng`); ``replay_after``: the
            states a resume puts back once it fetched the read-ahead batches again.
        name: the loader's checkpoint key, for messages (set when it is restored).
        epoch_rng: the global random states right before the epoch's iterator was built
            (:mod:`statekit.loaders.epoch_rng`); ``resume_rng``: the states a resumed epoch's
            replay puts back once the sampler made its first draws.
        drawn: the sample indices the batch sampler handed out, by fetch number, not
            consumed yet; ``drawn_all``: the sampler ran out (:class:`statekit.loaders.index_log.IndexLog`);
            ``sampler_epoch_start``: the sampler's epoch when the epoch's iterator took it.
        prebuilt: the epoch runs on the iterator a ``StatefulDataLoader`` built before it
            (:func:`_prebuilt`), as it does without statekit; ``prebuilt_seed``: that
            iterator's workers' base seed.
        witness: the :class:`statekit.checks.next_batch.Witness` of the last save, waiting for
            the next batch; ``follow_up``: ``(record, key)`` of the resume audit's check
            of the next epoch's first batch, when the resumed position was its epoch's end.
        parent: the running epoch's underlying iterator (the batch an Accelerate adapter
            holds ahead is read from it for the resume audit).
        resume_verdict: the verdict of the resume that restored this loader
            (:class:`statekit.checks.audit.ResumeVerdict`), or None.
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
    dataset_loaded: Any = None
    workers_epoch: int | None = None
    fetch_states: dict[int, Any] = field(default_factory=dict)
    replay_after: Any = None
    name: str | None = None
    epoch_rng: dict[str, Any] | None = None
    resume_rng: dict[str, Any] | None = None
    drawn: dict[int, Any] = field(default_factory=dict)
    drawn_all: bool = False
    sampler_epoch_start: int | None = None
    prebuilt: bool = False
    prebuilt_seed: int | None = None
    witness: Any = None
    follow_up: Any = None
    parent: Any = None
    resume_verdict: Any = None


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


@dataclass
class _Pass:
    """One pass of a tracked loader over its epoch: what the steps of :func:`_tracked_iter` share.

    Attributes:
        pending: the restored position this pass resumes, or None.
        skip: batches of the epoch consumed before it (not yielded again).
        how: how they are skipped (:func:`statekit.loaders.iterable.plan`).
        name: the loader's name in messages.
        length: the whole epoch's length (:func:`statekit.loaders.samplers.sampled_epoch_length`).
        check: the resume audit's check of the first batch, until it ran (:func:`_first_batch_check`).
        restore: takes the batch-sampler wrappers off, until it ran (None for a prebuilt iterator).
        started: the pass yielded its first batch.
    """

    pending: dict[str, Any] | None
    skip: int
    how: str | None
    name: str
    length: int | None = None
    check: Any = None
    restore: Any = None
    started: bool = False

    @property
    def replay_start(self) -> dict[str, Any] | None:
        """The global random states the resumed epoch's order was drawn from, or None."""
        return (self.pending or {}).get("epoch_rng")


def _tracked_iter(self: Any) -> Iterator[Any]:
    """A tracked loader's ``__iter__``: start the pass at the epoch start (or the restored
    position), wrap the batch sampler, build the iterator, count each batch it yields, and
    count the epoch once it ends (everything up to the iterator's build runs at the first
    ``next()``, as in a plain generator ``__iter__``)."""
    position: Position = self.__dict__["_statekit_position"]
    inner = inner_loader(self)
    run = _start_pass(self, position, inner)
    _wrap_epoch_sampler(self, inner, position, run)
    position.epoch_rng = run.replay_start or snapshot_random_states()  # before the iterator draws the epoch's order
    parent = super(type(self), self).__iter__()
    position.parent = parent
    finished = short = False
    hold = own_skip.start(run.pending, run.skip, run.name, position.epoch)  # a loop that skips consumed batches itself
    try:
        if run.how == iterable.CONSUME:
            short = iterable.consume(parent, run.skip, position.epoch, run.name, inner, after=position.resume_rng) < run.skip
        for batch in run_sampler_out(parent, position, run.length):
            _before_yield(self, inner, position, run, batch)
            if hold is not None:
                hold.yielded(sys._getframe())
            yield batch
            while hold is not None and hold.skipped():  # the loop skipped it: the same batch again
                hold.yielded(sys._getframe())
                yield batch
            if hold is not None and hold.done:
                hold = None
        finished = True
        if position.witness is not None:  # the save's next batch may be the next epoch's first
            position.witness.epoch_ended(position.epoch, position.batches)
    finally:
        if hold is not None:
            hold.close()
        if epoch_rng is None:  # an iterator still open at interpreter exit, its module already torn down
            return
        _close_pass(self, inner, position, run, finished)
    if run.check is not None:  # a resumed epoch that yielded nothing
        run.check(self, position, run.skip, None, short)
    position.in_epoch = False
    position.foreign = False
    position.epoch += 1
    position.batches = 0


def _start_pass(loader: Any, position: Position, inner: Any) -> _Pass:
    """Take the restored position (if any) and set the epoch's start: the generators and
    counters, how the consumed batches are skipped, and the epoch-start generator states."""
    pending, position.pending = position.pending, None
    position.prebuilt = False
    iteration = loader.__dict__.get("iteration")
    if pending is None and isinstance(iteration, int):
        # Accelerate's epoch counter is the epoch: set_epoch() sets it, and a pass left
        # before its end (transformers' Trainer takes exactly an epoch's batches and drops
        # the iterator) does not raise it, so counting passes here would lag behind it
        position.epoch = iteration
    skip = _apply_pending(loader, position, pending) if pending is not None else _start_fresh(inner, position)
    name = describe(loader)
    how = iterable.plan(loader, inner, position, pending, skip, name, prebuilt=position.prebuilt)
    position.start_states = {role: gen.get_state() for role, gen in generators(loader).items()}
    position.batches = skip
    position.in_epoch = True
    return _Pass(pending=pending, skip=skip, how=how, name=name)


def _wrap_epoch_sampler(loader: Any, inner: Any, position: Position, run: _Pass) -> None:
    """Put the batch-sampler wrappers on (or around a prebuilt iterator's sampler iterator),
    and prepare the first batch's audit check; sets ``run.length``, ``run.check`` and ``run.restore``."""
    prebuilt = _prebuilt(inner) if position.prebuilt else None
    if prebuilt is not None and run.pending is None:
        _record_prebuilt(prebuilt, position)
    wrappers = _batch_sampler_wrappers(loader, inner, position, run, prebuilt)
    # the whole epoch's length, before the skip wrapper shortens the batch sampler:
    # position.batches counts from the start of the epoch (it starts at ``skip``)
    run.length = sampled_epoch_length(loader)
    run.check = _first_batch_check(run.pending, run.name, position)
    # around the sampler itself: its seed (a global-drawing RandomSampler), and the checkpoint's
    # global random states back once the sampler made its epoch-start draws
    innermost = epoch_rng.innermost(position, sampler_of(loader), replaying=bool(run.replay_start))
    skip = run.skip if run.how == iterable.INDICES else 0
    if prebuilt is not None:  # its sampler iterator exists: wrapped in place, nothing to put back
        _wrap_prebuilt(prebuilt, skip, _compose(wrappers), innermost)
    else:
        run.restore = wrap_batch_sampler(inner, skip, _compose(wrappers), innermost)


def _batch_sampler_wrappers(loader: Any, inner: Any, position: Position, run: _Pass, prebuilt: Any) -> list[Any]:
    """The batch-sampler wrappers of the pass, innermost first (wrap_batch_sampler puts them
    on before the iterator is built and takes them off after the first batch)."""
    first = run.skip if run.how in (iterable.INDICES, iterable.DATASET) else 0  # the consumed batches are not fetched again
    if prebuilt is not None:  # batches it fetched ahead when it was built (workers) came before any wrapper
        first += int(getattr(prebuilt, "_send_idx", 0) or 0)
    return [
        # the indices handed out, for the resume audit's record of the next batch
        audit_log(loader, inner, position, first),
        iterable.recorder(loader, inner, position, first=run.skip if run.how == iterable.DATASET else 0),
        # re-read batches are fetched under an RNG guard (iterable.consume), which puts the states back itself
        fetch_rng.recorder(inner, position, first, run.skip, (run.pending or {}).get("fetch_states"), settle_after=run.how != iterable.CONSUME),
        # outermost: torch takes iter(batch_sampler) before it draws the workers' base seed
        epoch_rng.wrapper(position, run.replay_start, at_first_batch=_built_before_epoch(run.pending) and prebuilt is None),
    ]


def _before_yield(loader: Any, inner: Any, position: Position, run: _Pass, batch: Any) -> None:
    """Everything a batch settles before the pass yields it: the first batch's bookkeeping and
    audit check, the witness of the last save, and the position counted one batch on."""
    if not run.started:
        run.started = True
        iterable.started(inner, position)  # a dataset state loaded for this epoch only is forgotten
        if position.sampler_epoch_start is None:  # no IndexLog read it when the iterator took the sampler
            position.sampler_epoch_start = index_log.sampler_epoch(loader, sampler_of(loader))
    if run.restore is not None:
        run.restore()
        run.restore = None
    if run.check is not None:
        run.check(loader, position, run.skip, batch)
        run.check = None
    if position.witness is not None:  # the first batch after a save
        witness, position.witness = position.witness, None
        witness.observe(position.epoch, position.batches, batch)
    position.batches += 1
    iterable.forget_before(position, position.batches)
    fetch_rng.forget_before(position, position.batches)
    index_log.forget_before(position, position.batches)
    fetch_rng.settle(position)  # a loader that does not read ahead: the restored states now
    # a rank that builds the iterator but never asks its sampler (the other ranks of
    # Accelerate's DataLoaderDispatcher): the checkpoint's states back at its first batch
    epoch_rng.settle(position)


def _close_pass(loader: Any, inner: Any, position: Position, run: _Pass, finished: bool) -> None:
    """The pass's iterator ended or was closed: the wrappers off, what waited for a first
    batch settled, and an abandoned pass counted as such (:func:`_abandoned`)."""
    if run.restore is not None:
        run.restore()
    if position.dataset_loaded is not None:  # the epoch ended before its first batch
        iterable.started(inner, position)
    epoch_rng.settle(position)
    position.parent = None
    if not finished:
        _abandoned(loader, position)


def _compose(wrappers: list[Any]) -> Any:
    """One batch-sampler wrapper applying ``wrappers`` (innermost first; None skipped), or None."""
    present = [w for w in wrappers if w is not None]
    if not present:
        return None

    def wrap(batch_sampler: Any) -> Any:
        for w in present:
            batch_sampler = w(batch_sampler)
        return batch_sampler

    return wrap


def _prebuilt(inner: Any) -> Any:
    """The iterator a torchdata ``StatefulDataLoader`` built before its epoch started and has
    not handed out yet, or None.

    ``StatefulDataLoader.state_dict()`` builds the next iterator when none exists, and the
    next ``iter()`` returns that one (``_initial_iter_for_state_dict``); Accelerate's
    ``DataLoaderAdapter`` calls ``state_dict()`` in ``prepare()``
    (https://github.com/pytorch/data/blob/main/torchdata/stateful_dataloader/stateful_dataloader.py).
    Building it drew the workers' base seed from the global generator (and the order, for a
    batch sampler that draws in ``iter()``); building another would draw again, so the
    epoch runs on it, as it does without statekit.
    """
    if getattr(inner, "_initial_iter_for_state_dict", False):
        return getattr(inner, "_iterator", None)
    return None


def _built_before_epoch(pending: dict[str, Any] | None) -> bool:
    """True when the saved epoch ran on an iterator built before it started: a prebuilt one
    (:func:`_prebuilt`), or persistent workers started in an earlier epoch. Its workers' base
    seed was drawn before the recorded epoch start, where an iterator built for the resume
    draws it after: the replay sets the epoch start's states at the first batch instead."""
    if not pending:
        return False
    persistent = pending.get("workers_epoch") is not None and pending["workers_epoch"] != pending["epoch"]
    return bool(pending.get("prebuilt")) or persistent


def _record_prebuilt(iterator: Any, position: Position) -> None:
    """What a resume needs of an epoch that runs on a prebuilt iterator (:func:`_prebuilt`):
    its workers' base seed (``position.prebuilt_seed``, to recognise the same iterator built
    by the resumed process's ``prepare()``), and, when its sampler drew the order while it was
    built (torchdata's stateful ``RandomSampler`` draws in ``iter()``), the sampler
    generator's state before that draw as the epoch's ``"sampler"`` start state, read from
    the sampler iterator's own ``state_dict()`` (torchdata's Stateful protocol: the state it
    would restore from), so that an iterator built again draws the same order."""
    position.prebuilt_seed = getattr(iterator, "_base_seed", None)
    sampler_iterator = getattr(iterator, "_sampler_iter", None)
    if "sampler" not in position.start_states or not callable(getattr(sampler_iterator, "state_dict", None)):
        return
    before = (sampler_iterator.state_dict().get("sampler_iter_state") or {}).get("generator")
    if isinstance(before, torch.Tensor):
        position.start_states["sampler"] = before.clone()


def _wrap_prebuilt(iterator: Any, skip: int, record: Any, innermost: Any) -> None:
    """Put the batch-sampler wrappers around the sampler iterator of a prebuilt iterator
    (:func:`_prebuilt`), which took its batch sampler before any wrapper was on, as
    :func:`statekit.loaders.samplers.wrap_batch_sampler` puts them around a batch sampler:
    ``innermost``, a skip of ``skip`` batches, then ``record``. A batch sampler's iterator
    draws when its first batch is asked for (torch's ``BatchSampler.__iter__`` is a
    generator), so the wrappers still see the epoch's first draws."""
    base = iterator._sampler_iter
    if innermost is not None:
        base = innermost(base)
    if skip:
        base = SkipBatches(base, skip)
    if record is not None:
        base = record(base)
    iterator._sampler_iter = iter(base)


def _abandoned(loader: Any, position: Position) -> None:
    """The ``for`` loop left the epoch before its end (``break``, an exception, ``zip`` with a
    shorter loader), and the iterator was closed: the next ``iter()`` starts a new pass from
    the generators as they are, so a save from now on saves that, not the abandoned epoch's
    position (a resume would skip batches the next pass yields). Accelerate's adapters do not
    count an abandoned pass (``iteration`` is raised only at the end of ``__iter__``), so
    their epoch stays; a plain loader counts it."""
    if not position.in_epoch:
        return
    position.in_epoch = False
    position.foreign = False
    iteration = loader.__dict__.get("iteration") if hasattr(loader, "__dict__") else None
    position.epoch = int(iteration) if isinstance(iteration, int) else position.epoch + 1
    position.batches = 0
    position.drawn = {}
    position.fetch_states = {}


def audit_log(loader: Any, inner: Any, position: Position, first: int) -> Any:
    """The :class:`statekit.loaders.index_log.IndexLog` wrapper for the loader's batch sampler, or
    None for an iterable dataset (its batch sampler hands out no sample indices). It asks
    one batch ahead only where nothing else does: a plain loader without worker processes."""
    position.drawn = {}
    position.drawn_all = False
    position.sampler_epoch_start = None
    if iterable.is_iterable(inner):
        return None
    read_ahead = inner is loader and iterable.num_workers(inner) == 0
    epoch_of = lambda: index_log.sampler_epoch(loader, sampler_of(loader))  # noqa: E731
    return lambda batch_sampler: index_log.IndexLog(batch_sampler, position, first, read_ahead, epoch_of)


def _first_batch_check(pending: dict[str, Any] | None, label: str, position: Position) -> Any:
    """The resume audit's check of the first batch a restored loader yields (or, when the
    saved position was its epoch's end, of the next epoch's first batch: ``position.follow_up``),
    or None."""
    if pending is None and position.follow_up is not None:
        record, name = position.follow_up
        position.follow_up = None
    else:
        record = audit.NextBatch.from_json((pending or {}).get("next"))
        if record is None or (pending or {}).get("audit_skip"):
            return None
        name = (pending or {}).get("name") or label

    def check(loader: Any, position: Position, fetched: int, batch: Any, short: bool = False) -> None:
        """``batch`` None: the epoch ended; ``short``: before the saved position (re-read)."""
        if record.ends_epoch:  # the saved run's epoch ended at the saved position (recorded after the save)
            if batch is None:  # so does the resumed one: check the next epoch's first batch
                position.follow_up = (record.next_epoch(), name)
            else:
                audit.ended_in_saved_run(position.resume_verdict, name, label, record)
            return
        if batch is None and fetched not in position.drawn and (short or record.indices_digest or record.content_digest):
            # the epoch ended before its first batch, which the saved run had (the record shows
            # one, or the re-read ended before the saved position)
            audit.nothing_yielded(position.resume_verdict, name, label, record)
            return
        has = fetched in position.drawn
        now = position.sampler_epoch_start if record.sampler_epoch is not None else None
        audit.check_first_batch(position.resume_verdict, name, label, record, position.drawn.get(fetched), has, batch, now)

    return check


def _apply_pending(loader: Any, position: Position, pending: dict[str, Any]) -> int:
    """Set the generators and the epoch counters to a restored position; returns the
    batches of that epoch to skip."""
    position.epoch = pending["epoch"]
    if hasattr(loader, "iteration"):
        loader.iteration = pending["epoch"]
    inner = inner_loader(loader)
    prebuilt = _prebuilt(inner)
    if pending.get("prebuilt") and prebuilt is not None and getattr(prebuilt, "_base_seed", None) == pending.get("prebuilt_seed"):
        # The saved epoch ran on the iterator Accelerate's prepare() built, and this process's
        # prepare() built the same one (the same base seed): resume on it. It made the
        # epoch-start draws already, so the generators keep the states the load restored.
        position.prebuilt, position.prebuilt_seed = True, pending.get("prebuilt_seed")
        return pending["batches"]
    for role, gen in generators(loader).items():
        state = pending.get("start_states", {}).get(role)
        if state is not None:
            gen.set_state(state)
    if callable(getattr(inner, "load_state_dict", None)):
        if pending.get("prebuilt") and iterable.num_workers(inner):
            warn_user(
                f"{describe(loader)}: the saved epoch {pending['epoch']} ran on the iterator its StatefulDataLoader built "
                "in Accelerate's prepare(), and this process's prepare() drew another base seed for the worker processes: "
                "the batches' order is replayed, but random draws inside the workers (augmentations) differ for the rest "
                "of that epoch; seed the process before prepare() as the saved run did",
                StatekitWarning,
            )
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
    elif _prebuilt(inner) is not None:
        # A StatefulDataLoader built this epoch's iterator in advance (Accelerate's prepare()
        # calls its state_dict()): the epoch runs on it, as it does without statekit
        position.prebuilt = True
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
    own = _own_loader_state(loader, position)
    if own is not None:
        return own
    epoch, batches, states, in_epoch = _saved_position(loader, position)
    # the dataset's length lets a restore see that the saved position no longer maps (see restore_loader)
    state = {"tracked": True, "epoch": epoch, "batches": batches, "start_states": states, "dataset_length": dataset_length(loader)}
    if position.in_epoch and not in_epoch:  # saved inside the for loop, after its epoch's last batch
        state["after_last_batch"] = True
    state.update(iterable.saved_fields(inner_loader(loader), position, batches, in_epoch))  # dataset states, workers
    if in_epoch:
        state.update(_replay_fields(position, batches))
    record = _next_batch(loader, position, epoch, batches, in_epoch)  # the resume audit's record
    state["next"] = record.to_json()
    # what the loader yields next is seen after the save returns: recorded beside the checkpoint
    position.witness = next_batch.new_witness(name, record.epoch, record.batch) if record.content_digest is None else None
    # how the epoch is split over ranks, and (after a resume with another world size) what
    # earlier world sizes consumed of it: lets any world size continue it (loaders/elastic.py)
    state.update(elastic.saved_fields(loader, elastic.describe(loader, inner_loader(loader), sampler_of(loader)), epoch, in_epoch))
    return state


def _own_loader_state(loader: Any, position: Position) -> dict[str, Any] | None:
    """The state of a loader resumed by its own state (see :func:`_start_fresh`), saved as
    that state; None for a loader on statekit's position."""
    restored = getattr(inner_loader(loader), "next_iter_state", None)
    if (position.foreign and position.in_epoch) or (restored is not None and not position.in_epoch and position.pending is None):
        own = loader.state_dict() if position.in_epoch else restored  # the adapter: its snapshot, not the prefetching iterator
        return {"tracked": False, "epoch": position.epoch, "stateful": own}
    return None


def _saved_position(loader: Any, position: Position) -> tuple[int, int, dict[str, torch.Tensor], bool]:
    """``(epoch, batches, start_states, in_epoch)`` to save: outside an epoch, or after its
    last batch, the start of the next epoch (the generators' states now)."""
    epoch, batches, states = position.epoch, position.batches, position.start_states
    if not position.in_epoch:
        return epoch, 0, {role: gen.get_state() for role, gen in generators(loader).items()}, False
    try:
        length = len(loader)
    except TypeError:
        length = None
    # Accelerate's adapters read one batch ahead and know when the one they yielded was
    # the epoch's last (end_of_dataloader), also for an iterable dataset without a length
    ended = batches > 0 and getattr(loader, "end_of_dataloader", False) is True and iterable.is_iterable(inner_loader(loader))
    if (length is not None and batches >= length) or ended:
        # every batch was delivered: the generators already hold the next epoch's start state
        return epoch + 1, 0, {role: gen.get_state() for role, gen in generators(loader).items()}, False
    return epoch, batches, states, True


def _replay_fields(position: Position, batches: int) -> dict[str, Any]:
    """What replaying a saved position inside an epoch needs besides its generator states:
    the random states of batches fetched ahead, and the global states the epoch's order was
    drawn from (:mod:`statekit.loaders.epoch_rng`) or the prebuilt iterator that drew it."""
    fields: dict[str, Any] = {}
    ahead = fetch_rng.saved_states(position, batches)  # random states of batches fetched ahead
    if ahead:
        fields["fetch_states"] = ahead
    fields["epoch_rng"] = position.epoch_rng
    if position.prebuilt:  # ... or the iterator built before the epoch drew it (_prebuilt)
        fields["prebuilt"], fields["prebuilt_seed"] = True, position.prebuilt_seed
    return fields


def _next_batch(loader: Any, position: Position, epoch: int, batches: int, in_epoch: bool) -> audit.NextBatch:
    """What the resumed loader must yield next (:mod:`statekit.checks.audit`)."""
    record = audit.NextBatch(epoch=epoch, batch=batches)
    if not in_epoch:
        record.missing = audit.AT_EPOCH_BOUNDARY
        return record
    record.sampler_epoch = position.sampler_epoch_start
    inner = inner_loader(loader)
    if batches in position.drawn:
        record.indices_digest, record.indices_head = audit.indices_digest(position.drawn[batches])
    held, batch = index_log.accelerate_next_batch(position.parent, loader) if position.parent is not None else (False, None)
    if held:
        record.content_digest = audit.content_digest(batch)
    if record.indices_digest is None and record.content_digest is None:
        if iterable.is_iterable(inner):
            record.missing = "an iterable dataset without a batch held ahead: neither indices nor content of the next batch are known at save time"
        else:
            record.missing = "the next batch's indices were not drawn at save time"
    elif record.content_digest is None:
        record.missing = "content not recorded (the loader does not hold the next batch at save time)"
    return record


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
        warn_user(
            f"{name or describe(loader)}: statekit does not track this data loader, so its position inside "
            f"the current epoch is not saved: a resume from this checkpoint starts epoch {state['epoch']} "
            "over from its first batch, in a new order. Track it from the first epoch on: "
            "statekit.attach(accelerator) after prepare(), or a statekit.CheckpointManager",
            StatekitWarning,
        )
    return state


def restore_loader(
    loader: Any, state: dict[str, Any] | None, name: str | None = None, ranks: list[dict[str, Any]] | None = None
) -> bool:
    """Put a loader back at a saved position; the next ``iter(loader)`` continues there
    (how it skips the consumed batches: :mod:`statekit.loaders.iterable`).

    Args:
        loader: the loader (tracked or not).
        state: what :func:`loader_state` returned at save time on this rank, or None
            when the checkpoint has no state for this rank (it was saved by fewer ranks).
        name: the loader's checkpoint key (``dataloader_0``), named in warnings.
        ranks: the saved states of every saved rank (index = saved rank), when known.
            With another world size they plan this rank's rest of the interrupted epoch
            (:mod:`statekit.loaders.elastic`).

    Returns:
        False when nothing was restored (``state`` is None and no plan applies).

    Raises:
        StateMismatchError: the world size changed mid-epoch and this loader's setup
            cannot continue the epoch exactly (see :func:`statekit.loaders.elastic.plan`).
    """
    planned = elastic.plan(ranks, state, elastic.describe(loader, inner_loader(loader), sampler_of(loader)), name or "data loader") if ranks else None
    if planned is not None:  # another world size: this rank yields its share of what no saved rank consumed
        state = {**(state or ranks[0]), "epoch": planned.epoch, "batches": 0, "start_states": planned.start_states}
        elastic.install(loader, inner_loader(loader), planned, sampler_of(loader))
    elif state is None:
        return False
    if state.get("tracked"):
        _restore_tracked(loader, state, name, planned)
    else:
        _restore_untracked(loader, state, name)
    return True


def _restore_tracked(loader: Any, state: dict[str, Any], name: str | None, planned: Any) -> None:
    """Put a position statekit tracked back as the loader's pending position (applied by
    the next ``iter()``, :func:`_apply_pending`), and register it with the resume audit;
    ``planned``: this rank's share of the epoch after a world-size change, or None."""
    batches = _batches_to_skip(loader, state)
    restarted = batches != int(state["batches"])
    position = track(loader)
    position.pending = {
        "epoch": int(state["epoch"]),
        "batches": batches,
        "start_states": dict(state.get("start_states") or {}),
        **{k: state.get(k) for k in ("dataset_start", "dataset_after", "workers_epoch", "fetch_states", "epoch_rng", "next", "prebuilt", "prebuilt_seed")},
        "name": name,
    }
    _audit_restored(loader, position, state, name, restarted, planned)
    if restarted or planned is not None:
        position.pending["fetch_states"] = None  # no batch fetched ahead is fetched next
    if restarted:
        position.pending["dataset_after"] = None  # the epoch restarts: from its start state
        position.pending["restarted"] = True
    elif planned is None:  # a save before the next iter() saves this same position
        position.pending["saved"] = dict(state)
    position.name = name or position.name
    position.epoch = int(state["epoch"])
    position.batches = batches
    if state.get("after_last_batch") and planned is None:
        _warn_after_last_batch(loader, state, name)
    if hasattr(loader, "iteration"):
        loader.iteration = int(state["epoch"])


def _batches_to_skip(loader: Any, state: dict[str, Any]) -> int:
    """The saved count of consumed batches, or 0 when the dataset's length changed since the save."""
    batches = int(state["batches"])
    saved_length, live_length = state.get("dataset_length"), dataset_length(loader)
    if saved_length is not None and live_length is not None and saved_length != live_length:
        # Another dataset length draws another permutation and other batches: the
        # consumed-batch count no longer names the consumed samples, so the interrupted
        # epoch restarts from its first batch (the resume fingerprint warns about it).
        batches = 0
    return batches


def _audit_restored(loader: Any, position: Position, state: dict[str, Any], name: str | None, restarted: bool, planned: Any) -> None:
    """Tell the resume audit about the restored position: checked at the first batch against
    the saved record of the next batch, or unverifiable (and why)."""
    why_not = None
    if state.get("next") is None:
        why_not = "the checkpoint holds no record of the next batch (saved by an older statekit)"
    elif restarted:
        why_not = "the dataset's length changed since the save: the interrupted epoch restarts"
    elif planned is not None:
        why_not = "the world size changed: this rank's share of the interrupted epoch was planned anew"
    skipped = why_not is not None
    position.pending["audit_skip"] = skipped  # the record does not describe what comes next
    if why_not is None and not state["next"].get("indices_digest") and not state["next"].get("content_digest"):
        why_not = state["next"].get("missing")  # checked only for a batch at all (audit.nothing_yielded)
    audit.restored(name or describe(loader), position, audit.NextBatch.from_json(state.get("next")), why_not, checked_later=not skipped)


def _warn_after_last_batch(loader: Any, state: dict[str, Any], name: str | None) -> None:
    """The save was made inside the ``for`` loop after the epoch's last batch: the loop's
    epoch-end code must not run again for that epoch."""
    warn_user(
        f"{name or describe(loader)}: the checkpoint was saved inside the for loop right after the last batch of "
        f"epoch {int(state['epoch']) - 1}, before that loop ended; the next `for batch in loader` starts epoch "
        f"{state['epoch']}. A loop that counts epochs, or steps an epoch scheduler, after its `for` ends must not "
        "do that for the finished epoch again: derive the epoch from the step (step // len(loader)) or save "
        "after the `for` (docs/concepts.md, 'A save right after an epoch's last batch')",
        StatekitWarning,
    )


def _restore_untracked(loader: Any, state: dict[str, Any], name: str | None) -> None:
    """Restore what a save of an untracked loader (or Accelerate) kept: the epoch counter and,
    for a ``StatefulDataLoader``, its own state."""
    if is_tracked(loader):  # the resume audit: nothing recorded to check this loader against
        audit.restored(name or describe(loader), loader.__dict__["_statekit_position"], None,
                       "the checkpoint holds no statekit position for this loader (saved untracked, or by Accelerate)")
    if hasattr(loader, "iteration") and "epoch" in state:
        loader.iteration = int(state["epoch"])
    if state.get("epoch_only"):
        warn_user(
            f"{name or describe(loader)}: the checkpoint holds only the epoch of this data loader "
            f"(it was saved untracked, see statekit.attach): epoch {state.get('epoch', 0)} restarts from its first batch",
            StatekitWarning,
        )
    if "stateful" in state and callable(getattr(loader, "load_state_dict", None)) and getattr(
        loader, "use_stateful_dataloader", True
    ):
        loader.load_state_dict(state["stateful"])


def skip_after_resume(loader: Any, num_batches: int) -> bool:
    """Decide a ``skip_first_batches(loader, num_batches)`` call (Accelerate's resume idiom).

    Returns:
        True when ``loader`` is tracked and holds a restored position that skips exactly
        ``num_batches`` batches (0 included: a resume at an epoch's start): the caller should
        iterate the loader itself (logged at INFO); False when nothing is restored, or when
        the restored epoch restarts because the dataset's length changed (the skip then
        runs as Accelerate's, with a warning that the resume is not exact).

    Raises:
        StateMismatchError: a restored position skips another number of batches: skipping
            on top of it would skip twice or replay batches, in a redrawn order.
    """
    if not is_tracked(loader) or num_batches < 0:
        return False
    position: Position = loader.__dict__["_statekit_position"]
    if position.pending is None:
        return False
    # skip_first_batches(loader, 0) too (a resume at an epoch's start: complete_nlp_example.py's
    # resume_step is 0 there): Accelerate's copy of the loader would never apply the restored position
    restored = int(position.pending.get("batches", 0))
    if position.pending.get("restarted"):
        # statekit could not continue the interrupted epoch (its dataset's length changed,
        # warned at the load): the caller's skip is all that is left of the position
        warn_user(
            f"{describe(loader)}: the interrupted epoch {position.pending.get('epoch')} restarts (the dataset's length "
            f"changed since the save); skip_first_batches({num_batches}) skips {num_batches} batches of its new order, "
            "as Accelerate does: the resume is not exact"
        )
        position.pending = None
        return False
    if restored != num_batches:
        raise StateMismatchError(
            f"{describe(loader)}: skip_first_batches({num_batches}) after a statekit resume that already "
            f"continues epoch {position.pending.get('epoch')} at batch {restored}: skipping on top of it would "
            "skip twice and redraw the order; iterate the loader itself (no skip_first_batches needed)"
        )
    # the script's idiom for Accelerate's resume, served exactly: a log line, not a warning
    logger.info(
        "%s: statekit's resume already continues epoch %s at batch %d; skip_first_batches(%d) returns the loader itself "
        "so no batch is skipped twice", describe(loader), position.pending.get("epoch"), restored, num_batches,
    )
    return True


def is_loader(obj: Any) -> bool:
    """True for a ``torch.utils.data.DataLoader`` (Accelerate's adapters included)."""
    return isinstance(obj, torch.utils.data.DataLoader)
