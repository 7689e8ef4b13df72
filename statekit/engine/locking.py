"""The save lock: one saver owns a checkpoint directory from its first file to its commit,
and the lock is statekit's proof of ownership (docs/design-notes.md, "A save lock";
docs/format.md, "Commit protocol").
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
    """Whether ``name`` (directly in a checkpoint directory) is statekit's own bookkeeping:
    the save lock (and the temporary file that creates it), in-use markers."""
    return name.startswith((LOCK_NAME, MARKER_PREFIX))


def prepare_target(storage: Storage, overwrite: bool, describe: Callable[[Storage], str] | None = None) -> None:
    """Own the directory for this save: refuse a committed checkpoint (unless
    ``overwrite``: replace it, or take over a live lock), take the lock, clear leftovers of
    a crashed statekit save. Only what statekit wrote is ever removed. ``describe`` names
    what a refused directory holds (from a layer above); None lists its entries.

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
    """Delete a directory statekit wrote: a lock marked ``deleting`` first, then the
    manifest, every other entry, the lock last, so an interruption leaves it for ``statekit gc``.

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
    """A save that failed before its commit: rank 0 (the lock's owner) marks the lock
    failed (:func:`mark_save_failed`), unless another saver committed the directory meanwhile."""
    if rank != 0:
        return
    try:
        if storage.exists(fmt.MANIFEST_NAME):
            return
    except StatekitError:
        pass  # the storage is failing: try to mark it anyway
    mark_save_failed(storage)


def mark_copy_in_progress(storage: Storage) -> None:
    """Put this process's lock (not exclusive) in a directory a copy is filling, so
    ``statekit gc`` keeps it until :func:`end_copy_in_progress`."""
    storage.write_bytes(LOCK_NAME, _lock_record())


def end_copy_in_progress(storage: Storage) -> None:
    """Remove the lock :func:`mark_copy_in_progress` put, after the copy's commit (as
    :func:`release_lock`)."""
    release_lock(storage, 0)


def lock_accelerate_save(storage: Storage) -> None:
    """Own a directory ``Accelerator.save_state`` is about to write (attach mode): take the
    save lock, then uncommit an earlier checkpoint there; nothing is cleared.

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
    """Leave a failed save's lock in place, marked failed (stale at once), for ``statekit
    gc`` or the next save; a failing storage leaves the lock as it was."""
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
    """Remove the lock (rank 0 only); a failing storage leaves it, stale once this process is gone."""
    if rank == 0:
        try:
            storage.remove(LOCK_NAME)
        except StatekitError:
            pass  # the storage is failing; a later save finds the lock stale


def live_save_lock(storage: Storage) -> dict[str, Any] | None:
    """The lock's JSON (``host``, ``pid``, ``created``) when a save is (or may still be) in
    progress; None when there is no lock or it is stale."""
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
