"""Two-tier checkpoints: committed local checkpoints copied to a remote root in the background.

A :class:`Replicator` belongs to a :class:`~statekit.CheckpointManager` created with
``replicate_to=``. Each checkpoint committed under the local root is queued at its commit
(an async save's too, from its writer thread) and copied by one background thread:

1. every data file listed in the local manifest, streamed local -> remote (no staging
   copy), then read back from the remote and checked against the manifest's size and
   XXH3-64 checksum (:class:`statekit.storage.hashing.VerifyingReader`);
2. the manifest last, byte for byte, with the same single-PUT / atomic-rename commit as a
   save (:meth:`statekit.storage.Storage.commit`), so the remote copy is committed
   atomically too: a copy interrupted anywhere before this step has no manifest and is
   never loaded.

Failures (endpoint down, frozen, a mismatch at the destination) are retried with
exponential backoff; every failed try warns with the remote URL; training and local
saves never wait. A checkpoint whose copy was interrupted (process killed) is copied
again when the next manager starts (:meth:`Replicator.catch_up`).
"""

from __future__ import annotations

import queue
import threading
import time
import warnings
from typing import Any

from statekit import format as fmt
from statekit.api.listing import CheckpointInfo, delete_checkpoint, list_checkpoints
from statekit.errors import CheckpointInUseError, StatekitError, StatekitWarning
from statekit.storage import Storage
from statekit.storage.hashing import VerifyingReader

COPY_CHUNK_BYTES = 16 * 1024 * 1024
"""Bytes per read/write while streaming a file to the remote tier."""


class Replicator:
    """Copies committed checkpoints from a local root to a remote root, in order, on one
    background (daemon) thread.

    Args:
        remote_url: the remote root (``s3://bucket/run``, any fsspec URL); checkpoints keep
            their directory names (``checkpoint-<step>``) under it.
        storage_options: fsspec options of the remote root (its own, not the local one's).
        retries: tries per checkpoint before it is given up (until the next manager start).
        backoff_seconds: wait after the first failed try; doubled after each, at most
            ``max_backoff_seconds``.
        max_backoff_seconds: cap of the wait between tries, seconds.
        on_replicated: ``callable(name)`` run on the thread after a checkpoint's remote
            copy committed (the manager's remote retention).

    Raises:
        StorageError: ``remote_url`` cannot be resolved (unknown scheme, backend missing).
    """

    def __init__(
        self,
        remote_url: str,
        storage_options: dict[str, Any] | None = None,
        *,
        retries: int = 5,
        backoff_seconds: float = 1.0,
        max_backoff_seconds: float = 30.0,
        on_replicated: Any = None,
    ) -> None:
        self.remote = Storage(remote_url, storage_options)
        self.remote_url = self.remote.url
        self.storage_options = storage_options
        self.retries = retries
        self.backoff_seconds = backoff_seconds
        self.max_backoff_seconds = max_backoff_seconds
        self.on_replicated = on_replicated
        self.failed: dict[str, str] = {}
        """Checkpoint name -> last error, for copies given up after ``retries`` tries."""
        self.replicated: set[str] = set()
        """Names whose remote copy committed (found by :meth:`catch_up`, or copied since;
        remote retention may have deleted it later, by policy): what local retention may
        delete, known without listing the remote tier."""
        self._queue: queue.Queue[tuple[str, str]] = queue.Queue()
        self._pending: dict[str, str] = {}  # name -> local URL, queued or being copied
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._run, name=f"statekit-replicate {self.remote_url}", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- queue

    def submit(self, local_url: str) -> None:
        """Queue the committed checkpoint at ``local_url`` (its name is kept remotely)."""
        name = local_url.rstrip("/").rsplit("/", 1)[-1]
        with self._lock:
            if name in self._pending:
                return
            self._pending[name] = local_url
            self.failed.pop(name, None)
        self._queue.put((name, local_url))

    def pending(self) -> list[str]:
        """Names of checkpoints queued or being copied, oldest first."""
        with self._lock:
            return list(self._pending)

    def wait(self, timeout: float | None = None) -> list[str]:
        """Wait until nothing is queued (or ``timeout`` seconds passed); warn about every
        checkpoint not replicated (still queued, or given up: with its error).

        Args:
            timeout: seconds; None waits as long as it takes.

        Returns:
            Names of the checkpoints that have no committed remote copy from this
            replicator (pending or failed).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._idle.wait(left)
            pending, failed = list(self._pending), dict(self.failed)
        for name in pending:
            warnings.warn(f"{self.remote_url}/{name}: not replicated yet (still copying)", StatekitWarning, stacklevel=2)
        for name, error in failed.items():
            warnings.warn(f"{self.remote_url}/{name}: not replicated: {error}", StatekitWarning, stacklevel=2)
        return pending + [n for n in failed if n not in pending]

    def catch_up(self, local: list[CheckpointInfo]) -> list[str]:
        """Queue every committed local checkpoint without a committed remote copy (a copy
        a killed process left half done is redone: files are rewritten, the manifest last).

        Args:
            local: the local root's checkpoints (:func:`statekit.api.listing.list_checkpoints`).

        Returns:
            The names queued.
        """
        try:
            remote = {i.url.rsplit("/", 1)[-1] for i in self.list() if i.committed}
            with self._lock:
                self.replicated |= remote
        except StatekitError as exc:
            warnings.warn(f"{self.remote_url}: cannot list the remote tier ({exc}); replicating every local checkpoint",
                          StatekitWarning, stacklevel=2)
            remote = set()
        queued = []
        for info in local:
            name = info.url.rsplit("/", 1)[-1]
            if info.committed and not info.accelerate and name not in remote:
                self.submit(info.url)
                queued.append(name)
        return queued

    def list(self) -> list[CheckpointInfo]:
        """The remote root's checkpoints, oldest first (:func:`list_checkpoints`)."""
        return list_checkpoints(self.remote_url, self.storage_options)

    # ---------------------------------------------------------------- thread

    def _run(self) -> None:
        while True:
            name, local_url = self._queue.get()
            error = self._copy_with_retries(name, local_url)
            if error is None:
                with self._lock:
                    self.replicated.add(name)
            if error is None and self.on_replicated is not None:  # before wait() can return
                try:
                    self.on_replicated(name)
                except Exception as exc:  # noqa: BLE001 - retention trouble must not stop replication
                    warnings.warn(f"{self.remote_url}: after replicating {name}: {exc}", StatekitWarning, stacklevel=2)
            with self._idle:
                self._pending.pop(name, None)
                if error is not None:
                    self.failed[name] = error
                else:
                    self.replicated.add(name)
                self._idle.notify_all()

    def _copy_with_retries(self, name: str, local_url: str) -> str | None:
        wait = self.backoff_seconds
        for attempt in range(1, self.retries + 1):
            try:
                copy_checkpoint(Storage(local_url), self.remote.child(name))
                return None
            except (StatekitError, OSError) as exc:
                error = f"{type(exc).__name__}: {exc}"
                last = attempt == self.retries
                warnings.warn(
                    f"{self.remote_url}/{name}: replication try {attempt} of {self.retries} failed ({error})"
                    + ("; giving up until the next start" if last else f"; retrying in {wait:.3g} s"),
                    StatekitWarning,
                    stacklevel=2,
                )
                if last:
                    return error
                time.sleep(wait)
                wait = min(wait * 2, self.max_backoff_seconds)
        return None


def copy_checkpoint(src: Storage, dst: Storage) -> dict[str, Any]:
    """Copy one committed checkpoint: data files streamed and verified at the destination,
    then the manifest, byte for byte (the commit). A destination that already holds the
    same manifest is left as it is.

    Args:
        src: the committed source checkpoint.
        dst: the destination directory (created as needed; buckets never are).

    Returns:
        The manifest.

    Raises:
        IncompleteCheckpointError: ``src`` is not committed.
        CorruptCheckpointError: a copied file's size or checksum differs at the destination.
        StorageError: reading or writing failed (names the URL).
        StatekitError: ``dst`` holds a committed checkpoint with another manifest (left
            untouched: two runs writing one remote root?).
    """
    raw = src.read_bytes(fmt.MANIFEST_NAME)
    manifest = fmt.read_manifest(src)
    if dst.exists(fmt.MANIFEST_NAME):
        if dst.read_bytes(fmt.MANIFEST_NAME) == raw:
            return manifest
        raise StatekitError(f"{dst.url} is committed with another manifest than {src.url}; left untouched")
    for rel, meta in sorted(manifest["files"].items()):
        with src.open_read(rel) as f, dst.open_write(rel) as out:
            while chunk := f.read(COPY_CHUNK_BYTES):
                out.write(chunk)
        with dst.open_read(rel) as f:
            reader = VerifyingReader(f, dst.url_of(rel), meta)
            while reader.read(COPY_CHUNK_BYTES):  # the empty read at the end checks size and checksum
                pass
    dst.commit(fmt.MANIFEST_NAME, raw)
    return manifest


def _name(info: CheckpointInfo) -> str:
    return info.url.rsplit("/", 1)[-1]


def unreplicated(replicator: Replicator, local: list[CheckpointInfo]) -> set[str]:
    """URLs of the ``local`` checkpoints not known to have a committed remote copy: local
    retention keeps these. Known from the replicator's own record, so a save never waits
    on the remote tier (which may be down or frozen)."""
    with replicator._lock:
        replicated = set(replicator.replicated)
    return {i.url for i in local if _name(i) not in replicated}


def remote_retention(replicator: Replicator, keep_last: int, resumed_from: str | None) -> None:
    """Delete remote copies beyond the newest ``keep_last`` committed ones, never the one
    the run resumed from nor one being copied; a copy in use warns and is kept.

    Args:
        replicator: the remote tier.
        keep_last: committed remote checkpoints to keep.
        resumed_from: URL the run resumed from (kept), or None.
    """
    committed = [i for i in replicator.list() if i.committed and not i.accelerate]
    keep = {i.url for i in committed[-keep_last:]} | {resumed_from}
    busy = set(replicator.pending())
    for info in committed:
        if info.url not in keep and _name(info) not in busy:
            try:
                delete_checkpoint(info.url, replicator.storage_options)
            except CheckpointInUseError as exc:
                warnings.warn(f"remote retention kept {info.url}: {exc}", StatekitWarning, stacklevel=2)


def resume_candidates(local: list[CheckpointInfo], replicator: Replicator, local_options: dict[str, Any] | None) -> list[CheckpointInfo]:
    """The committed checkpoints of both tiers in the order a resume tries them: newest
    step first, a step's local copy before its remote one. When the newest local
    checkpoint also exists remotely with a different manifest, warn (the local one is
    used). A remote tier that cannot be listed warns and is left out.

    Args:
        local: the local root's committed checkpoints, oldest first.
        replicator: the remote tier.
        local_options: fsspec options of the local root.

    Returns:
        Candidates, best first.
    """
    try:
        remote = [i for i in replicator.list() if i.committed and not i.accelerate]
    except StatekitError as exc:
        warnings.warn(f"cannot list the remote tier {replicator.remote_url} ({exc}); resuming from the local one",
                      StatekitWarning, stacklevel=3)
        remote = []
    newest = local[-1] if local else None
    for twin in remote:
        if newest is not None and _name(twin) == _name(newest) and not _same_manifest(
            Storage(newest.url, local_options), Storage(twin.url, replicator.storage_options)
        ):
            warnings.warn(f"{newest.url} and {twin.url} hold step {newest.step} with different manifests; using the local one",
                          StatekitWarning, stacklevel=3)
    tiers = [(i, 0) for i in local] + [(i, 1) for i in remote]
    return [i for i, _ in sorted(tiers, key=lambda it: (-it[0].step, it[1]))]


def _same_manifest(a: Storage, b: Storage) -> bool:
    try:
        return a.read_bytes(fmt.MANIFEST_NAME) == b.read_bytes(fmt.MANIFEST_NAME)
    except (StatekitError, OSError):
        return True  # unreadable: loading it will say what is wrong
