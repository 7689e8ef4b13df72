"""Copying one committed checkpoint to another root, verified at the destination, manifest last.

The copy behind two-tier checkpoints (:mod:`statekit_replicate.replication`). Every data file is
streamed (no staging copy of the checkpoint), read back at the destination and checked
against the manifest's size and XXH3-64 checksum, and the manifest is written last with
the same atomic commit as a save (:meth:`statekit.plugin_api.Storage.commit`): a copy
interrupted anywhere has no manifest and is never loaded.

Several ranks assemble one copy: each copies the files its rank wrote (the manifest's
``rank`` field) from its own, possibly node-local, directory and then leaves a marker
(:data:`MARKER_PREFIX`); rank 0 commits once every rank's marker names the same manifest
and its files, and removes the markers first.
"""

from __future__ import annotations

import io
import json
import time
from typing import Callable

from statekit.plugin_api import (
    MANIFEST_NAME,
    CorruptCheckpointError,
    FileEntry,
    Manifest,
    StatekitError,
    Storage,
    VerifyingReader,
    checksum_bytes,
    end_copy_in_progress,
    mark_copy_in_progress,
    read_manifest,
)

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

    Returns:
        The manifest.

    Raises:
        IncompleteCheckpointError: ``src`` is not committed (and no ``manifest_bytes``).
        CorruptCheckpointError: a copied file's size or checksum differs at the destination.
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
    bases: dict[str, tuple[Storage, Manifest | None]] = {}
    for rel in mine:
        meta = manifest.files[rel]
        _copy_file(src, dst, rel, meta, bases)
        if on_file_copied is not None:
            on_file_copied(meta.size_bytes)
    if world_size > 1:
        marker = {"manifest": checksum_bytes(raw), "files": mine}
        if rank != 0:
            dst.write_bytes(_marker_name(rank), json.dumps(marker).encode("utf-8"))
            return manifest
        _wait_for_ranks(dst, manifest, marker["manifest"], world_size, peer_timeout_seconds)
    dst.commit(MANIFEST_NAME, raw)
    end_copy_in_progress(dst)
    return manifest


def _copy_file(src: Storage, dst: Storage, rel: str, meta: FileEntry, bases: dict[str, tuple[Storage, Manifest | None]]) -> None:
    """Copy one data file and verify it at the destination (size and checksum)."""
    if meta.reused_from and _copy_from_remote_base(dst, rel, meta, bases):
        return  # an unchanged file of an incremental save: copied server-side, nothing uploaded
    if meta.size_bytes <= COPY_CHUNK_BYTES:  # one PUT and one GET (a busy training thread makes each call slow)
        dst.write_bytes(rel, src.read_bytes(rel))
        VerifyingReader(io.BytesIO(dst.read_bytes(rel)), dst.url_of(rel), meta).read()  # checks size and checksum
        return
    with src.open_read(rel) as f, dst.open_write(rel) as out:
        while chunk := f.read(COPY_CHUNK_BYTES):
            out.write(chunk)
    with dst.open_read(rel) as f:
        reader = VerifyingReader(f, dst.url_of(rel), meta)
        while reader.read(COPY_CHUNK_BYTES):  # the empty read at the end checks size and checksum
            pass


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
