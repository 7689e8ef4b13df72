"""The resume audit: every resume checks that its data loaders continue where the saved run stood.

Every save records, per tracked loader inside an epoch, a :class:`NextBatch` (the next batch's
indices, content digest where held, the sampler's epoch) or the batch yielded right after the
save (:mod:`statekit.checks.next_batch`); a resume compares the first batch each restored
loader yields with it (:func:`check_first_batch`) and records a :class:`ResumeVerdict` in
later manifests' ``resume_audit``. Users: docs/concepts.md, "Resume audit"; why and costs:
docs/design-notes.md, "Data loaders" (the resume audit).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from statekit.errors import ResumeAuditError, ResumeAuditWarning, StatekitWarning, warn_user
from statekit.storage.hashing import new_hasher

logger = logging.getLogger("statekit")

HEAD = 8
"""Indices kept in a record for messages (the digest covers all of them)."""

VERIFIED, DIVERGED, UNVERIFIABLE, PENDING = "verified", "diverged", "unverifiable", "pending"
"""A loader's (and a resume's) verdict."""


# --------------------------------------------------------------------------- records


@dataclass
class NextBatch:
    """What a resumed loader must yield next, recorded at save time.

    Attributes:
        epoch: the loader's epoch (statekit's count of passes) the batch belongs to.
        batch: the batch's number in that epoch (0-based).
        indices_digest: XXH3-64 of the batch's sample indices (``repr`` of the list), or None.
        indices_head: the first :data:`HEAD` indices, for messages, or None.
        content_digest: XXH3-64 over the batch's tensors and values, or None when the loader
            did not hold the batch yet.
        sampler_epoch: ``sampler.epoch`` (``DistributedSampler.set_epoch``) or Accelerate's
            ``iteration`` of the loader when the epoch's iterator started, or None.
        missing: why indices or content are not recorded (for the verdict), or None.
        content_after_save: the content digest is that of the batch the saved run yielded
            right after the save (:class:`statekit.checks.next_batch.Witness`), not of a batch held at save time.
        ends_epoch: the saved run's epoch ended at this position (the batch it yielded after
            the save was the next epoch's first: ``content_digest`` is that one's).
    """

    epoch: int
    batch: int
    indices_digest: str | None = None
    indices_head: list[Any] | None = None
    content_digest: str | None = None
    sampler_epoch: int | None = None
    missing: str | None = None
    content_after_save: bool = False
    ends_epoch: bool = False

    def next_epoch(self) -> NextBatch:
        """The record of the next epoch's first batch, for a position that ends its epoch
        (``ends_epoch``: the content digest is that batch's)."""
        return NextBatch(epoch=self.epoch + 1, batch=0, content_digest=self.content_digest, content_after_save=True,
                         missing="indices not recorded (the batch after an epoch's end)")

    def to_json(self) -> dict[str, Any]:
        """The record as a JSON object (stored in the loader's per-rank position file)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> NextBatch | None:
        """The record from :meth:`to_json`'s object, or None for None (older checkpoints)."""
        if not data:
            return None
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def indices_digest(indices: Any) -> tuple[str, list[Any]]:
    """Digest and head of one batch of sample indices.

    Args:
        indices: what the batch sampler yielded (a list of ints, usually).

    Returns:
        ``("xxh3_64:<hex>", first HEAD indices)``; the digest is over ``repr`` of the list.
    """
    one = isinstance(indices, (str, bytes)) or not hasattr(indices, "__iter__")  # a sampler without batching: one index
    items = [_plain(i) for i in ([indices] if one else indices)]
    hasher = new_hasher()
    hasher.update(repr(items).encode())
    return f"xxh3_64:{hasher.hexdigest()}", items[:HEAD]


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # numpy scalars
        return value.item()
    return value if isinstance(value, (int, str, float, bool, type(None))) else repr(value)


def content_digest(batch: Any) -> str | None:
    """XXH3-64 over a batch: tensors and arrays by dtype, shape and bytes; mappings, lists,
    tuples and dataclasses by structure; numbers and strings by ``repr``.

    Args:
        batch: what a data loader yields (tensors on any device: they are copied to the
            host to be hashed; the check runs once per save and once per resume).

    Returns:
        ``"xxh3_64:<hex>"``, or None when the batch holds an object of another kind (it
        cannot be compared by content).
    """
    hasher = new_hasher()
    try:
        _feed(hasher, batch)
    except _NotHashable:
        return None
    return f"xxh3_64:{hasher.hexdigest()}"


class _NotHashable(Exception):
    pass


def _feed(hasher: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        data = value.detach().to("cpu").contiguous()
        hasher.update(f"T{data.dtype}{tuple(data.shape)}".encode())
        if data.numel():
            hasher.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
        return
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.ndarray):
        if value.dtype == object:
            raise _NotHashable
        hasher.update(f"A{value.dtype}{value.shape}".encode())
        hasher.update(numpy.ascontiguousarray(value).tobytes())
        return
    if isinstance(value, (int, float, bool, str, bytes, type(None))) or (numpy is not None and isinstance(value, numpy.generic)):
        hasher.update(f"V{value!r}".encode())
        return
    if isinstance(value, Mapping):
        hasher.update(b"{")
        for key, item in value.items():
            hasher.update(f"K{key!r}".encode())
            _feed(hasher, item)
        hasher.update(b"}")
        return
    if isinstance(value, (list, tuple)):
        hasher.update(b"[")
        for item in value:
            _feed(hasher, item)
        hasher.update(b"]")
        return
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        _feed(hasher, {f.name: getattr(value, f.name) for f in dataclasses.fields(value)})
        return
    raise _NotHashable


# --------------------------------------------------------------------------- verdicts


@dataclass
class LoaderVerdict:
    """One restored loader's verdict.

    Attributes:
        loader: the loader's checkpoint key and classes.
        verdict: ``"verified"``, ``"diverged"``, ``"unverifiable"`` or ``"pending"`` (it has
            not yielded its first batch since the resume).
        detail: the first difference, or why it cannot be verified; for a verified loader,
            what was not checked (``"indices only: content not recorded ..."``), else empty.
    """

    loader: str
    verdict: str
    detail: str = ""


@dataclass
class ResumeVerdict:
    """The verdict of one resume, carried by the loaders it restored into the checkpoints
    saved with them.

    Attributes:
        url: the checkpoint resumed from.
        step: its step (or None).
        strict: ``strict_resume`` of that resume (a divergence raises).
        order: how many resumes this process began up to this one (the newest wins).
        loaders: by checkpoint key.
        state: the state check of the load (``StateVerdict.to_json()`` of
            :mod:`statekit.checks.state_check`), or None.
    """

    url: str
    step: int | None
    strict: bool = False
    order: int = 0
    loaders: dict[str, LoaderVerdict] = field(default_factory=dict)
    positions: dict[str, Any] = field(default_factory=dict, repr=False)  # key -> weakref to the Position
    state: dict[str, Any] | None = None

    @property
    def verdict(self) -> str:
        """``"diverged"``, else ``"pending"``, else ``"verified"``, else ``"unverifiable"`` (with no
        loader restored, the state check decides).
        """
        if not self.loaders and self.state is not None:
            return {"verified": VERIFIED, "mismatch": DIVERGED}.get(self.state["verdict"], UNVERIFIABLE)
        kinds = {v.verdict for v in self.loaders.values()}
        for kind in (DIVERGED, PENDING, VERIFIED):
            if kind in kinds:
                return kind
        return UNVERIFIABLE

    def to_json(self) -> dict[str, Any]:
        """The manifest's ``resume_audit`` object (docs/format.md)."""
        first = next((v for v in self.loaders.values() if v.verdict == DIVERGED), None)
        if first is None:
            first = next((v for v in self.loaders.values() if v.verdict != VERIFIED), None)
        if first is None:  # every loader verified: say what was not checked, if anything
            first = next((v for v in self.loaders.values() if v.detail), None)
        reason = first.detail if first is not None else ""
        if not self.loaders:
            reason = "no tracked data loader was restored"
            if self.state is not None:
                reason = f"state check: {self.state['detail']}; {reason}"
        out = {
            "resumed_from": {"url": self.url, "step": self.step},
            "verdict": self.verdict,
            "detail": reason,
            "loaders": {key: {"verdict": v.verdict, "detail": v.detail} for key, v in self.loaders.items()},
        }
        if self.state is not None:
            out["state"] = dict(self.state)
        return out


_loading: ResumeVerdict | None = None  # the verdict of the load running now (set by begin())
_resumes = 0  # resumes begun in this process: the newest verdict wins when several apply


def begin(url: str, step: int | None, strict: bool = False) -> ResumeVerdict:
    """Start the verdict of a resume, before its loaders are restored; the loaders restored by
    this load carry it (``position.resume_verdict``) into the checkpoints saved with them.

    Args:
        url: the checkpoint's URL.
        step: its step.
        strict: ``strict_resume``.
    """
    global _loading, _resumes
    _resumes += 1
    _loading = ResumeVerdict(url=url, step=step, strict=strict, order=_resumes)
    return _loading


def state_checked(url: str, step: int | None, state: dict[str, Any], objects: list[Any]) -> None:
    """Record a load's state check in its resume's verdict (``resume_audit.state``); a load that
    restored no loader begins a verdict carried by the loaded objects.

    Args:
        url: the checkpoint's URL.
        step: its step.
        state: ``StateVerdict.to_json()``.
        objects: the objects the load restored.
    """
    verdict = _loading
    if verdict is None or verdict.url != url:
        verdict = begin(url, step)
    verdict.state = dict(state)
    for obj in objects:
        if "_statekit_position" not in getattr(obj, "__dict__", {}):  # (a loader's verdict rides on its position)
            with contextlib.suppress(TypeError):  # an object that takes no weak reference carries nothing
                key = id(obj)
                _carried[key] = (weakref.ref(obj, lambda _, key=key: _carried.pop(key, None)), verdict)


_carried: dict[int, tuple[weakref.ref[Any], ResumeVerdict]] = {}
"""The verdict each loaded object (not a loader) carries into the checkpoints saved with it,
by the object's identity: kept beside the object, not in it (an LR scheduler's
``state_dict()`` is its ``__dict__``; a tensor's ``==`` is element-wise)."""


def _carried_by(obj: Any) -> ResumeVerdict | None:
    position = vars(obj).get("_statekit_position") if hasattr(obj, "__dict__") else None
    if position is not None:
        return getattr(position, "resume_verdict", None)
    ref, verdict = _carried.get(id(obj), (None, None))
    return verdict if ref is not None and ref() is obj else None


def restored(name: str, position: Any, record: NextBatch | None, why_not: str | None, checked_later: bool = False) -> None:
    """Note that a loader was restored by the running load: pending, or unverifiable (``why_not``).

    Args:
        name: the loader's checkpoint key.
        position: its ``Position``.
        record: what the saved run was about to yield, or None.
        why_not: why it cannot be verified, or None.
        checked_later: the first batch is still compared with the record; False: nothing
            will be checked, and a :class:`statekit.StatekitWarning` says so now.
    """
    verdict = _loading
    if verdict is None:
        return
    if record is None or why_not:
        detail = why_not or "the checkpoint holds no record of the next batch"
        verdict.loaders[name] = LoaderVerdict(name, UNVERIFIABLE, detail)
        if not checked_later:
            at = f"step {verdict.step}" if verdict.step is not None else "the resume"
            _warn_unverifiable(name, at, detail)
    else:
        verdict.loaders[name] = LoaderVerdict(name, PENDING)
    verdict.positions[name] = weakref.ref(position)
    position.resume_verdict = verdict


def check_first_batch(
    verdict: ResumeVerdict | None, name: str, label: str, record: NextBatch, indices: Any, has_indices: bool, batch: Any,
    epoch_now: int | None,
) -> None:
    """Compare the first batch a restored loader yields with the saved record.

    Args:
        verdict: the resume's verdict the loader carries (None: a restore outside a load).
        name: the loader's checkpoint key.
        label: its name in messages.
        record: what the saved run was about to yield.
        indices: the indices the resumed iterator drew for it (when ``has_indices``).
        batch: the batch it yields.
        epoch_now: the sampler's epoch / Accelerate ``iteration`` now, or None.

    Warns:
        ResumeAuditWarning: the batch differs from the record (not under ``strict_resume``).

    Raises:
        ResumeAuditError: the batch differs, under ``strict_resume=True``.
    """
    at = f"step {verdict.step}" if verdict is not None and verdict.step is not None else "the resume"
    difference = _first_batch_difference(record, indices, has_indices, batch, epoch_now)
    if verdict is not None:
        if difference is None:
            _continued(verdict, name, label, record, has_indices, at)
        else:
            verdict.loaders[name] = LoaderVerdict(name, DIVERGED, difference)
    if difference is None:
        logger.info("resume audit: %s continues as recorded (batch %d of epoch %d)", label, record.batch, record.epoch)
        return
    message = f"resume audit: {label} after the resume from {at} does not continue where the saved run stood: {difference}"
    if verdict is not None and verdict.strict:
        raise ResumeAuditError(message)
    warn_user(message, ResumeAuditWarning)


def _first_batch_difference(record: NextBatch, indices: Any, has_indices: bool, batch: Any, epoch_now: int | None) -> str | None:
    """How the resumed loader's first batch differs from the record, first found first: the
    epoch it was consumed in, its indices, its content; None when it does not."""
    if record.sampler_epoch is not None and epoch_now is not None and epoch_now != record.sampler_epoch:
        return (
            f"the restored position of epoch {record.sampler_epoch} (batch {record.batch}) was consumed in epoch "
            f"{epoch_now} (the sampler's set_epoch / the loader's iteration)"
        )
    if record.indices_digest is not None and has_indices:
        digest, head = indices_digest(indices)
        if digest != record.indices_digest:
            return f"expected indices {_show(record.indices_head)} as batch {record.batch} of epoch {record.epoch}, got {_show(head)}"
    if record.content_digest is not None:
        return _content_difference(record, batch, has_indices)
    return None


def _content_difference(record: NextBatch, batch: Any, has_indices: bool) -> str | None:
    """How the batch's content differs from the recorded content, or None (equal, or not digestible)."""
    actual = content_digest(batch)
    if actual is None or actual == record.content_digest:
        return None
    if record.indices_digest is not None and has_indices:
        return (
            f"batch {record.batch} of epoch {record.epoch} has the recorded indices"
            f"{' ' + _show(record.indices_head) if record.indices_head else ''} but other content: the dataset or "
            "sampler draws from random state no plugin restores (register it with accelerator.register_for_checkpointing, "
            "or seed it from the loader's generators)"
        )
    seen = ("the batch the saved run yielded right after the save" if record.content_after_save
            else "the batch the loader held at save time")
    return (
        f"batch {record.batch} of epoch {record.epoch} differs in content from {seen} (no sample indices "
        "were compared): the dataset's position, order or random state was not restored as saved (a "
        "dataset's load_state_dict, its set_epoch, or random draws no plugin restores)"
    )


def _continued(verdict: ResumeVerdict, name: str, label: str, record: NextBatch, has_indices: bool, at: str) -> None:
    """The loader's verdict when its first batch showed no difference: verified by what the
    record let compare (and what it did not), or unverifiable (warned) when nothing was."""
    checked = "indices" if record.indices_digest is not None and has_indices else ""
    if record.content_digest is not None:
        checked = f"{checked} and content" if checked else "content"
    partial = f"{checked} only: {record.missing}" if checked and record.missing else ""  # what was not checked
    verdict.loaders[name] = (
        LoaderVerdict(name, VERIFIED, partial)
        if checked
        else LoaderVerdict(name, UNVERIFIABLE, record.missing or "neither the indices nor the content of the next batch were recorded")
    )
    if not checked:
        _warn_unverifiable(label, at, verdict.loaders[name].detail)


AT_EPOCH_BOUNDARY = "saved at an epoch boundary: the next epoch's order is drawn when it starts"
"""Why a loader saved between two passes (an evaluation loader, a save after an epoch's
``for`` loop) has no record of its next batch. Nothing of the resume is in doubt there (the
order is drawn from the restored generators when the pass starts), so it is logged, not warned."""


def _warn_unverifiable(label: str, at: str, reason: str) -> None:
    message = f"resume audit: {label} after the resume from {at} cannot be verified: {reason}"
    if reason == AT_EPOCH_BOUNDARY:
        logger.info("%s", message)
        return
    warn_user(message, StatekitWarning)


def ended_in_saved_run(verdict: ResumeVerdict | None, name: str, label: str, record: NextBatch) -> None:
    """The saved run's epoch ended at the saved position (``record.ends_epoch``), but the
    resumed epoch yields another batch there.

    Warns:
        ResumeAuditWarning: always (the verdict becomes ``"diverged"``).

    Raises:
        ResumeAuditError: under ``strict_resume=True``.
    """
    detail = (f"the saved run's epoch {record.epoch} ended after batch {record.batch - 1}, but the resumed epoch yields "
              f"another batch there (the dataset's position was not restored as saved)")
    _diverged(verdict, name, label, detail)


def _diverged(verdict: ResumeVerdict | None, name: str, label: str, detail: str) -> None:
    if verdict is not None:
        verdict.loaders[name] = LoaderVerdict(name, DIVERGED, detail)
    at = f"step {verdict.step}" if verdict is not None and verdict.step is not None else "the resume"
    message = f"resume audit: {label} after the resume from {at}: {detail}"
    if verdict is not None and verdict.strict:
        raise ResumeAuditError(message)
    warn_user(message, ResumeAuditWarning)


def nothing_yielded(verdict: ResumeVerdict | None, name: str, label: str, record: NextBatch) -> None:
    """A restored loader's resumed epoch ended without yielding the batch ``record.batch`` the
    saved run was about to yield.

    Warns:
        ResumeAuditWarning: always (the verdict becomes ``"diverged"``).

    Raises:
        ResumeAuditError: under ``strict_resume=True``.
    """
    detail = f"the resumed epoch {record.epoch} ended without yielding batch {record.batch}, which the saved run was about to yield"
    _diverged(verdict, name, label, detail)


def never_consumed(verdict: ResumeVerdict, step: int | None) -> None:
    """At a save: name each loader restored by ``verdict``'s resume whose position the run never
    consumed.

    Args:
        verdict: the resume's verdict.
        step: the step being saved (a save at the resumed step itself is not a sign).

    Warns:
        ResumeAuditWarning: one per such loader (and its verdict becomes ``"diverged"``).

    Raises:
        ResumeAuditError: such a loader, under ``strict_resume=True`` (the save commits nothing).
    """
    if step is None or step == verdict.step:
        return
    for name, ref in list(verdict.positions.items()):
        position = ref()
        entry = verdict.loaders.get(name)
        if position is None or entry is None or entry.verdict not in (PENDING, UNVERIFIABLE):
            continue
        pending = getattr(position, "pending", None)
        if pending is None or getattr(position, "resume_verdict", None) is not verdict:
            continue
        if not pending.get("batches") and pending.get("epoch_rng") is None:
            # saved outside an epoch (an evaluation loader the loop iterates only now and then):
            # the uninterrupted run had not iterated it since the save either
            continue
        detail = (
            f"the restored position (epoch {pending.get('epoch')}, batch {pending.get('batches')}) was never consumed: "
            f"the run reached step {step} without iterating this loader (was it replaced by another loader object?)"
        )
        verdict.loaders[name] = LoaderVerdict(name, DIVERGED, detail)
        del verdict.positions[name]
        message = f"resume audit: {position.name or name} after the resume from step {verdict.step}: {detail}"
        if verdict.strict:
            raise ResumeAuditError(message)
        warn_user(message, ResumeAuditWarning)


def summary(objects: Mapping[str, Any], step: int | None) -> dict[str, Any] | None:
    """The manifest's ``resume_audit`` for a checkpoint saved now: the verdict of the newest
    resume that restored one of its loaders, or None (never-consumed positions named first).

    Args:
        objects: the saved objects by key (data loaders among them carry their resume's verdict).
        step: the step being saved.
    """
    verdicts = [v for v in map(_carried_by, objects.values()) if v is not None]
    if not verdicts:
        return None
    verdict = max(verdicts, key=lambda v: v.order)
    never_consumed(verdict, step)
    return verdict.to_json()


def _show(indices: list[Any] | None) -> str:
    if indices is None:
        return "(not recorded)"
    text = ", ".join(repr(i) for i in indices[:HEAD])
    return f"[{text}{', ...' if len(indices) >= HEAD else ''}]"
