"""The next-batch record: what a tracked loader yielded right after a save, kept beside the checkpoint.

Written by the save paths once the checkpoint committed (:class:`Witness`,
:func:`claim_witnesses`), read by a resume into the loader's saved position
(:func:`merge_next_batch`), and checked there by :mod:`statekit.checks.audit`. Format:
docs/format.md, "Next-batch records"; design: docs/design-notes.md.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping
from typing import Any

from statekit.checks.audit import content_digest
from statekit.storage.hashing import new_hasher

logger = logging.getLogger("statekit")

NEXT_BATCH_FORMAT = "statekit-next-batch/1"
"""``format`` of a next-batch record written beside a committed checkpoint (:class:`Witness`)."""


class Witness:
    """The content of the first batch a tracked loader yields after a save, written beside the
    committed checkpoint (``next-batch/<key>/rank-<r>.json``) once both the commit and the batch
    happened, bound to the manifest's checksum. Why: docs/design-notes.md, "Data loaders"
    (the next-batch record).

    Args:
        key: the loader's checkpoint key.
        epoch: the epoch of the batch the saved position continues with.
        batch: its number in that epoch.
    """

    def __init__(self, key: str | None, epoch: int, batch: int) -> None:
        self.key, self.epoch, self.batch = key, epoch, batch
        self.target = (epoch, batch)  # the position of the batch to digest
        self.ends_epoch = False
        self.digest: str | None = None
        self._write: Any = None
        self._manifest_checksum: str | None = None
        self._lock = threading.Lock()

    def observe(self, epoch: int, batch: int, value: Any) -> None:
        """The loader yields ``value`` as batch ``batch`` of ``epoch`` (the first batch after
        the save): digest it when it is the saved position's next batch."""
        if (epoch, batch) != self.target:
            return  # the run left the saved position (a loop left with break): nothing to record
        digest = content_digest(value)
        with self._lock:
            self.digest = digest
            ready = self._write is not None and digest is not None
        if ready:
            self._flush()

    def epoch_ended(self, epoch: int, batches: int) -> None:
        """The loader's epoch ``epoch`` ended after ``batches`` batches: when that is the
        saved position, the batch to digest is the next epoch's first (an iterable dataset's
        loader learns that its epoch ended only when it asks for one more batch)."""
        if (epoch, batches) == self.target and not self.ends_epoch:
            self.ends_epoch, self.target = True, (epoch + 1, 0)

    def committed(self, write: Any, manifest_checksum: str | None) -> None:
        """The checkpoint committed: ``write(data: bytes)`` stores the record beside it."""
        with self._lock:
            self._write, self._manifest_checksum = write, manifest_checksum
            ready = self.digest is not None
        if ready:
            self._flush()

    def to_bytes(self) -> bytes:
        """The record's JSON, with an XXH3-64 ``checksum`` over the other fields."""
        body = {"format": NEXT_BATCH_FORMAT, "loader": self.key, "epoch": self.epoch, "batch": self.batch,
                "ends_epoch": self.ends_epoch, "content_digest": self.digest, "manifest_checksum": self._manifest_checksum}
        return json.dumps({**body, "checksum": _record_checksum(body)}, sort_keys=True).encode()

    def _flush(self) -> None:
        with self._lock:
            write, self._write = self._write, None
        if write is None:
            return
        try:
            write(self.to_bytes())
        except Exception as exc:  # the record only makes a later resume checkable: never fail training for it
            logger.warning("resume audit: could not write the next-batch record of %s (%s: %s); a resume from this "
                           "checkpoint is checked by what the save recorded", self.key, type(exc).__name__, exc)


def _record_checksum(body: Mapping[str, Any]) -> str:
    hasher = new_hasher()
    hasher.update(json.dumps(dict(body), sort_keys=True).encode())
    return f"xxh3_64:{hasher.hexdigest()}"


_made_here = threading.local()  # the witnesses made by the save running on this thread, until it claims them


def new_witness(key: str | None, epoch: int, batch: int) -> Witness:
    """A :class:`Witness` for a loader state saved now; the save claims it (:func:`claim_witnesses`)."""
    witness = Witness(key, epoch, batch)
    _made_here.__dict__.setdefault("witnesses", []).append(witness)
    return witness


def claim_witnesses() -> list[Witness]:
    """The witnesses made on this thread since the last call (by the save that just wrote
    its loader states)."""
    claimed = _made_here.__dict__.get("witnesses", [])
    _made_here.witnesses = []
    return claimed


def merge_next_batch(state: Any, data: bytes, manifest_checksum: str | None, where: str) -> None:
    """Add the content digest of a next-batch record (:class:`Witness`) to a loader's saved
    position (``state["next"]``) when it describes that position of that checkpoint.

    Args:
        state: the loader's saved position (what ``loader_state`` returned), changed in place.
        data: the record's bytes.
        manifest_checksum: the loaded checkpoint's manifest checksum.
        where: the record's URL, for the log.
    """
    nxt = state.get("next") if isinstance(state, dict) else None
    if not isinstance(nxt, dict) or nxt.get("content_digest"):
        return
    try:
        record = json.loads(data)
        body = {k: v for k, v in record.items() if k != "checksum"}
        valid = record.get("format") == NEXT_BATCH_FORMAT and record.get("checksum") == _record_checksum(body)
    except (ValueError, AttributeError):
        valid = False
    if not valid:
        logger.warning("resume audit: %s is not a valid next-batch record; ignored", where)
        return
    if record["manifest_checksum"] != manifest_checksum or (record["epoch"], record["batch"]) != (nxt.get("epoch"), nxt.get("batch")):
        return  # another checkpoint's, or another position's
    nxt["content_digest"] = record["content_digest"]
    nxt["content_after_save"] = True
    nxt["ends_epoch"] = bool(record.get("ends_epoch"))
    nxt["missing"] = None if nxt.get("indices_digest") else "indices not recorded (an iterable dataset, or none drawn at save time)"
