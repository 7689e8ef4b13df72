"""The save lock: one saver owns a checkpoint directory from its first file to its commit.

``.statekit-lock`` is created exclusively (a hard link of a written temporary file on local
disk; a conditional PUT on object stores) before any file is written, and removed after
the commit. A second saver of the same directory gets :class:`CheckpointExistsError`
instead of clearing the first one's files as "leftovers". A lock is stale when its
process is gone (same host) or older than :data:`LOCK_TIMEOUT_S` (another host), or when
it is marked failed (a save that failed, :func:`abandon_save`) or deleting (an interrupted
:func:`remove_owned`).

The lock is also statekit's proof of ownership: a directory without a manifest is
statekit's to clear only while it holds the lock; one that holds other files and no lock
(a Trainer or DCP checkpoint of the same name) is never cleared (:func:`prepare_target`).
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from typing import Any, Callable

from statekit import format as fmt
from statekit.errors import CheckpointExistsError, StatekitError
from statekit.storage import Storage
from statekit.storage.inuse import MARKER_PREFIX, refuse_if_in_use

LOCK_NAME = ".statekit-lock"
"""Created exclusively by the saver that owns a checkpoint directory until it commits."""

LOCK_TIMEOUT_S = 900.0
"""A lock of another host older than this (seconds) is taken to be left by a crashed save."""

_PROCESS_TOKEN = uuid.uuid4().hex
"""Written into this process's locks: a lock naming this host and pid but another token
was left by an earlier process that had the same pid (a restarted container: a new PID
namespace gives the same pids again), which is gone."""


def is_statekit_bookkeeping(name: str) -> bool:
    """True for the names statekit keeps in a directory for itself, not as checkpoint content:
    the save lock (and the temporary file that creates it), in-use markers.

    Args:
        name: a name directly in a checkpoint directory.

    Returns:
        Whether it is statekit's bookkeeping.
    """
    return name.startswith((LOCK_NAME, MARKER_PREFIX))


def prepare_target(storage: Storage, overwrite: bool, describe: Callable[[Storage], str] | None = None) -> None:
    """Own the directory for this save: refuse a committed checkpoint (unless
    ``overwrite``), take the lock, clear leftovers of a crashed statekit save.

    Only what statekit wrote is ever removed: a committed checkpoint (its manifest) being
    overwritten, or a directory holding statekit's lock (a save that failed or was killed,
    a deletion that was interrupted; :func:`abandon_save`, :func:`remove_owned`). A
    directory with neither that holds anything else (a Trainer or DCP checkpoint of the same
    name, files of the user) is refused, with or without ``overwrite``: nothing is deleted.

    Args:
        storage: the checkpoint directory.
        overwrite: replace a committed statekit checkpoint, or take over a live lock.
        describe: names what a refused directory holds (``statekit.foreign.detect.describe_folder``,
            from a layer above); None lists its entries.

    Raises:
        CheckpointExistsError: committed and not ``overwrite``; another live save holds
            the lock (two processes saving the same step: exactly one commits); or the
            directory holds files statekit did not write (names the directory and what it holds).
        CheckpointInUseError: ``overwrite`` and a live process reads the checkpoint in place.
    """
    storage.invalidate()
    if overwrite:
        refuse_if_in_use(storage.url, "overwrite")
    committed = storage.exists(fmt.MANIFEST_NAME)
    if committed and not overwrite:
        raise CheckpointExistsError(
            f"{storage.url} already holds a committed checkpoint; pass overwrite=True to replace it"
        )
    lock = _lock_record()
    if storage.create_exclusive(LOCK_NAME, lock):
        if committed:  # uncommit first, under our lock: a crash below leaves statekit's lock, no half checkpoint
            storage.remove(fmt.MANIFEST_NAME)
        else:
            _refuse_foreign(storage, describe)
        for name in storage.listdir():  # a crashed save's leftovers (or the overwritten checkpoint)
            if not name.startswith(LOCK_NAME):  # (another saver's lock attempt is not ours to remove)
                _remove_entry(storage, name)
        return
    holder = _lock_holder(storage)
    if not overwrite and holder is not None and holder.get("alive", True):
        ours = holder.get("host") == socket.gethostname() and holder.get("pid") == os.getpid()
        if ours and holder.get("token") in (None, _PROCESS_TOKEN):
            who = "another save of this process (a second thread, or an async save still writing)"
        else:
            who = f"another process ({holder.get('host')} pid {holder.get('pid')})"
        age = time.time() - holder.get("created", time.time())
        raise CheckpointExistsError(
            f"{storage.url} is being saved by {who}, started {age:.0f} s ago; pass overwrite=True to take over"
        )
    _clear_owned(storage)  # a crashed save's leftovers (or overwrite): start clean
    storage.remove(LOCK_NAME)
    if not storage.create_exclusive(LOCK_NAME, lock):
        raise CheckpointExistsError(f"{storage.url} is being saved by another process that started just now")


def _refuse_foreign(storage: Storage, describe: Callable[[Storage], str] | None) -> None:
    """Under the lock just taken in a directory without manifest or lock: refuse it if it
    holds anything but statekit's bookkeeping (statekit did not write it), releasing the lock."""
    content = [n for n in storage.listdir() if not is_statekit_bookkeeping(n)]
    if not content:
        return
    storage.remove(LOCK_NAME)
    if describe is not None:
        what = describe(storage)
    else:
        what = "files " + ", ".join(repr(n) for n in content[:5]) + (", ..." if len(content) > 5 else "")
    raise CheckpointExistsError(
        f"{storage.url} holds {what}, not written by statekit (no {fmt.MANIFEST_NAME}, no {LOCK_NAME}); statekit "
        "never deletes what it did not write, even with overwrite=True: save to another directory, or move it away"
    )


def remove_owned(storage: Storage) -> None:
    """Delete a directory statekit wrote (a committed checkpoint, or an incomplete save) so
    that an interruption leaves it recognisably statekit's: a stale lock first (marked
    ``deleting``), then the manifest (it stops counting as committed), then every other
    entry, the lock last. A later ``statekit gc`` finds the lock and finishes the job.

    Args:
        storage: the directory.

    Raises:
        StorageError: the storage failed (what was not removed yet stays, under the lock).
    """
    storage.write_bytes(LOCK_NAME, json.dumps({**json.loads(_lock_record()), "failed": True, "deleting": True}).encode())
    _clear_owned(storage)
    storage.remove_tree()


def _clear_owned(storage: Storage) -> None:
    """Remove the manifest, then every entry but the lock (removed by the caller, last)."""
    storage.remove(fmt.MANIFEST_NAME)
    for name in storage.listdir():
        if not name.startswith(LOCK_NAME):
            _remove_entry(storage, name)


def abandon_save(storage: Storage, rank: int) -> None:
    """A save that failed before its commit: rank 0 leaves the lock in place, marked failed
    (:func:`mark_save_failed`), so what the save wrote stays recognisably statekit's: ``statekit
    gc`` removes it and the next save into the directory takes it over. A directory another
    saver committed meanwhile (an exclusive commit this save lost) is left as it is.

    Args:
        storage: the checkpoint directory.
        rank: this process's rank (only rank 0 owns the lock).
    """
    if rank != 0:
        return
    try:
        if storage.exists(fmt.MANIFEST_NAME):
            return
    except StatekitError:
        pass  # the storage is failing: try to mark it anyway
    mark_save_failed(storage)


def mark_copy_in_progress(storage: Storage) -> None:
    """Put this process's lock in a directory a copy is filling (a checkpoint replicated to
    the remote tier): ``statekit gc`` keeps a directory with a live lock, so it does not
    delete a copy in progress; :func:`release_lock` removes it after the copy's commit.
    Not exclusive: a copy redone after a failed try rewrites it."""
    storage.write_bytes(LOCK_NAME, _lock_record())


def end_copy_in_progress(storage: Storage) -> None:
    """Remove the lock :func:`mark_copy_in_progress` put in a copy's directory, after the
    copy's commit (a storage failing now is left alone: a later ``statekit gc`` finds the
    lock stale).

    Args:
        storage: the directory the copy filled.
    """
    release_lock(storage, 0)


def lock_accelerate_save(storage: Storage) -> None:
    """Own a directory that ``Accelerator.save_state`` is about to write (attach mode), as
    :func:`prepare_target` owns one for a native save: take the save lock, then uncommit
    a checkpoint an earlier save committed there (Accelerate overwrites its files in
    place). Until the manifest is committed, a load finds the lock and no manifest and
    refuses the directory (:class:`IncompleteCheckpointError`), instead of reading it as a
    plain Accelerate folder with half-written files. Nothing is cleared: the directory
    is the user's, and Accelerate overwrites what it writes.

    Args:
        storage: the directory Accelerate writes.

    Raises:
        CheckpointExistsError: another live save holds the directory's lock.
    """
    storage.invalidate()
    if not storage.create_exclusive(LOCK_NAME, _lock_record()):
        holder = _lock_holder(storage)
        if holder is not None and holder.get("alive", True):
            raise CheckpointExistsError(
                f"{storage.url} is being saved by another save (host {holder.get('host')} pid {holder.get('pid')}); "
                "two saves into one directory would mix their files"
            )
        storage.write_bytes(LOCK_NAME, _lock_record())  # a failed or crashed save's lock
    if storage.exists(fmt.MANIFEST_NAME):
        storage.remove(fmt.MANIFEST_NAME)


def mark_save_failed(storage: Storage) -> None:
    """Leave a failed save's lock in place, marked failed (stale at once): the directory
    (with what the save wrote) stays unloadable and recognisably statekit's, ``statekit gc``
    removes it, and the next save into it takes the lock over (:func:`prepare_target`,
    :func:`lock_accelerate_save`). Called by :func:`abandon_save` and by attach mode; a failing storage leaves
    the lock as it was (stale once this process is gone).

    Args:
        storage: the checkpoint directory.
    """
    try:
        storage.write_bytes(LOCK_NAME, json.dumps({**json.loads(_lock_record()), "failed": True}).encode())
    except StatekitError:
        pass  # the storage is failing: the lock stays as it was, stale once this process is gone


def _lock_record() -> bytes:
    """The lock's JSON: who holds it (host, pid, this process's token) and since when
    (seconds since the epoch)."""
    return json.dumps(
        {"host": socket.gethostname(), "pid": os.getpid(), "token": _PROCESS_TOKEN, "created": time.time()}
    ).encode()


def release_lock(storage: Storage, rank: int) -> None:
    """Remove the lock (rank 0 only), after a commit or a copy's end; a failing storage
    leaves it, stale once this process is gone.

    Args:
        storage: the checkpoint directory.
        rank: this process's rank.
    """
    if rank == 0:
        try:
            storage.remove(LOCK_NAME)
        except StatekitError:
            pass  # the storage is failing; a later save finds the lock stale


def live_save_lock(storage: Storage) -> dict[str, Any] | None:
    """The holder of ``storage``'s save lock when a save is (or may still be) in progress:
    a live process on this host, or another host's lock younger than
    :data:`LOCK_TIMEOUT_S`; None when there is no lock or it is stale.

    Args:
        storage: a checkpoint directory.

    Returns:
        The lock's JSON (``host``, ``pid``, ``created``), or None.
    """
    holder = _lock_holder(storage)
    return holder if holder is not None and holder.get("alive", True) else None


def _remove_entry(storage: Storage, name: str) -> None:
    child = storage.child(name)
    if storage.fs.isdir(child.path):
        child.remove_tree()
    else:
        storage.remove(name)


def _lock_holder(storage: Storage) -> dict[str, Any] | None:
    """Who holds the lock, with ``alive`` False when it is certainly stale."""
    try:
        holder = json.loads(storage.read_bytes(LOCK_NAME))
    except FileNotFoundError:
        return None
    except (ValueError, StatekitError):
        holder = None
    if isinstance(holder, dict) and holder.get("failed"):
        return {**holder, "alive": False}  # left by a save that failed (mark_save_failed)
    if not isinstance(holder, dict):  # unreadable: alive unless the file is old
        try:
            age = time.time() - storage.fs.modified(storage.path_of(LOCK_NAME)).timestamp()
        except Exception:  # noqa: BLE001 - no modification time on this store
            age = 0.0
        return {"host": "?", "pid": "?", "created": time.time() - age, "alive": age < LOCK_TIMEOUT_S}
    age = time.time() - float(holder.get("created", 0))
    if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
        try:
            os.kill(holder["pid"], 0)
            if holder["pid"] == os.getpid() and holder.get("token") not in (None, _PROCESS_TOKEN):
                holder["alive"] = False  # an earlier process with this pid (restarted container): gone
            else:
                holder["alive"] = holder["pid"] != os.getpid() or age < LOCK_TIMEOUT_S
        except ProcessLookupError:
            holder["alive"] = False
        except PermissionError:
            holder["alive"] = True
    else:
        holder["alive"] = age < LOCK_TIMEOUT_S
    return holder
