"""Two-tier checkpoints: committed local checkpoints copied to a remote root in the background.

A :class:`Replicator` belongs to a :class:`~statekit.CheckpointManager` created with
``replicate_to=`` (the ``replicate`` plugin, :mod:`statekit_replicate.plugin`, starts it
and feeds it through the manager hooks). Each checkpoint committed under the local root is
queued at its commit (an async save's too, from its writer thread) and copied by one
background thread:

1. every data file listed in the local manifest, streamed local -> remote (no staging
   copy), then read back from the remote and checked against the manifest's size and
   XXH3-64 checksum (:class:`statekit.plugin_api.VerifyingReader`);
2. for a checkpoint that references a pretrained folder's frozen tensors instead of
   holding them (the manifest's ``references``), that folder's files, carried once per
   ``base_id`` to ``<remote root>/.statekit-bases/<base_id>/`` (a file already there with
   the recorded size and header checksum is not copied again), checked there against the
   recorded size and header checksum; the load of a remote copy falls back to it when the
   recorded folder is gone (:func:`statekit.plugin_api.carry_references`). It is carried
   always, not only when the folder looks unreachable from the remote tier: a replica
   must survive the primary machine, and the folder on it, and where the replica will be
   loaded from is not known when it is copied. A carried copy no committed remote
   checkpoint references any more is removed by ``statekit gc`` of the remote root, never
   by retention;
3. the manifest last, byte for byte, with the same single-PUT / atomic-rename commit as a
   save (:meth:`statekit.plugin_api.Storage.commit`), so the remote copy is committed
   atomically too: a copy interrupted anywhere before this step has no manifest and is
   never loaded.

With several ranks (``world_size > 1``) every rank runs its own replicator: each copies
the files its rank wrote (the manifest's ``rank`` field) from its own local root, which may
be a disk of its node only, and, once they verify at the destination, writes a small
marker ``.statekit-replica-rank-<r>.json`` there; rank 0 commits the remote manifest only
when every rank's marker names this manifest and its files, and removes the markers
before the commit (a committed remote copy holds exactly the manifest's files).

With ``hedge_after_s`` (``replicate_hedge_after_s``, default 30) each file is uploaded
under a temporary name and renamed once it verified, and an upload that made no progress
for that many seconds is raced by a second attempt; the first to finish is committed (a
hedged copy, :mod:`statekit_replicate.remote_copy`).

Failures (endpoint down, frozen, a mismatch at the destination) are retried with
exponential backoff; every failed try warns with the remote URL; training and local
saves never wait. An interrupted copy is redone at the next start (:meth:`Replicator.catch_up`).
"""

from __future__ import annotations

import atexit
import errno
import queue
import sys
import threading
import time
import warnings
import weakref
from typing import Any

from statekit.plugin_api import (
    MANIFEST_NAME,
    CarriedCopy,
    CheckpointDir,
    InvalidOptionError,
    Manifest,
    StatekitError,
    StatekitWarning,
    Storage,
    Tier,
    broadcast_from_rank0,
    hold_in_use,
    list_checkpoints,
    rank_and_world_size,
    seconds_from_env,
    warn_user,
)
from statekit_replicate.remote_copy import copy_checkpoint

EXIT_TIMEOUT_ENV = "STATEKIT_REPLICATION_EXIT_TIMEOUT"
"""Seconds the interpreter waits at exit for checkpoints still being replicated (default
600; any finite number >= 0, ``1e3`` included); each one not replicated by then is named
on stderr."""

DEFAULT_EXIT_TIMEOUT_SECONDS = 600.0

DEFAULT_MAX_BACKLOG = 16
"""Checkpoints a replicator holds queued at most (``replicate_max_backlog``)."""

DEFAULT_HEDGE_AFTER_S = 30.0
"""Seconds without progress after which a file's upload is raced by a second attempt
(``replicate_hedge_after_s``)."""

NO_RETRY_ERRNOS = {errno.ENOSPC: "ENOSPC (no space left)", errno.EDQUOT: "EDQUOT (quota exceeded)",
                   errno.EROFS: "EROFS (read-only file system)"}
"""``OSError.errno`` values of a copy that is not retried: trying again cannot help."""

NO_RETRY_S3_CODES = {
    "XMinioStorageFull": "XMinioStorageFull (MinIO: storage full)",
    "QuotaExceeded": "QuotaExceeded (object store quota exceeded)",
    "InsufficientStorage": "InsufficientStorage (HTTP 507)",
}
"""botocore ``ClientError`` codes (``response["Error"]["Code"]``) of S3-compatible stores that
say the same; s3fs turns them into a plain ``OSError(EIO)`` whose ``__cause__`` keeps the code."""

_replicators: weakref.WeakSet[Replicator] = weakref.WeakSet()


def no_retry_reason(exc: BaseException) -> str | None:
    """Why a failed copy must not be retried: a full, over-quota or read-only destination.

    Walks ``exc`` and its causes/contexts (statekit's :class:`StorageError` keeps the
    original error as its cause).

    Args:
        exc: the copy's exception.

    Returns:
        The errno or S3 error code with a few words (``"ENOSPC (no space left)"``), or None
        when retrying may help.
    """
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in NO_RETRY_ERRNOS:
            return NO_RETRY_ERRNOS[error.errno]
        response = getattr(error, "response", None)
        code = response.get("Error", {}).get("Code") if isinstance(response, dict) else None
        if code in NO_RETRY_S3_CODES:
            return NO_RETRY_S3_CODES[code]
        error = error.__cause__ or error.__context__
    return None


COPY_MARKER = "statekit-replicate"
"""The ``by`` of the in-use marker held on a local checkpoint while it is copied (declared to
the core in the plugin's ``STATEKIT_COPY_LISTING``)."""


class Replicator(Tier):
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
            copy committed (the manager's remote retention; rank 0 only).
        rank: this process's rank; it copies the files the manifest says it wrote.
        world_size: ranks taking part; above 1 rank 0 waits for every rank's marker
            before it commits the remote manifest.
        peer_timeout_seconds: how long rank 0 waits for the other ranks' markers before
            the try fails (and is retried), seconds.
        backlog_warning: checkpoints queued at once above which a submit warns that the
            saves come faster than the remote tier takes them (once, until it drains).
        keep_last: the remote retention's ``remote_keep_last`` (None: keep every one);
            :meth:`catch_up_names` does not copy again what that policy deleted.
        max_backlog: checkpoints queued at most (None: no bound). A submit beyond it drops
            the oldest one not being copied, with a warning: it stays local (local
            retention keeps it, ``wait()`` names it) and is copied at the next start
            (:meth:`catch_up`). The newest checkpoints are the ones worth copying.
        hedge_after_s: seconds a file's upload may make no progress before a second
            attempt races it (the first to finish is committed); None or 0: never.

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
        rank: int = 0,
        world_size: int = 1,
        peer_timeout_seconds: float = 600.0,
        backlog_warning: int = 4,
        keep_last: int | None = None,
        max_backlog: int | None = DEFAULT_MAX_BACKLOG,
        hedge_after_s: float | None = DEFAULT_HEDGE_AFTER_S,
    ) -> None:
        self.remote = Storage(remote_url, storage_options)
        self.hedge_after_s = hedge_after_s
        self.hedged = 0
        """File uploads raced by a second attempt (this process)."""
        self.hedges_won = 0
        """Of those, the ones the second attempt won."""
        self.carried_bytes = 0
        """Bytes of referenced pretrained folders carried to the remote root (this process;
        a folder carried already is not copied again)."""
        self._exit_deadline: float | None = None
        self.max_backlog = max_backlog
        self.dropped = 0
        """Queued checkpoints dropped because the backlog was full (this process)."""
        self._dropped_names: set[str] = set()  # dropped while still in the queue: the thread skips them
        self._sizes: dict[str, tuple[int, int]] = {}  # pending name -> (files, bytes) this rank copies
        self._copied: tuple[int, int] = (0, 0)  # (files, bytes) of the current copy done so far
        self._current: str | None = None
        self.keep_last = keep_last
        self.backlog_warning = backlog_warning
        self._backlog_warned = False
        self.rank = rank
        self.world_size = world_size
        self.peer_timeout_seconds = peer_timeout_seconds
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
        remote retention may have deleted it later, by policy), and names :meth:`catch_up`
        found superseded (remote retention would delete their copy at once): what local
        retention may delete, known without listing the remote tier."""
        self._queue: queue.Queue[tuple[str, str, bytes | None]] = queue.Queue()
        self._pending: dict[str, str] = {}  # name -> local URL, queued or being copied
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._run, name=f"statekit-replicate {self.remote_url}", daemon=True)
        self._thread.start()
        _replicators.add(self)

    # ---------------------------------------------------------------- queue

    def submit(self, local_url: str, manifest: bytes | None = None) -> None:
        """Queue the committed checkpoint at ``local_url`` (its name is kept remotely).

        Args:
            local_url: this rank's local directory of the checkpoint.
            manifest: the committed manifest's bytes; None reads them from ``local_url``
                (a rank whose local root holds no manifest must pass them: rank 0 commits
                on its own disk).
        """
        name = local_url.rstrip("/").rsplit("/", 1)[-1]
        size = self._size_of(local_url, manifest)
        dropped: str | None = None
        with self._lock:
            if name in self._pending:
                return
            self._pending[name] = local_url
            self._sizes[name] = size
            self.failed.pop(name, None)
            if self.max_backlog is not None and len(self._pending) > self.max_backlog:
                dropped = next((n for n in self._pending if n not in (self._current, name)), None)
                if dropped is not None:
                    self._drop(dropped)
            behind = len(self._pending)
            warn = behind > self.backlog_warning and not self._backlog_warned
            self._backlog_warned = self._backlog_warned or warn
        self._queue.put((name, local_url, manifest))
        if dropped is not None:
            warn_user(
                f"{self.remote_url}/{dropped}: not replicated: the backlog is full ({self.max_backlog} checkpoints "
                f"queued; {self.dropped} dropped in this run); it stays local and is copied at the next start",
                StatekitWarning,
            )
        if warn:  # loud: local retention keeps every one of them until it is replicated
            warn_user(
                f"{self.remote_url}: replication is {behind} checkpoints behind (saves come faster than the remote tier "
                "takes them); local retention keeps each one until its remote copy commits",
                StatekitWarning,
            )

    def submit_committed(self, local_url: str, local_options: dict[str, Any] | None = None) -> None:
        """Queue a checkpoint right after its commit; with several ranks every rank calls
        it (a collective): rank 0 shares the manifest, which the other ranks' node-local
        roots do not hold.

        Args:
            local_url: this rank's local directory of the checkpoint.
            local_options: fsspec options of the local root.
        """
        if self.world_size == 1:
            self.submit(local_url)
            return
        raw = None
        if self.rank == 0:
            try:
                raw = Storage(local_url, local_options).read_bytes(MANIFEST_NAME)
            except (StatekitError, OSError) as exc:  # never raise between collectives
                warn_user(f"{local_url}: not replicated ({exc})", StatekitWarning)
        raw = broadcast_from_rank0(raw)
        if raw is not None:
            self.submit(local_url, raw)

    def _drop(self, name: str) -> None:
        """Drop a queued copy (the lock held)."""
        self._pending.pop(name, None)
        self._sizes.pop(name, None)
        self._dropped_names.add(name)
        self.dropped += 1
        self.failed[name] = f"dropped from a full backlog (max_backlog={self.max_backlog}); copied at the next start"

    @staticmethod
    def _size_of(local_url: str, manifest: bytes | None) -> tuple[int, int]:
        """(files, bytes) of a checkpoint this rank copies, from its manifest ((0, 0) if unreadable)."""
        try:
            raw = manifest if manifest is not None else Storage(local_url).read_bytes(MANIFEST_NAME)
            files = Manifest.from_json(raw, local_url).files
        except (StatekitError, OSError, ValueError):
            return (0, 0)
        return (len(files), sum(meta.size_bytes for meta in files.values()))

    def backlog(self) -> dict[str, int]:
        """What this rank has still to copy: checkpoints queued or being copied, their
        files and bytes not copied yet, the copies dropped from a full backlog, and the
        file uploads hedged so far (raced by a second attempt) and won by that attempt.

        Returns:
            ``{"checkpoints": n, "files": n, "bytes": n, "dropped": n, "hedged": n,
            "hedges_won": n}``.
        """
        with self._lock:
            files = sum(self._sizes.get(n, (0, 0))[0] for n in self._pending)
            size = sum(self._sizes.get(n, (0, 0))[1] for n in self._pending)
            if self._current in self._pending:
                files -= self._copied[0]
                size -= self._copied[1]
            return {"checkpoints": len(self._pending), "files": max(files, 0), "bytes": max(size, 0),
                    "dropped": self.dropped, "hedged": self.hedged, "hedges_won": self.hedges_won}

    def _file_copied(self, size: int) -> None:
        with self._lock:
            self._copied = (self._copied[0] + 1, self._copied[1] + size)

    def _base_carried(self, carried: CarriedCopy) -> None:
        with self._lock:
            self.carried_bytes += carried.copied_bytes

    def _hedge_ended(self, rel: str, winner: int | None) -> None:
        with self._lock:
            self.hedged += 1
            self.hedges_won += winner == 2

    def exit_by(self, deadline: float) -> None:
        """Bound the wait at interpreter exit for this replicator's queued copies by
        ``deadline`` (``time.monotonic()``): the save on a signal calls it with the end of
        the grace period, so the process exits with its status before the scheduler's kill
        instead of waiting up to ``STATEKIT_REPLICATION_EXIT_TIMEOUT``.

        Args:
            deadline: the monotonic time after which the exit wait gives up.
        """
        self._exit_deadline = deadline

    def copied_names(self) -> set[str]:
        """Names known to have a committed remote copy (a snapshot of :attr:`replicated`)."""
        with self._lock:
            return set(self.replicated)

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
            warn_user(f"{self.remote_url}/{name}: not replicated yet (still copying)", StatekitWarning)
        for name, error in failed.items():
            warn_user(f"{self.remote_url}/{name}: not replicated: {error}", StatekitWarning)
        return pending + [n for n in failed if n not in pending]

    def catch_up(self, local: list[CheckpointDir]) -> list[str]:
        """Queue every committed local checkpoint without a committed remote copy (a copy
        a killed process left half done is redone: files are rewritten, the manifest last).
        One process only; with several ranks every rank runs :meth:`catch_up_ranks`.

        Args:
            local: the local root's checkpoints (:func:`statekit.plugin_api.list_checkpoints`).

        Returns:
            The names queued.
        """
        names = self.catch_up_names(local)
        for info in local:
            if info.name in names:
                self.submit(info.url)
        return [n for n in (i.name for i in local) if n in names]

    def catch_up_names(self, local: list[CheckpointDir]) -> set[str]:
        """Names of the committed ``local`` checkpoints without a committed remote copy
        (the remote ones found are recorded as replicated).

        With remote retention (``keep_last``), a local checkpoint older than the newest
        ``keep_last`` of the remote and local checkpoints together is not queued but
        recorded as replicated: remote retention deleted its copy on purpose (or would
        delete it at once), so copying it again would only churn the remote tier, and
        local retention may delete it by its own policy."""
        try:
            remote = {i.name: i for i in self.list() if i.committed and not i.accelerate}
            with self._lock:
                self.replicated |= set(remote)
        except StatekitError as exc:
            warn_user(f"{self.remote_url}: cannot list the remote tier ({exc}); replicating every local checkpoint",
                      StatekitWarning)
            remote = {}
        missing = {i.name: i for i in local if i.committed and not i.accelerate and i.name not in remote}
        if self.keep_last is not None and remote:
            both = sorted({**missing, **remote}.values(), key=lambda i: i.step)
            wanted = {i.name for i in both[-self.keep_last:]} if self.keep_last > 0 else set()
            superseded = set(missing) - wanted
            with self._lock:
                self.replicated |= superseded
            missing = {n: i for n, i in missing.items() if n not in superseded}
        return set(missing)

    def catch_up_ranks(self, local: list[CheckpointDir], local_url_of: Any) -> list[str]:
        """:meth:`catch_up` with several ranks (every rank calls it): rank 0 decides what
        to redo from its local root and shares each manifest, and every rank queues its
        part from its own local root.

        Args:
            local: rank 0's local checkpoints (other ranks' lists are not used).
            local_url_of: ``callable(name) -> str``, this rank's local directory of a
                checkpoint.

        Returns:
            The names queued.
        """
        todo: list[tuple[str, bytes]] | None = None
        if self.rank == 0:
            names = self.catch_up_names(local)
            todo = []
            for info in local:
                if info.name in names:
                    try:
                        todo.append((info.name, Storage(info.url).read_bytes(MANIFEST_NAME)))
                    except (StatekitError, OSError) as exc:
                        warn_user(f"{info.url}: not replicated ({exc})", StatekitWarning)
        todo = broadcast_from_rank0(todo)
        for name, raw in todo:
            self.submit(local_url_of(name), raw)
        return [name for name, _ in todo]

    def list(self) -> list[CheckpointDir]:
        """The remote root's checkpoints, oldest first (:func:`list_checkpoints`)."""
        return list_checkpoints(self.remote_url, self.storage_options)

    # ---------------------------------------------------------------- thread

    def _run(self) -> None:
        while True:
            name, local_url, manifest = self._queue.get()
            with self._lock:
                if name in self._dropped_names:  # dropped from a full backlog while queued
                    self._dropped_names.discard(name)
                    continue
                self._current, self._copied = name, (0, 0)
            error = self._copy_with_retries(name, local_url, manifest)
            if error is None:
                with self._lock:
                    self.replicated.add(name)
            if error is None and self.on_replicated is not None:  # before wait() can return
                try:
                    self.on_replicated(name)
                except Exception as exc:  # noqa: BLE001 - retention trouble must not stop replication
                    warn_user(f"{self.remote_url}: after replicating {name}: {exc}", StatekitWarning)
            with self._idle:
                self._pending.pop(name, None)
                self._sizes.pop(name, None)
                self._current = None
                if error is not None:
                    self.failed[name] = error
                if not self._pending:
                    self._backlog_warned = False  # drained: warn again next time
                self._idle.notify_all()

    def _copy_with_retries(self, name: str, local_url: str, manifest: bytes | None) -> str | None:
        wait = self.backoff_seconds
        for attempt in range(1, self.retries + 1):
            source = Storage(local_url)
            in_use = hold_in_use(source, local_url, by=COPY_MARKER)  # no gc or retention deletes it meanwhile
            permanent = None
            try:
                with self._lock:
                    self._copied = (0, 0)
                copy_checkpoint(
                    source, self.remote.child(name), manifest,
                    rank=self.rank, world_size=self.world_size, peer_timeout_seconds=self.peer_timeout_seconds,
                    on_file_copied=self._file_copied, hedge_after_s=self.hedge_after_s, on_hedge=self._hedge_ended,
                    on_carried=self._base_carried,
                )
                return None
            except Exception as exc:  # noqa: BLE001 - any failure is one failed try; the thread lives on
                error = f"{type(exc).__name__}: {exc}"
                permanent = no_retry_reason(exc)
            finally:
                if in_use is not None:
                    in_use()
            if permanent is not None:  # a full or read-only destination: another try cannot help
                error = f"{permanent}: {error}"
                warn_user(f"{self.remote_url}/{name}: replication failed with {permanent}; not retried ({error})",
                          StatekitWarning)
                return error
            last = attempt == self.retries
            warn_user(
                f"{self.remote_url}/{name}: replication try {attempt} of {self.retries} failed ({error})"
                + ("; giving up until the next start" if last else f"; retrying in {wait:.3g} s"),
                StatekitWarning,
            )
            if last:
                return error
            time.sleep(wait)
            wait = min(wait * 2, self.max_backoff_seconds)
        return None


def exit_timeout_seconds() -> float:
    """The wait at interpreter exit for copies still queued: :data:`EXIT_TIMEOUT_ENV`, or
    600 s when it is unset or empty.

    Returns:
        Seconds, a finite number >= 0.

    Raises:
        InvalidOptionError: the variable is not a finite number of seconds >= 0 (naming
            the variable and its value).
    """
    return seconds_from_env(EXIT_TIMEOUT_ENV, DEFAULT_EXIT_TIMEOUT_SECONDS,
                            what="the wait at exit for checkpoints still being replicated", zero_allowed=True)


@atexit.register
def _wait_at_exit() -> None:
    """At interpreter exit, finish what is queued (a job whose script ends right after its
    last save would otherwise drop it with the daemon thread, silently, and a node-local
    disk is gone with the node) and name every checkpoint left unreplicated on stderr.

    An async save still writing is done by then: its writer thread is not a daemon, and
    the interpreter joins such threads before it runs any exit handler, so its commit has
    queued its copy (``statekit_checkpoint_committed`` runs on that thread)."""
    try:
        timeout = exit_timeout_seconds()
    except InvalidOptionError as exc:  # changed since the manager started: say so, keep the default
        print(f"statekit: {exc}; waiting up to {DEFAULT_EXIT_TIMEOUT_SECONDS:g} s", file=sys.stderr)
        timeout = DEFAULT_EXIT_TIMEOUT_SECONDS
    deadline = time.monotonic() + timeout
    for replicator in list(_replicators):
        if not replicator.pending():  # nothing in flight (failures were warned at each try)
            continue
        queued = len(replicator.pending())
        print(f"statekit: waiting up to {timeout:g} s for replication to {replicator.remote_url} ({queued} "
              f"checkpoint(s) queued; {EXIT_TIMEOUT_ENV} sets the limit)", file=sys.stderr)
        until = deadline if replicator._exit_deadline is None else min(deadline, replicator._exit_deadline)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            replicator.wait(max(0.0, until - time.monotonic()))
        for w in caught:
            print(f"statekit: {w.message}", file=sys.stderr)
    sys.stderr.flush()


def start_replication(
    remote_url: str,
    remote_options: dict[str, Any] | None,
    list_local: Any,
    local_url_of: Any,
    *,
    on_replicated: Any,
    keep_last: int | None = None,
    max_backlog: int | None = DEFAULT_MAX_BACKLOG,
    hedge_after_s: float | None = DEFAULT_HEDGE_AFTER_S,
) -> Replicator:
    """Start a manager's replicator and queue what a killed process left unreplicated
    (every rank calls it when ``world_size > 1``).

    Args:
        remote_url: the remote root.
        remote_options: its fsspec options.
        list_local: ``callable() -> list[CheckpointDir]``, the local root's checkpoints.
        local_url_of: ``callable(name) -> str``, this rank's local directory of a checkpoint.
        on_replicated: ``callable(name)`` after a remote commit (run on rank 0 only).
        keep_last: the remote retention's ``remote_keep_last`` (None: keep all); catch-up
            does not copy again what that policy deleted.
        max_backlog: checkpoints queued at most (:class:`Replicator`).
        hedge_after_s: seconds without progress before an upload is hedged (:class:`Replicator`).

    Returns:
        The running :class:`Replicator`.

    Raises:
        StorageError: ``remote_url`` cannot be resolved.
        InvalidOptionError: :data:`EXIT_TIMEOUT_ENV` is not a number of seconds (refused
            now rather than at exit).
    """
    exit_timeout_seconds()  # the same on every rank: raised before any collective
    rank, world = rank_and_world_size()
    replicator = Replicator(remote_url, remote_options, on_replicated=on_replicated if rank == 0 else None,
                            rank=rank, world_size=world, keep_last=keep_last, max_backlog=max_backlog,
                            hedge_after_s=hedge_after_s)
    if world == 1:
        replicator.catch_up(list_local())
    else:
        replicator.catch_up_ranks(list_local() if rank == 0 else [], local_url_of)
    return replicator

