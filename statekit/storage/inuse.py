"""In-use markers: a checkpoint that a live process reads in place says so, and is not deleted.

The marker ``<checkpoint>/.in-use-<pid>-<token>`` (not in the manifest) holds JSON ``{"by",
"pid", "host", "pid_start", "created", "model_key", "offload_folder"}``; ``by`` is
``"statekit"`` or a plugin's name. It is live when its host is another machine, or its
``pid`` exists here and started at ``pid_start``. Deleting or ``overwrite=True`` refuse a
live one (:class:`CheckpointInUseError`). docs/format.md.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import uuid
import weakref
from dataclasses import dataclass
from typing import Any

from statekit.errors import CheckpointInUseError, StorageError
from statekit.storage.fs import Storage

MARKER_PREFIX = ".in-use-"
"""File-name prefix of a marker inside a checkpoint directory."""

@dataclass(frozen=True)
class InUseMarker:
    """One marker found in a checkpoint directory (fields as the module docstring's JSON).

    Attributes:
        path: the marker file's local path.
        live: whether it holds (see the module docstring).
    """

    path: str
    pid: int
    host: str
    pid_start: int | None
    created: str
    model_key: str | None
    offload_folder: str | None
    live: bool
    by: str


def local_dir(url: str) -> str:
    """Local filesystem path of a checkpoint URL (plain path or ``file://``).

    Raises:
        StorageError: the URL is not on the local filesystem (markers live next to local
            files only, since only local files are read in place).
    """
    storage = Storage(url)
    if not storage.is_local:
        raise StorageError(f"{url}: in-use markers exist only for checkpoints on the local filesystem", url=url)
    return os.path.abspath(storage.path)


def _process_start(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            stat = f.read()
    except OSError:
        return None
    try:  # field 22, counted after the parenthesised command name (which may hold spaces)
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (IndexError, ValueError):
        return None


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _is_live(doc: dict[str, Any]) -> bool:
    if doc.get("host") != socket.gethostname():
        return True
    pid = doc.get("pid")
    if not isinstance(pid, int) or not _pid_alive(pid):
        return False
    start = doc.get("pid_start")
    return start is None or _process_start(pid) in (None, start)


def mark_in_use(
    url: str, *, by: str, model_key: str | None = None, offload_folder: str | None = None
) -> str:
    """Write a marker saying that this process (writer ``by``) reads the local checkpoint ``url``
    in place; returns the marker's local path (for :func:`release_in_use`).

    Raises:
        StorageError: the checkpoint is not local, or the marker cannot be written.
    """
    folder = local_dir(url)
    pid = os.getpid()
    path = os.path.join(folder, f"{MARKER_PREFIX}{pid}-{uuid.uuid4().hex[:12]}")
    doc = {
        "by": by,
        "pid": pid,
        "host": socket.gethostname(),
        "pid_start": _process_start(pid),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z"),
        "model_key": model_key,
        "offload_folder": offload_folder,
    }
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(doc, f)
    except OSError as exc:
        raise StorageError(f"{url}: cannot write in-use marker {path}: {exc}", url=url) from exc
    return path


def hold_in_use(owner: Any, url: str, *, by: str) -> Any:
    """Mark the local checkpoint ``url`` in use (writer ``by``) for as long as ``owner`` lives
    (a ``weakref.finalize``); None for a checkpoint not local or not writable.
    """
    if not Storage(url).is_local:
        return None
    try:
        marker = mark_in_use(url, by=by)
    except StorageError:
        return None
    return weakref.finalize(owner, release_in_use, marker)


def release_in_use(marker: str) -> None:
    """Remove a marker written by :func:`mark_in_use` (a missing marker is fine)."""
    try:
        os.remove(marker)
    except FileNotFoundError:
        pass


def in_use_markers(url: str, *, include_stale: bool = False) -> list[InUseMarker]:
    """The markers of checkpoint ``url``, live ones only unless ``include_stale``; unreadable
    files with the marker prefix count as live, a non-local checkpoint has none.
    """
    try:
        folder = local_dir(url)
    except StorageError:
        return []
    try:
        names = sorted(n for n in os.listdir(folder) if n.startswith(MARKER_PREFIX))
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        path = os.path.join(folder, name)
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
            if not isinstance(doc, dict):
                raise ValueError("not an object")
        except (OSError, ValueError):
            doc = {}
        pid = doc.get("pid") if isinstance(doc.get("pid"), int) else -1
        live = _is_live(doc) if doc else True
        marker = InUseMarker(
            path=path,
            pid=pid,
            host=str(doc.get("host", "")),
            pid_start=doc.get("pid_start") if isinstance(doc.get("pid_start"), int) else None,
            created=str(doc.get("created", "")),
            model_key=doc.get("model_key"),
            offload_folder=doc.get("offload_folder"),
            live=live,
            by=str(doc.get("by", "")),
        )
        if live or include_stale:
            found.append(marker)
    return found


def refuse_if_in_use(url: str, action: str) -> None:
    """Refuse to ``action`` (``"delete"``, ``"overwrite"``) a checkpoint a live process reads in place.

    Raises:
        CheckpointInUseError: a live in-use marker is present; names host, pid and model.
    """
    markers = in_use_markers(url)
    if markers:
        users = ", ".join(f"{m.host} pid {m.pid}" + (f" ({m.model_key})" if m.model_key else "") for m in markers)
        raise CheckpointInUseError(f"cannot {action} {url}: it is read in place by a live process: {users}")


def is_in_use(url: str) -> bool:
    """True if checkpoint ``url`` has a live marker (see :func:`in_use_markers`)."""
    return bool(in_use_markers(url))


def remove_stale_markers(url: str) -> list[str]:
    """Delete the markers of ``url`` whose process has ended.

    Returns:
        The paths removed.
    """
    removed = []
    for marker in in_use_markers(url, include_stale=True):
        if not marker.live:
            release_in_use(marker.path)
            removed.append(marker.path)
    return removed
