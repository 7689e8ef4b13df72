"""Checkpoints under a manager root: naming (``checkpoint-<step:08d>``, and Accelerate's
``checkpoint_<n>`` of a migrating run), listing, and deletion (manifest first).

A ``checkpoint-<step>`` name (any number of digits: Trainer names its folders
``checkpoint-500``) says nothing of who wrote the folder: the listing decides by content
(:func:`statekit.foreign.detect.folder_kind`, :attr:`CheckpointDir.kind`). Folders statekit
did not write (a Trainer, Accelerate or DCP checkpoint, unknown contents) are listed but
never counted as committed, never resumed and never deleted.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from statekit import format as fmt
from statekit.errors import CheckpointInUseError, InvalidOptionError, StatekitError, StatekitWarning, warn_user
from statekit.engine.locking import remove_owned
from statekit.foreign import accelerate as accelerate_format
from statekit.foreign.detect import FOREIGN_KINDS, describe_folder, describe_kind, folder_kind
from statekit.format.manifest import read_manifest
from statekit.format.manifest_types import Lineage
from statekit.storage import Storage
from statekit.storage.inuse import refuse_if_in_use

_ACCELERATE_NAME = re.compile(r"^checkpoint_(\d+)$")  # ProjectConfiguration(automatic_checkpoint_naming=True)
LATEST_NAME = "latest"


@dataclass(frozen=True)
class CheckpointDir:
    """One checkpoint directory under a manager root, as a listing reports it (committed or
    not). Not to be confused with :class:`statekit.Checkpoint`, the context one save or load
    works through (what hooks receive as ``checkpoint``).

    Attributes:
        step: the step in its name.
        url: its URL.
        committed: True if its manifest exists.
        created: UTC ISO 8601 time from the manifest (None if not committed).
        size_bytes: total bytes listed in the manifest (None if not committed).
        metrics: the ``metrics`` given to ``save`` (from the manifest metadata).
        accelerate: True for a ``checkpoint_<n>`` folder of Accelerate's automatic
            naming (``step`` is then ``n``); committed means it has a manifest (attach
            mode) or Accelerate's files.
        resume_audit: the verdict of the resume the saving run continued from (the
            manifest's ``resume_audit``: ``verdict``, ``detail``, ``resumed_from``,
            ``loaders``; :mod:`statekit.checks.audit`), or None when it did not resume.
        written_bytes: bytes its save wrote: ``size_bytes`` less the files an incremental
            save reused from an earlier checkpoint (None if not committed).
        kind: what the folder is, by its contents (:data:`statekit.foreign.detect.FOLDER_KINDS`):
            ``"statekit"`` (committed: ``statekit.json``), ``"incomplete"`` (statekit's save
            lock and no manifest: a save that failed or was killed, or an interrupted
            deletion; ``statekit gc`` removes it), or a folder statekit did not write:
            ``"trainer"`` (a transformers Trainer checkpoint), ``"accelerate"``
            (``Accelerator.save_state``; committed for Accelerate's own ``checkpoint_<n>``
            naming, which a migrating run resumes), ``"dcp"``, ``"unknown"`` (other contents,
            or empty). Left out, it follows from ``committed`` and ``accelerate``.
        lineage: the manifest's :class:`~statekit.format.Lineage` (run, branch, parent),
            or None (not committed, not read, or written before lineage existed).
    """

    step: int
    url: str
    committed: bool
    created: str | None = None
    size_bytes: int | None = None
    metrics: dict[str, Any] | None = None
    accelerate: bool = False
    resume_audit: dict[str, Any] | None = None
    written_bytes: int | None = None
    kind: str = ""
    lineage: Lineage | None = None

    def __post_init__(self) -> None:
        if not self.kind:  # built by hand (a plugin, a test): what committed and accelerate say
            kind = "accelerate" if self.accelerate else "statekit" if self.committed else "incomplete"
            object.__setattr__(self, "kind", kind)

    @property
    def name(self) -> str:
        """The directory's name (``checkpoint-<step>``, or Accelerate's ``checkpoint_<n>``)."""
        return self.url.rstrip("/").rsplit("/", 1)[-1]

    @property
    def foreign(self) -> bool:
        """True for a folder statekit did not write (:data:`statekit.foreign.detect.FOREIGN_KINDS`)."""
        return self.kind in FOREIGN_KINDS

    @property
    def description(self) -> str:
        """:attr:`kind` in words (``"a transformers Trainer checkpoint"``)."""
        return describe_kind(self.kind)


"""Former name of :class:`CheckpointDir`, kept importable from ``statekit``."""


DEFAULT_STEP_DIGITS = 8


def checkpoint_name(step: int, digits: int = DEFAULT_STEP_DIGITS, suffix: str = "") -> str:
    """Directory name of a step: ``checkpoint-00000500`` (``digits=0``: ``checkpoint-500``,
    transformers Trainer's name); with ``suffix``, ``checkpoint-00000500.<suffix>`` (a
    branch's save whose plain name an abandoned checkpoint holds, ``docs/concepts.md``,
    Lineage)."""
    name = f"checkpoint-{str(int(step)).zfill(digits)}"
    return f"{name}.{suffix}" if suffix else name


def refuse_checkpoint_as_root(root: Storage) -> None:
    """Refuse a manager root that is itself a checkpoint (it holds ``statekit.json``, or
    the files of ``Accelerator.save_state``): saves would nest ``checkpoint-<step>``
    folders inside it and a resume would never find it. A folder *holding* checkpoints
    (``checkpoint-<step>``, Accelerate's ``checkpoint_<n>``) is a root.

    Args:
        root: the manager root.

    Raises:
        InvalidOptionError: naming the root, what it holds, and what to pass instead.
    """
    names = root.listdir()
    if fmt.MANIFEST_NAME in names:
        what = f"a statekit checkpoint (it holds {fmt.MANIFEST_NAME})"
    elif accelerate_format.accelerate_files(names) and accelerate_format.is_accelerate_checkpoint(root):
        what = "a checkpoint written by Accelerator.save_state"
    else:
        return
    parent = root.url.rstrip("/").rsplit("/", 1)[0]
    raise InvalidOptionError(
        f"root_url {root.url!r} is {what}, not a root holding checkpoints: pass the folder to keep "
        f"checkpoint-<step> folders in (its parent {parent!r}, for example) as the CheckpointManager "
        f"root, or load this one with statekit.load_state(accelerator, {root.url!r})"
    )


def list_checkpoints(
    root_url: str | os.PathLike[str] | Storage, storage_options: dict[str, Any] | None = None, details: bool = True
) -> list[CheckpointDir]:
    """Every checkpoint directory under a root, oldest first.

    ``checkpoint-<step>`` directories (any number of digits) are the manager's, or a
    Trainer's; ``checkpoint_<n>`` folders are Accelerate's automatic naming (a run
    migrating to statekit), listed before the others (a migrated run writes its statekit
    checkpoints after them), by ``n``. Each is classified by content
    (:attr:`CheckpointDir.kind`): only a statekit manifest (or, for ``checkpoint_<n>``,
    Accelerate's files) makes one committed.

    Args:
        root_url: the manager root: a URL, or a :class:`~statekit.storage.Storage`
            (carrying its options; its filesystem is reused).
        storage_options: fsspec options of a URL (None with a ``Storage``).
        details: read each manifest (created, size, metrics); otherwise only check it exists.

    Returns:
        :class:`CheckpointDir` per directory, committed or not, foreign ones included.

    Raises:
        StorageError: the root cannot be listed.
    """
    root = Storage.of(root_url, storage_options)
    root.invalidate()
    infos = []
    for name in root.listdir():
        match = fmt.CHECKPOINT_DIR_NAME.match(name) or _ACCELERATE_NAME.match(name)
        if not match:
            continue
        child = root.child(name)
        step = int(match.group(1))
        accelerate = match.re is _ACCELERATE_NAME
        if not child.exists(fmt.MANIFEST_NAME):
            kind = folder_kind(child)
            committed = accelerate and kind != "incomplete" and accelerate_format.is_accelerate_checkpoint(child)
            infos.append(CheckpointDir(step, child.url, committed, accelerate=accelerate,
                                       kind="accelerate" if committed else kind))
            continue
        if not details:
            infos.append(CheckpointDir(step, child.url, True, accelerate=accelerate, kind="statekit"))
            continue
        try:
            manifest = read_manifest(child)
        except StatekitError:
            infos.append(CheckpointDir(step, child.url, True, accelerate=accelerate, kind="statekit"))
            continue
        infos.append(
            CheckpointDir(
                step,
                child.url,
                True,
                manifest.created,
                manifest.size_bytes,
                manifest.metadata.get("metrics"),  # the user's metadata: plain JSON
                accelerate,
                manifest.resume_audit.to_json() if manifest.resume_audit is not None else None,  # a flat, JSON-able record
                manifest.written_bytes,
                kind="statekit",
                lineage=manifest.lineage,
            )
        )
    return sorted(infos, key=lambda i: (not i.accelerate, i.step, i.name))


def delete_checkpoint(
    url: str | Storage, storage_options: dict[str, Any] | None = None, *, force: bool = False
) -> None:
    """Delete one checkpoint directory statekit wrote: its manifest first (so it stops
    counting as committed even if the rest of the deletion is interrupted), then everything
    under it, under a stale lock that marks what an interruption leaves as statekit's
    (:func:`statekit.engine.locking.remove_owned`).

    Args:
        url: the checkpoint directory: a URL, or a :class:`~statekit.storage.Storage`.
        storage_options: fsspec options of a URL.
        force: delete even if a live process reads it in place.

    Raises:
        CheckpointInUseError: a live in-use marker is present (see :mod:`statekit.storage.inuse`).
        StatekitError: the directory is not statekit's (no manifest, no statekit lock: a
            Trainer, Accelerate or DCP checkpoint, or other contents); nothing is deleted.
    """
    storage = Storage.of(url, storage_options)
    url = storage.url
    if not force:
        refuse_if_in_use(url, "delete")
    storage.invalidate()
    kind = folder_kind(storage)
    if kind in FOREIGN_KINDS:
        raise StatekitError(f"{url} is {describe_folder(storage, kind)}, not written by statekit: not deleted")
    remove_owned(storage)


def delete_all_but(
    committed: list[CheckpointDir], keep: set[str | None], storage_options: dict[str, Any] | None, what: str = "retention"
) -> list[str]:
    """Delete every checkpoint of ``committed`` whose URL is not in ``keep`` (retention's
    one deletion loop, both tiers); one a live process uses is kept with a warning. Only
    statekit checkpoints (``kind == "statekit"``) are deleted: a folder statekit did not
    write is never a candidate, whatever the caller passes.

    Args:
        committed: the candidates.
        keep: URLs to keep.
        storage_options: fsspec options of their root.
        what: names the policy in the warning.

    Returns:
        The names of the deleted checkpoints.
    """
    deleted = []
    for info in committed:
        if info.kind != "statekit":  # only statekit's committed checkpoints: never a folder it did not write
            continue
        if info.url not in keep:
            try:
                delete_checkpoint(info.url, storage_options)
                deleted.append(info.name)
            except CheckpointInUseError as exc:
                warn_user(f"{what} kept {info.url}: {exc}", StatekitWarning)
    return deleted
