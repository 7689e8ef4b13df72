"""The commit: the one manifest builder and the one commit path of every save (native,
attach mode, ``statekit convert``): file entries gathered to rank 0, the manifest built and
written last, atomically (docs/format.md, "Commit protocol"); :func:`agree` makes every
rank raise when one failed, so none waits forever in a collective.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

from statekit import distributed, format as fmt
from statekit._version import __version__
from statekit.checks import audit
from statekit.engine.context import CORE, Checkpoint
from statekit.engine.entries import Entry
from statekit.engine.incremental import is_frozen_file
from statekit.engine.locking import LOCK_NAME
from statekit.errors import StatekitError
from statekit.format.manifest_types import FileEntry, Fingerprint, Manifest, ObjectEntry, Lineage, ResumeAudit, StateDigest
from statekit.storage import Storage


def agree(fn: Any, url: str, broadcast: bool = False) -> Any:
    """Run ``fn()`` on this rank and return its result (rank 0's on every rank when
    ``broadcast``); if any rank failed, every rank raises.

    Raises:
        Exception: this rank's own error, or a :class:`StatekitError` naming the first
            rank that failed and its error.
    """
    rank, world = distributed.rank_and_world_size()
    error: BaseException | None = None
    result = None
    try:
        result = fn()
    except Exception as exc:
        if world == 1:
            raise
        error = exc
    if world == 1:
        return result
    failures = distributed.gather_to_rank0(None if error is None else (rank, f"{type(error).__name__}: {error}"))
    verdict = [f for f in failures or [] if f is not None] if rank == 0 else None
    verdict = distributed.broadcast_from_rank0(verdict)
    if error is not None:
        raise error
    if verdict:
        first_rank, message = verdict[0]
        raise StatekitError(f"{url}: rank {first_rank} failed: {message}")
    return distributed.broadcast_from_rank0(result) if broadcast else result


def gather_files(checkpoint: Checkpoint) -> dict[str, FileEntry] | None:
    """Every rank's :attr:`~statekit.Checkpoint.files`, merged on rank 0 (None on other
    ranks), with the files written around the checkpoint (``record_unlisted_at_commit``)."""
    gathered = distributed.gather_to_rank0(checkpoint.files)
    if checkpoint.rank != 0:
        return None
    for rank_files in gathered or []:
        checkpoint.files.update(rank_files)
    if checkpoint.record_unlisted_at_commit:  # files Accelerate's registered hooks wrote
        checkpoint.record_unlisted(checkpoint.record_unlisted_at_commit)
    return checkpoint.files


def objects_table(
    entries: list[Entry], owners: dict[str, str], files: Mapping[str, FileEntry], distributions: dict[str, str]
) -> dict[str, ObjectEntry]:
    """The manifest's ``objects``: kind, owner, per_rank, the core's files, and for objects
    a plugin owns the distribution to install (``distributions[owner]``)."""
    table = {}
    for e in entries:
        owner = owners.get(e.key, CORE)
        prefix = f"{e.key}/" if e.per_rank else f"{e.key}."
        table[e.key] = ObjectEntry(
            kind=e.kind,
            owner=owner,
            per_rank=e.per_rank,
            files=tuple(sorted(p for p in files if p.startswith(prefix))) if owner == CORE else (),
            owner_distribution=None if owner == CORE else distributions.get(owner) or f"statekit-{owner}",
        )
    return table


def build_manifest(
    checkpoint: Checkpoint,
    files: Mapping[str, FileEntry],
    objects: Mapping[str, ObjectEntry],
    *,
    plugins: dict[str, str],
    metadata: dict[str, Any] | None = None,
    records: dict[str, Any] | None = None,
    fingerprint: Fingerprint | None = None,
    state_digest: StateDigest | None = None,
    saved: Mapping[str, Any] | None = None,
    lineage: Lineage | None = None,
) -> Manifest:
    """The manifest of a checkpoint (format 1, ``docs/format.md``; schema
    ``statekit/manifest.schema.json``).

    ``step`` and ``world_size`` come from ``checkpoint``; ``records`` defaults to its
    records; ``saved`` (every object of the save by key, default ``checkpoint.objects``)
    carries the resume verdict the manifest records. Returns the manifest for :func:`commit`,
    not checksummed yet.
    """
    url = checkpoint.storage.url_of(fmt.MANIFEST_NAME)
    # the verdict of the resume this run continues from, carried by its objects
    resume_audit = audit.summary(checkpoint.objects if saved is None else saved, checkpoint.step)
    split = any(
        entry.owner == CORE and any(is_frozen_file(key, rel) for rel in entry.files) for key, entry in objects.items()
    )
    return Manifest(
        format=fmt.FORMAT_REFERENCED if checkpoint.references else fmt.FORMAT_SPLIT if split else fmt.FORMAT,
        statekit_version=__version__,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z"),
        step=checkpoint.step,
        world_size=checkpoint.world_size,
        plugins=dict(plugins),
        objects=dict(objects),
        records=checkpoint.all_records() if records is None else records,
        files=dict(files),
        metadata=dict(metadata or {}),
        fingerprint=fingerprint,
        resume_audit=None if resume_audit is None else ResumeAudit.from_json(resume_audit, url),
        state_digest=state_digest,
        lineage=lineage,
        references=dict(checkpoint.references) or None,
    )


def commit(storage: Storage, manifest: Manifest, exclusive: bool) -> Manifest:
    """Write the manifest last, atomically, and release the save lock; returns it as
    committed (with its ``manifest_checksum``).

    Raises:
        CheckpointExistsError: ``exclusive`` and the manifest exists.
        StorageError: the storage failed; nothing is committed.
        ValueError: the manifest is not strict JSON.
    """
    manifest, data = manifest.sealed()  # checksums itself
    storage.commit(fmt.MANIFEST_NAME, data, exclusive=exclusive)
    storage.remove(LOCK_NAME)  # committed: the lock has done its job
    return manifest
