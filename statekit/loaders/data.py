"""A data loader's position as saved state: :func:`loader_state` at a save,
:func:`restore_loader` at a load (the next ``iter()`` of the tracked loader,
:mod:`statekit.loaders.tracking`, continues there), :func:`skip_after_resume` for
Accelerate's ``skip_first_batches`` idiom. Why and how: docs/design-notes.md, "Data loaders".
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from statekit.checks import audit, next_batch
from statekit.loaders import elastic, fetch_rng, index_log, iterable
from statekit.loaders.samplers import dataset_length, generators, inner_loader, sampler_of
from statekit.loaders.tracking import Position, describe, is_tracked, track
from statekit.errors import StatekitWarning, StateMismatchError, warn_user

logger = logging.getLogger(__name__)


def loader_state(loader: Any, name: str | None = None) -> dict[str, Any]:
    """The position of ``loader`` as codec-able state (per rank); ``name`` is its checkpoint key
    (``dataloader_0``) in warnings. Tracked: ``epoch``, ``batches``, ``start_states`` (a finished
    epoch saved as the next one's start) and the replay fields. Untracked: Accelerate's ``iteration``
    and a ``StatefulDataLoader``'s own ``state_dict()``; without one, ``"epoch_only": True`` and a
    :class:`statekit.StatekitWarning` when it may be inside an epoch."""
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
    """What replaying a saved position inside an epoch needs besides its generator states."""
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
    """The state of a loader statekit never tracked (its position inside an epoch is unknown)."""
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
    loader: Any, state: dict[str, Any] | None, name: str | None = None, ranks: list[dict[str, Any]] | None = None,
    epoch_from_step: bool = False,
) -> bool:
    """Put a loader (tracked or not) back at a saved position; the next ``iter(loader)`` continues there.

    Args:
        loader: the loader.
        state: :func:`loader_state` of this rank at save time, or None (saved by fewer ranks).
        name: the loader's checkpoint key (``dataloader_0``), named in warnings.
        ranks: the saved states of every saved rank (index = rank), when known: with another
            world size they plan this rank's rest of the epoch (:mod:`statekit.loaders.elastic`).
        epoch_from_step: the loop derives its epoch from the step (scripts written for
            Accelerate's resume): a save after an epoch's last batch is logged, not warned about.

    Returns:
        False when nothing was restored (``state`` is None and no plan applies).

    Raises:
        StateMismatchError: the world size changed mid-epoch and the epoch cannot continue exactly.
    """
    planned = elastic.plan(ranks, state, elastic.describe(loader, inner_loader(loader), sampler_of(loader)), name or "data loader") if ranks else None
    if planned is not None:  # another world size: this rank yields its share of what no saved rank consumed
        state = {**(state or ranks[0]), "epoch": planned.epoch, "batches": 0, "start_states": planned.start_states}
        elastic.install(loader, inner_loader(loader), planned, sampler_of(loader))
    elif state is None:
        return False
    if state.get("tracked"):
        _restore_tracked(loader, state, name, planned, epoch_from_step)
    else:
        _restore_untracked(loader, state, name)
    return True


def _restore_tracked(loader: Any, state: dict[str, Any], name: str | None, planned: Any, epoch_from_step: bool) -> None:
    """Set a tracked position as the loader's pending one and register it with the resume audit
    (``planned``: this rank's share after a world-size change, or None).
    """
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
        _warn_after_last_batch(loader, state, name, epoch_from_step)
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


def _warn_after_last_batch(loader: Any, state: dict[str, Any], name: str | None, epoch_from_step: bool) -> None:
    """Warn about a save after the epoch's last batch (INFO only where ``epoch_from_step``)."""
    if epoch_from_step:
        logger.info("%s: saved right after the last batch of epoch %d; the next `for batch in loader` starts epoch %s "
                    "(the epoch the script derives from the step)", name or describe(loader), int(state["epoch"]) - 1,
                    state["epoch"])
        return
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
    """Decide a ``skip_first_batches(loader, num_batches)`` call (Accelerate's resume idiom): True
    when ``loader`` holds a restored position skipping exactly ``num_batches`` (0 included), so the
    caller iterates the loader itself (logged at INFO); False when nothing is restored, or the
    restored epoch restarts because the dataset's length changed (Accelerate's skip runs, warned).

    Raises:
        StateMismatchError: a restored position skips another number of batches (skipping on top
            would skip twice, in a redrawn order).
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
            describe(loader),
            reason=f"skip_first_batches({num_batches}) after a statekit resume that already continues epoch "
            f"{position.pending.get('epoch')} at batch {restored}: skipping on top of it would skip twice and redraw "
            "the order; iterate the loader itself (no skip_first_batches needed)",
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
