"""The writing half of a checkpoint: every file a save writes, recorded for the manifest.

:class:`FileWriter` writes each file through the storage and records it as a typed
:class:`~statekit.format.manifest_types.FileEntry` (size, XXH3-64 checksum, rank, writer)
in the same pass as the write; the commit (:mod:`statekit.engine.commit`) takes those
entries as they are. During an async save it copies what it is given and defers the I/O
to :meth:`FileWriter.flush`. In an incremental save it asks
:class:`~statekit.engine.incremental.IncrementalReuse` whether a file is unchanged and
takes the committed one instead. The save path is drawn in ``docs/design-notes.md``
("Where a save and a load live").
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from statekit import format as fmt
from statekit.checks.files import digest_on_device
from statekit.engine.incremental import IncrementalReuse, ReuseBase
from statekit.engine.staging import StagingPool
from statekit.errors import StatekitError
from statekit.format import codec
from statekit.format.layout import NEXT_BATCH_DIR
from statekit.format.manifest_types import FileEntry
from statekit.storage import Storage, storage_errors
from statekit.storage.hashing import HashingWriter, PrefixHasher

logger = logging.getLogger("statekit")

READABLE_JSON_BYTES = 64 * 1024
"""JSON files up to this many characters are indented for people to read; larger ones
(an optimizer skeleton of thousands of parameters) are written compact, because indenting
takes Python's pure-Python encoder: 0.052 s against 0.008 s for the 1.3 MB skeleton of
2,500 layers' AdamW state."""


@dataclass(frozen=True)
class WrittenFile:
    """What a write through the checkpoint returns (``save_tensors``, ``save_json``,
    ``reuse_if_same``).

    Attributes:
        path: the file's path relative to the checkpoint.
        entry: its manifest entry (``reused_from`` set when the committed file was taken);
            None during an async save, whose writes run later (the entry is recorded then).
    """

    path: str
    entry: FileEntry | None

    @property
    def staged(self) -> bool:
        """True during an async save: the file is written (and recorded) later."""
        return self.entry is None


class FileWriter:
    """The files of one save, each written once and recorded for the manifest.

    Args:
        storage: the checkpoint's storage.
        rank: this process's rank (recorded with every file).
        mode: the checkpoint's mode, ``"save"`` (writable) or ``"load"`` (every write refused).
        staging: the host staging pool of an async save; None writes at once.
        incremental: record running checksums in every file (the next save compares with them).
        reuse_base: the committed checkpoint whose unchanged files are taken instead of written.

    Attributes:
        files: relative path -> :class:`FileEntry` of every file written (or taken) so far.
    """

    def __init__(
        self,
        storage: Storage,
        *,
        rank: int,
        mode: str,
        staging: StagingPool | None = None,
        incremental: bool = False,
        reuse_base: ReuseBase | None = None,
    ) -> None:
        self.storage = storage
        self.rank = rank
        self.mode = mode
        self.files: dict[str, FileEntry] = {}
        self.writable = mode == "save"
        self.staging = staging
        self.incremental = incremental
        self.reuse = IncrementalReuse(reuse_base)
        self._deferred: list[Callable[[], None]] = []
        self._planned: set[str] = set()

    # ---------------------------------------------------------------- bookkeeping

    def close(self) -> None:
        """Refuse every later write (the save committed)."""
        self.writable = False

    def claim(self, rel: str, what: str = "write") -> str:
        """Check that ``rel`` may be written by this save, once; returns it.

        Raises:
            StatekitError: not a save, a bad path, the manifest's name, or ``rel`` written before.
        """
        if not self.writable:
            raise StatekitError(f"{self.storage.url}: checkpoint is not open for writing ({self.mode}); cannot {what} {rel!r}")
        fmt.check_relpath(rel, source=self.storage.url, error=StatekitError)
        if rel in self._planned or rel == fmt.MANIFEST_NAME:
            raise StatekitError(f"{self.storage.url}/{rel}: written twice in one save (or reserved name)")
        self._planned.add(rel)
        return rel

    def record(self, rel: str, entry: FileEntry) -> FileEntry:
        """Keep a written file's manifest entry; returns it."""
        self.files[rel] = entry
        return entry

    def _entry(self, size_bytes: int, hasher: Any, writer: str, digest: str | None = None) -> FileEntry:
        prefixes = tuple(tuple(p) for p in hasher.prefixes) if self.incremental and hasher.prefixes else None
        return FileEntry(
            size_bytes=size_bytes, checksum=fmt.checksum_string(hasher), rank=self.rank, writer=writer,
            prefixes=prefixes, digest=digest or None,
        )

    def flush(self) -> None:
        """Perform the deferred writes of an async save, in the order they were made."""
        deferred, self._deferred = self._deferred, []
        for write in deferred:
            write()

    def record_unlisted(self, writer: str) -> list[str]:
        """Checksum and record every file under the checkpoint not written through this
        writer (hidden names, the manifest and the next-batch records skipped: those are
        written after a commit, a previous save's in a folder saved into again); fsync them
        on local disk.

        Args:
            writer: the ``writer`` recorded for these files.

        Returns:
            The relative paths recorded, sorted.

        Raises:
            StorageError: a file cannot be listed or read (names the URL).
        """
        added = []
        for rel in self.storage.find():
            if rel in self.files or rel == fmt.MANIFEST_NAME or rel.rsplit("/", 1)[-1].startswith(".") \
                    or rel.startswith(f"{NEXT_BATCH_DIR}/"):
                continue
            hasher = fmt.new_hasher()
            size = 0
            with self.storage.open_read(rel) as f, storage_errors(self.storage.url_of(rel), "reading"):
                while chunk := f.read(fmt.CHUNK_BYTES):
                    hasher.update(chunk)
                    size += len(chunk)
            self.files[rel] = FileEntry(size_bytes=size, checksum=fmt.checksum_string(hasher), rank=self.rank, writer=writer)
            added.append(rel)
        self.storage.make_durable(added)  # foreign writers do not fsync: durable before the commit names them
        return added

    # ---------------------------------------------------------------- writes

    @contextlib.contextmanager
    def writing(self, rel: str, writer: str) -> Iterator[Any]:
        """A binary file to write ``rel`` into; recorded when the block ends (staged in
        memory during an async save)."""
        self.claim(rel)
        if self.staging is not None:
            buffer = io.BytesIO()
            yield buffer
            self._defer_bytes(rel, buffer.getvalue(), writer)
            return
        with self.storage.open_write(rel) as f:
            hashing = HashingWriter(f)
            if self.incremental:  # running checksums: the next save's reuse stops at a difference
                hashing.hasher = PrefixHasher()
            yield hashing
        self.record(rel, self._entry(hashing.size_bytes, hashing.hasher, writer))

    def save_bytes(self, rel: str, data: bytes, writer: str) -> WrittenFile:
        """Write a whole small file (claimed already)."""
        if self.staging is not None:
            self._defer_bytes(rel, data, writer)
            return WrittenFile(rel, None)
        self.storage.write_bytes(rel, data)
        return WrittenFile(rel, self._bytes_entry(rel, data, writer))

    def _bytes_entry(self, rel: str, data: bytes, writer: str) -> FileEntry:
        entry = FileEntry(size_bytes=len(data), checksum=fmt.checksum_bytes(data), rank=self.rank, writer=writer)
        return self.record(rel, entry)

    def _defer_bytes(self, rel: str, data: bytes, writer: str) -> None:
        def write() -> None:
            self.storage.write_bytes(rel, data)
            self._bytes_entry(rel, data, writer)

        self._deferred.append(write)

    def save_json(self, rel: str, obj: Any, writer: str) -> WrittenFile:
        """Write a JSON file (strict JSON), indented up to :data:`READABLE_JSON_BYTES`.

        Raises:
            StatekitError: ``obj`` is not strict JSON, or the path is not a valid relative path.
        """
        self.claim(rel)
        try:
            text = json.dumps(obj, allow_nan=False, separators=(",", ":"))
            if len(text) <= READABLE_JSON_BYTES:
                text = json.dumps(obj, indent=1, allow_nan=False)
            data = text.encode("utf-8")
        except (TypeError, ValueError) as exc:
            raise StatekitError(f"{self.storage.url}/{rel}: value is not strict JSON: {exc}") from exc
        return self.save_bytes(rel, data, writer)

    def save_tensors(
        self, rel: str, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None, writer: str
    ) -> WrittenFile:
        """Write a safetensors file (or take the base's unchanged one), streaming,
        checksummed in the same pass.

        Raises:
            StatekitError: not writable, a bad path, or ``rel`` written before.
            UnsupportedDtypeError: a tensor cannot be stored (names the key).
            StorageError: the write failed.
        """
        self.claim(rel)
        committed = self.reuse.unchanged(rel, tensors, metadata, writer)
        if committed is not None:
            reused = self._take(rel, committed, writer)
            if reused is not None:
                return reused
        # an incremental save of accelerator tensors records their device digest, computed
        # before the bytes leave the device (the next save compares it there)
        digest = self.reuse.digest_for(rel)
        if digest is None and self.incremental:
            digest = digest_on_device(tensors, metadata)
        if self.staging is not None:
            fmt.build_header(tensors, metadata)  # fail now, on the caller's thread, for bad dtypes
            staged = self.staging.stage(rel, tensors)
            self._deferred.append(lambda: self._write_tensors(rel, staged, metadata, writer, digest))
            return WrittenFile(rel, None)
        return WrittenFile(rel, self._write_tensors(rel, tensors, metadata, writer, digest))

    def _write_tensors(
        self, rel: str, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None, writer: str,
        digest: str | None,
    ) -> FileEntry:
        hasher = PrefixHasher() if self.incremental else fmt.new_hasher()
        with self.storage.open_write(rel) as f:
            size = fmt.write_tensors(f, tensors, metadata, hasher)
        return self.record(rel, self._entry(size, hasher, writer, digest))

    def save_state(self, base: str, state: Any, save_tensors: Callable[[str, Any], Any], save_json: Callable[[str, Any], Any]) -> list[str]:
        """Store codec-able state as ``<base>.json`` (the skeleton) and ``<base>.safetensors``
        (the tensors, if any), through the given writers (the checkpoint's, so a plugin's
        name is recorded). Returns the relative paths written.

        Raises:
            UnsupportedValueError: a value cannot be stored without pickle (names its key
                path), before any file is written.
        """
        skeleton, tensors = codec.encode(state, root=base)
        written = []
        if tensors:
            save_tensors(f"{base}.safetensors", tensors)
            written.append(f"{base}.safetensors")
        doc = {"format": fmt.FORMAT, "codec": codec.VERSION, "tensors": bool(tensors), "state": skeleton}
        save_json(f"{base}.json", doc)
        written.append(f"{base}.json")
        return written

    # ---------------------------------------------------------------- reuse

    def reuse_if_same(self, rel: str, size_bytes: int, chunks: Callable[[], Iterable[Any]], writer: str) -> WrittenFile | None:
        """Take the base's file ``rel`` when ``chunks()`` yields exactly its bytes; None
        when nothing was reused.

        Raises:
            StatekitError: not writable, a bad path, or ``rel`` written before.
            StorageError: the reuse failed for another reason than a missing source.
        """
        if not self.writable:
            raise StatekitError(f"{self.storage.url}: checkpoint is not open for writing ({self.mode}); cannot reuse {rel!r}")
        fmt.check_relpath(rel, source=self.storage.url, error=StatekitError)
        if rel in self._planned:
            raise StatekitError(f"{self.storage.url}/{rel}: written twice in one save (or reserved name)")
        committed = self.reuse.same_stream(rel, size_bytes, chunks, writer)
        if committed is None:
            return None
        taken = self._take(rel, committed, writer)
        if taken is not None:
            self._planned.add(rel)
        return taken

    def _take(self, rel: str, committed: FileEntry, writer: str) -> WrittenFile | None:
        """Take the base's file ``rel`` (known to hold the bytes this save would write)
        into this checkpoint and record it; None when the base lost the file (write it)."""
        base = self.reuse.base
        entry = self.reuse.reused_entry(committed, self.rank, writer)
        if self.staging is not None:  # the save's files are written later, in order: so is this one
            self._deferred.append(lambda: (self.storage.reuse(rel, base.storage), self.record(rel, entry)))
            return WrittenFile(rel, None)
        try:
            how = self.storage.reuse(rel, base.storage)
        except FileNotFoundError:  # the base lost the file meanwhile (a gc): write it
            logger.info("%s/%s: %s/%s is gone, writing the file", self.storage.url, rel, base.storage.url, rel)
            return None
        logger.debug("%s/%s: unchanged since %s (%s)", self.storage.url, rel, base.name, how)
        return WrittenFile(rel, self.record(rel, entry))
