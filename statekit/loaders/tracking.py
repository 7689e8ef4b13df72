"""A tracked data loader's iteration: :func:`track` swaps the loader's class for a subclass
whose ``__iter__`` snapshots the sampler and loader generators at the epoch start, counts the
batches it yields and, after a restore (:mod:`statekit.loaders.data`), sets the generators back
and skips the consumed batches at the index level. Why and how: docs/design-notes.md,
"Data loaders".
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from statekit.checks import audit
from statekit.loaders import epoch_rng, fetch_rng, index_log, iterable, own_skip
from statekit.devices import snapshot_random_states
from statekit.loaders.samplers import (
    SkipBatches,
    generators,
    inner_loader,
    run_sampler_out,
    sampled_epoch_length,
    sampler_of,
    wrap_batch_sampler,
)
from statekit.errors import StatekitWarning, warn_user

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
    """Start recording ``loader``'s epoch-start generator states and consumed batches (a
    ``DataLoader`` or an Accelerate ``DataLoaderShard``/``DataLoaderDispatcher``; idempotent).
    Returns its :class:`Position`."""
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
    """One pass of a tracked loader over its epoch: what the steps of :func:`_tracked_iter` share
    (the restored position, the batches to skip and how, the first-batch check, the wrappers' undo).
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
    """A tracked loader's ``__iter__``: start the pass, wrap the batch sampler, build the iterator,
    count each batch and the epoch's end (the set-up runs at the first ``next()``).
    """
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
    """The iterator a torchdata ``StatefulDataLoader`` built before its epoch (``state_dict()`` builds
    it; Accelerate calls that in ``prepare()``) and has not handed out, or None. Building it drew
    the workers' base seed, so the epoch runs on it, as without statekit.
    """
    if getattr(inner, "_initial_iter_for_state_dict", False):
        return getattr(inner, "_iterator", None)
    return None


def _built_before_epoch(pending: dict[str, Any] | None) -> bool:
    """True when the saved epoch ran on an iterator built before it started (prebuilt, or persistent
    workers): the replay then sets the epoch start's states at the first batch.
    """
    if not pending:
        return False
    persistent = pending.get("workers_epoch") is not None and pending["workers_epoch"] != pending["epoch"]
    return bool(pending.get("prebuilt")) or persistent


def _record_prebuilt(iterator: Any, position: Position) -> None:
    """Record an epoch on a prebuilt iterator: its workers' base seed and, when its sampler drew
    while built, the sampler generator's state before that draw (the ``"sampler"`` start state).
    """
    position.prebuilt_seed = getattr(iterator, "_base_seed", None)
    sampler_iterator = getattr(iterator, "_sampler_iter", None)
    if "sampler" not in position.start_states or not callable(getattr(sampler_iterator, "state_dict", None)):
        return
    before = (sampler_iterator.state_dict().get("sampler_iter_state") or {}).get("generator")
    if isinstance(before, torch.Tensor):
        position.start_states["sampler"] = before.clone()


def _wrap_prebuilt(iterator: Any, skip: int, record: Any, innermost: Any) -> None:
    """Put the batch-sampler wrappers around a prebuilt iterator's sampler iterator, as
    :func:`statekit.loaders.samplers.wrap_batch_sampler` does around a batch sampler.
    """
    base = iterator._sampler_iter
    if innermost is not None:
        base = innermost(base)
    if skip:
        base = SkipBatches(base, skip)
    if record is not None:
        base = record(base)
    iterator._sampler_iter = iter(base)


def _abandoned(loader: Any, position: Position) -> None:
    """The ``for`` loop left the epoch early and closed the iterator: the next ``iter()`` starts a
    new pass (Accelerate's adapters do not count it; a plain loader does).
    """
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
    """The resume audit's check of the first batch a restored loader yields (or of the next epoch's
    first, ``position.follow_up``), or None.
    """
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
