"""Copying one committed checkpoint to another root, verified at the destination, manifest last.

The copy behind two-tier checkpoints (:mod:`statekit_replicate.replication`). Every data file is
streamed (no staging copy of the checkpoint), read back at the destination and checked
against the manifest's size and XXH3-64 checksum, and the manifest is written last with
the same atomic commit as a save (:meth:`statekit.plugin_api.Storage.commit`): a copy
interrupted anywhere has no manifest and is never loaded.

A checkpoint that references a pretrained folder's frozen tensors (the manifest's
``references``) gets that folder's files carried to the destination root's
``.statekit-bases/<base_id>/``, always and once per ``base_id``, before its manifest is
committed (:func:`statekit.plugin_api.carry_references`): a replica must load after the
primary machine, and the folder on it, are gone, and whether the recorded folder is
reachable from wherever the replica is loaded later cannot be known when it is copied. A
second checkpoint referencing the same folder finds the files there (the recorded size and
header checksum) and copies nothing; with several ranks rank 0 carries them.

Several ranks assemble one copy: each copies the files its rank wrote (the manifest's
``rank`` field) from its own, possibly node-local, directory and then leaves a marker
(:data:`MARKER_PREFIX`); rank 0 commits once every rank's marker names the same manifest
and its files, and removes the markers first.

With ``hedge_after_s`` (hedged copies) an upload that made no progress for that long is
raced by a second attempt (:func:`_copy_file_hedged`), and the first to finish verified
is committed. On a file system (``file://``, NFS...) each attempt writes a temporary
name of its own, renamed to the final name once verified
(:meth:`statekit.plugin_api.Storage.rename`, ``os.replace``), so no partial file and no
mix of two attempts carries a final name; the other attempt, abandoned, removes its
temporary file when it ends. On an object store both attempts write the final name: an
object appears only once written whole (a PUT, or a completed multipart upload) and both
hold the same bytes, so a rename (a server-side copy of every file: 1.4x the replication
time against moto) would buy nothing; the abandoned attempt, if it ever ends, writes the
same bytes again. Without hedging, each file is written under its final name, as one
attempt at a time never races another.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import threading
import time
import uuid
from typing import Callable

from statekit.plugin_api import (
    MANIFEST_NAME,
    CorruptCheckpointError,
    FileEntry,
    Manifest,
    StatekitError,
    CarriedCopy,
    StatekitWarning,
    Storage,
    VerifyingReader,
    carry_references,
    checksum_bytes,
    end_copy_in_progress,
    mark_copy_in_progress,
    read_manifest,
    warn_user,
)

logger = logging.getLogger("statekit.replicate")

COPY_CHUNK_BYTES = 16 * 1024 * 1024
"""Bytes per read/write while streaming a file to the remote tier."""

MARKER_PREFIX = ".statekit-replica-rank-"
"""A rank's marker in a remote copy being assembled: ``<prefix><rank:05d>.json``, JSON
``{"manifest": <XXH3 of the manifest bytes>, "files": [...]}``; removed before the commit."""

PEER_POLL_SECONDS = 0.5
"""How often rank 0 looks for the other ranks' markers, seconds."""


def copy_checkpoint(
    src: Storage,
    dst: Storage,
    manifest_bytes: bytes | None = None,
    *,
    rank: int = 0,
    world_size: int = 1,
    peer_timeout_seconds: float = 600.0,
    on_file_copied: Callable[[int], None] | None = None,
    hedge_after_s: float | None = None,
    on_hedge: Callable[[str, int | None], None] | None = None,
    on_carried: Callable[[CarriedCopy], None] | None = None,
) -> Manifest:
    """Copy one committed checkpoint: data files streamed and verified at the destination,
    then the manifest, byte for byte (the commit). A destination that already holds the
    same manifest is left as it is.

    With ``world_size > 1`` this is one rank's part: it copies the files the manifest says
    ``rank`` wrote (from ``src``, this rank's local directory), then a rank other than 0
    writes its marker and returns; rank 0 waits for every other rank's marker, removes the
    markers and commits.

    Args:
        src: the source checkpoint directory (committed, or this rank's part of one).
        dst: the destination directory (created as needed; buckets never are).
        manifest_bytes: the committed manifest; None reads it from ``src``.
        rank: this process's rank.
        world_size: ranks taking part.
        peer_timeout_seconds: rank 0's wait for the other ranks' markers, seconds.
        on_file_copied: ``callable(size_bytes)`` after each data file is copied and
            verified (the replicator's backlog).
        hedge_after_s: seconds without progress (a chunk read or written, a request
            answered) after which an upload is raced by a second attempt; each attempt then
            writes a temporary name, renamed once verified. None or 0: never; each file is
            written under its final name (one attempt at a time).
        on_hedge: ``callable(rel, winner)`` once a hedged upload's race ended: ``winner``
            is the attempt that was committed (1 or 2), None when both failed.
        on_carried: ``callable(carried)`` for each referenced folder carried (or found
            carried already) beside the destination, before the commit (rank 0 only).

    Returns:
        The manifest.

    Raises:
        IncompleteCheckpointError: ``src`` is not committed (and no ``manifest_bytes``).
        CorruptCheckpointError: a copied file's size or checksum differs at the destination
            (a carried base file: its size or header).
        MissingBaseError: a referenced folder is reachable neither where recorded nor as a
            copy carried beside ``src`` (the copy is left uncommitted).
        ChangedBaseError: a referenced folder's files differ from the record.
        StorageError: reading or writing failed (names the URL).
        StatekitError: ``dst`` holds a committed checkpoint with another manifest (left
            untouched: two runs writing one remote root?); rank 0 waited
            ``peer_timeout_seconds`` for a rank's marker (names the ranks).
    """
    if manifest_bytes is None:
        manifest = read_manifest(src)  # names an uncommitted or corrupt source
        raw = src.read_bytes(MANIFEST_NAME)
    else:
        raw = manifest_bytes
        manifest = Manifest.from_json(raw, src.url_of(MANIFEST_NAME))
    if dst.exists(MANIFEST_NAME):
        if dst.read_bytes(MANIFEST_NAME) == raw:
            return manifest
        raise StatekitError(f"{dst.url} is committed with another manifest than {src.url}; left untouched")
    mine = sorted(rel for rel, meta in manifest.files.items() if world_size == 1 or meta.rank == rank)
    mark_copy_in_progress(dst)  # statekit gc of the remote root keeps it until the commit
    _remove_stale_temps(dst, mine)
    bases: dict[str, tuple[Storage, Manifest | None]] = {}
    for rel in mine:
        meta = manifest.files[rel]
        if not (meta.reused_from and _copy_from_remote_base(dst, rel, meta, bases)):
            # not an unchanged file of an incremental save held by the remote base: upload it
            if hedge_after_s:
                _copy_file_hedged(src, dst, rel, meta, hedge_after_s, on_hedge)
            else:  # one attempt: the final name directly (the manifest, written last, commits)
                _copy_file(src, dst, rel, meta)
        if on_file_copied is not None:
            on_file_copied(meta.size_bytes)
    if rank == 0 or world_size == 1:  # before the commit: a committed replica always resolves its base
        for carried in carry_references(manifest.references, src, dst):
            if on_carried is not None:
                on_carried(carried)
    if world_size > 1:
        marker = {"manifest": checksum_bytes(raw), "files": mine}
        if rank != 0:
            dst.write_bytes(_marker_name(rank), json.dumps(marker).encode("utf-8"))
            return manifest
        _wait_for_ranks(dst, manifest, marker["manifest"], world_size, peer_timeout_seconds)
    dst.commit(MANIFEST_NAME, raw)
    end_copy_in_progress(dst)
    return manifest


def _copy_file(
    src: Storage, dst: Storage, rel: str, meta: FileEntry, *, to: str | None = None,
    progress: Callable[[], None] | None = None,
) -> str:
    """Upload one data file to ``to`` (default ``rel``) and verify it there (size and
    checksum); ``progress()`` after each chunk read or written and each request answered.

    Returns:
        ``to``: the relative path written.

    Raises:
        CorruptCheckpointError: the written file differs from ``meta``.
        StorageError: reading or writing failed.
    """
    to = rel if to is None else to
    tick = progress or (lambda: None)
    if meta.size_bytes <= COPY_CHUNK_BYTES:  # one PUT and one GET (a busy training thread makes each call slow)
        data = src.read_bytes(rel)
        tick()
        dst.write_bytes(to, data)
        tick()
        VerifyingReader(io.BytesIO(dst.read_bytes(to)), dst.url_of(to), meta).read()  # checks size and checksum
        return to
    with src.open_read(rel) as f, dst.open_write(to) as out:
        while chunk := f.read(COPY_CHUNK_BYTES):
            out.write(chunk)
            tick()
    with dst.open_read(to) as f:
        reader = VerifyingReader(f, dst.url_of(to), meta)
        while reader.read(COPY_CHUNK_BYTES):  # the empty read at the end checks size and checksum
            tick()
    return to


def _temp_name(rel: str, attempt: int) -> str:
    """A temporary name of one upload attempt of ``rel``, in the same directory:
    ``.<name>.<random>.attempt<n>.tmp``."""
    folder, _, name = rel.rpartition("/")
    temp = f".{name}.{uuid.uuid4().hex[:12]}.attempt{attempt}.tmp"
    return f"{folder}/{temp}" if folder else temp


def _remove_stale_temps(dst: Storage, mine: list[str]) -> None:
    """Remove the temporary files an earlier, killed or failed, copy of these files left
    (:func:`_temp_name`); another rank's are left alone."""
    prefixes = {}
    for rel in mine:
        folder, _, name = rel.rpartition("/")
        prefixes[f"{folder}/.{name}." if folder else f".{name}."] = rel
    for found in dst.find():
        if found.endswith(".tmp") and ".attempt" in found and any(found.startswith(p) for p in prefixes):
            _remove_quietly(dst, found)


def _remove_quietly(dst: Storage, rel: str) -> None:
    """Remove an abandoned attempt's temporary file (whatever state it is in)."""
    with contextlib.suppress(Exception):
        dst.remove(rel)


def _publish(dst: Storage, rel: str, meta: FileEntry, temp: str) -> None:
    """Rename a verified temporary file to ``rel`` and check its size there; the temporary
    file is removed if that fails.

    Raises:
        CorruptCheckpointError: the final file's size differs from ``meta``.
        StorageError: the rename failed.
    """
    try:
        dst.rename(temp, rel)
    except BaseException:
        _remove_quietly(dst, temp)
        raise
    copied = dst.size(rel)
    if copied != meta.size_bytes:
        raise CorruptCheckpointError(
            f"{dst.url_of(rel)}: {copied} bytes after the rename from {dst.url_of(temp)}, manifest says {meta.size_bytes}",
            path=dst.url_of(rel),
        )


class _Race:
    """The state of one hedged upload: attempts running, their errors, the winner."""

    def __init__(self) -> None:
        self.changed = threading.Condition()
        self.progress_at = time.monotonic()
        self.running: set[int] = set()
        self.errors: list[BaseException] = []
        self.winner: tuple[int, str] | None = None

    def touch(self) -> None:
        with self.changed:
            self.progress_at = time.monotonic()


def _copy_file_hedged(
    src: Storage, dst: Storage, rel: str, meta: FileEntry, hedge_after_s: float,
    on_hedge: Callable[[str, int | None], None] | None,
) -> None:
    """Upload ``rel`` on a worker thread; when it made no progress for ``hedge_after_s``
    seconds, race it by a second attempt (once). On a file system each attempt writes and
    verifies its own temporary file; the first to finish is renamed to ``rel`` (the commit
    of this file), and the other, abandoned, removes its temporary file when it ends (a
    stalled request ends at the client's timeout, or when the storage answers again). On
    an object store both write and verify ``rel`` itself (module docstring).

    Raises:
        CorruptCheckpointError, StorageError: every attempt started failed (the last
            error); or the rename of the winner failed.
    """
    race = _Race()
    url = dst.url_of(rel)
    in_place = dst.writes_whole_files  # an object store: both attempts write the final name (module docstring)

    def attempt(n: int, temp: str) -> None:
        try:
            _copy_file(src, dst, rel, meta, to=temp, progress=race.touch if n == 1 else None)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting copy
            if not in_place:  # (a failed object upload leaves no object)
                _remove_quietly(dst, temp)
            with race.changed:
                race.errors.append(exc)
                race.running.discard(n)
                race.changed.notify_all()
            return
        with race.changed:
            race.running.discard(n)
            won = race.winner is None
            if won:
                race.winner = (n, temp)
            race.changed.notify_all()
        if not won and in_place:  # abandoned: it wrote the winner's bytes again
            logger.info("%s: hedged copy: attempt %d finished after the other one (the same bytes)", url, n)
        elif not won:  # abandoned: the other attempt's file is (being) committed
            _remove_quietly(dst, temp)
            logger.info("%s: hedged copy: attempt %d finished after the other one; its temporary file %s removed",
                        url, n, dst.url_of(temp))

    def start(n: int) -> None:
        race.running.add(n)
        threading.Thread(target=attempt, args=(n, rel if in_place else _temp_name(rel, n)), daemon=True,
                         name=f"statekit-replicate {url} attempt {n}").start()

    hedged = False
    with race.changed:
        start(1)
        while race.winner is None and race.running:
            if hedged:
                race.changed.wait()
                continue
            stalled = time.monotonic() - race.progress_at
            if stalled < hedge_after_s:
                race.changed.wait(hedge_after_s - stalled)
                continue
            hedged = True
            logger.warning("%s: no progress for %.3g s (replicate_hedge_after_s=%g); racing a second attempt",
                           url, stalled, hedge_after_s)
            start(2)
        winner, errors = race.winner, list(race.errors)
    if winner is None:
        if hedged and on_hedge is not None:
            on_hedge(rel, None)
        raise errors[-1]
    n, temp = winner
    if not in_place:
        _publish(dst, rel, meta, temp)
    if hedged:
        if on_hedge is not None:
            on_hedge(rel, n)
        warn_user(
            f"{url}: hedged copy: no progress for {hedge_after_s:g} s, so a second attempt raced the first; "
            f"attempt {n} finished first and was committed"
            + ("; the stalled one is abandoned" + ("" if in_place else " and removes its temporary file when it ends")
               if n == 2 else ""),
            StatekitWarning,
        )


def _copy_from_remote_base(
    dst: Storage, rel: str, meta: FileEntry, bases: dict[str, tuple[Storage, Manifest | None]]
) -> bool:
    """Copy ``rel`` from the destination root's committed copy of the checkpoint it was
    reused from (``meta.reused_from``, an incremental save), server-side: True when done.

    False (the caller uploads the file) when that checkpoint has no committed copy under
    the destination root (remote retention deleted it, or it was never replicated) or its
    file differs in size or checksum. The copy is not read back: the base's file was
    verified when it was replicated, and a server-side copy moves no bytes through this
    process; its size is checked.
    """
    name = meta.reused_from
    if name not in bases:  # each base's manifest read once per copy
        base = Storage(f"{dst.url.rstrip('/').rsplit('/', 1)[0]}/{name}", fs=dst.fs)
        try:
            bases[name] = (base, read_manifest(base) if base.exists(MANIFEST_NAME) else None)
        except StatekitError:
            bases[name] = (base, None)  # damaged or half-deleted: upload instead
    base, committed = bases[name]
    entry = committed.files.get(rel) if committed is not None else None
    if entry is None or entry.size_bytes != meta.size_bytes or entry.checksum != meta.checksum:
        return False
    try:
        dst.reuse(rel, base)
    except FileNotFoundError:
        return False
    copied = dst.size(rel)
    if copied != meta.size_bytes:
        raise CorruptCheckpointError(
            f"{dst.url_of(rel)}: {copied} bytes after the copy from {base.url}, manifest says {meta.size_bytes}",
            path=dst.url_of(rel),
        )
    return True


def _marker_name(rank: int) -> str:
    return f"{MARKER_PREFIX}{rank:05d}.json"


def _wait_for_ranks(dst: Storage, manifest: Manifest, digest: str, world_size: int, timeout: float) -> None:
    """Rank 0: wait until every other rank's marker in ``dst`` names this manifest and the
    files it wrote, then remove the markers (before the commit)."""
    expected = {r: sorted(rel for rel, m in manifest.files.items() if m.rank == r) for r in range(1, world_size)}
    waiting = set(expected)
    deadline = time.monotonic() + timeout
    while True:
        dst.invalidate()  # other processes write the markers: no cached listing
        for r in sorted(waiting):
            try:
                marker = json.loads(dst.read_bytes(_marker_name(r)).decode("utf-8"))
            except (FileNotFoundError, StatekitError, ValueError):
                continue  # not there yet (or half written: read again)
            if marker.get("manifest") == digest and marker.get("files") == expected[r]:
                waiting.discard(r)
        if not waiting:
            break
        if time.monotonic() > deadline:
            raise StatekitError(
                f"{dst.url}: rank(s) {sorted(waiting)} did not replicate their files within {timeout:g} s; "
                "the remote copy is left uncommitted"
            )
        time.sleep(PEER_POLL_SECONDS)
    for r in expected:
        dst.remove(_marker_name(r))
