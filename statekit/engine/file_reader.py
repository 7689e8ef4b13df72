"""The reading half of a checkpoint: every file a load reads, checked (``verify``) against
the manifest's size and XXH3-64 checksum in the same pass as the read, each opened once per
session (docs/design-notes.md, "Where a save and a load live").
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from statekit import format as fmt
from statekit.engine.read_ahead import FreshAhead, worth_reading_ahead
from statekit.errors import CorruptCheckpointError, StatekitError
from statekit.format import codec
from statekit.format.manifest_types import FileEntry, Manifest
from statekit.storage import Storage, storage_errors
from statekit.storage.hashing import VerifyingReader, check_against


@dataclass
class _OpenTensorFile:
    """A tensor file opened for one load, at its data section; ``hasher`` (the bytes read so
    far) and ``expected`` (its manifest entry) when verifying, else None; ``size`` in bytes."""

    file: Any
    header: fmt.TensorHeader
    hasher: Any
    size: int
    expected: FileEntry | None


class FileReader:
    """The files of one load (or of a committed checkpoint read with verification); a
    ``manifest`` of None is nothing to check against."""

    def __init__(self, storage: Storage, manifest: Manifest | None, verify: bool) -> None:
        self.storage = storage
        self.url = storage.url
        self.manifest = manifest
        self.verify = verify
        self._held: dict[str, _OpenTensorFile] | None = None  # inside session()
        self._kept_json: dict[str, bytes] | None = None
        self._ahead: FreshAhead | None = None

    # ---------------------------------------------------------------- one open per file

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """:meth:`statekit.Checkpoint.reading_each_file_once`.

        Raises:
            StorageError: closing a file failed (raised only when the block did not raise).
        """
        if self._held is not None:
            yield
            return
        self._held, self._kept_json = {}, {}
        failed = True
        try:
            yield
            failed = False
        finally:
            held, self._held, self._kept_json = self._held, None, None
            errors = []
            for rel, opened in held.items():
                try:
                    with storage_errors(f"{self.url}/{rel}", "closing"):
                        opened.file.close()
                except Exception as exc:  # noqa: BLE001 - close the others first
                    errors.append(exc)
            if errors and not failed:  # (after a failure, that failure is what the caller sees)
                raise errors[0]

    @contextlib.contextmanager
    def fresh_memory_ahead(self, rels: list[str]) -> Iterator[None]:
        """Make the buffers of the large local tensor files among ``rels`` ahead, on a
        helper thread (see :meth:`statekit.Checkpoint.fresh_memory_ahead`)."""
        # only local files: their buffers come from the page cache, which the read-ahead warms
        rels = [rel for rel in rels if self.storage.local_path(rel) is not None and worth_reading_ahead(self.manifest, rel)]
        if not rels or self._ahead is not None:
            yield
            return
        headers = {}
        for rel in rels:
            with contextlib.suppress(StatekitError):  # CorruptCheckpointError, StorageError: reported by its read
                headers[rel] = self.tensor_header(rel)
        self._ahead = FreshAhead(headers)
        try:
            yield
        finally:
            self._ahead.close()
            self._ahead = None

    # ---------------------------------------------------------------- opening

    def _expected(self, rel: str) -> FileEntry | None:
        if not self.verify or self.manifest is None:
            return None
        entry = self.manifest.files.get(rel)
        if entry is None:
            raise CorruptCheckpointError(
                f"{self.url}/{rel}: file is not listed in the manifest", path=f"{self.url}/{rel}"
            )
        return entry

    def _open(self, rel: str, bulk: bool = False) -> BinaryIO:
        """``Storage.open_read`` (which chooses the I/O method); a missing file is a
        :class:`CorruptCheckpointError` naming it."""
        try:
            return self.storage.open_read(rel, bulk=bulk)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{self.url}/{rel}: file is missing", path=f"{self.url}/{rel}") from None

    @contextlib.contextmanager
    def reading(self, rel: str) -> Iterator[Any]:
        """A binary file of the checkpoint, verified when read to its end (with ``verify``)."""
        fmt.check_relpath(rel, source=self.url)
        expected = self._expected(rel)
        f = self._open(rel)
        try:
            yield f if expected is None else VerifyingReader(f, f"{self.url}/{rel}", expected)
        finally:
            f.close()

    def _open_tensor_file(self, rel: str) -> _OpenTensorFile:
        """Open a tensor file (``bulk``: the storage layer picks ``O_DIRECT`` locally) and
        parse its header, hashed when verifying; the file is left at its data section.

        Raises:
            CorruptCheckpointError: missing file or malformed header (names the file);
                the file is closed.
            StorageError: the storage failed (names the URL).
        """
        fmt.check_relpath(rel, source=self.url)
        expected = self._expected(rel)
        url = f"{self.url}/{rel}"
        f = self._open(rel, bulk=True)
        try:
            with storage_errors(url, "reading"):
                size = expected.size_bytes if expected is not None else self.storage.size(rel)
                hasher = fmt.new_hasher() if expected is not None else None
                header = fmt.read_header(f, url, size, hasher)
        except BaseException:
            f.close()
            raise
        return _OpenTensorFile(f, header, hasher, size, expected)

    # ---------------------------------------------------------------- reads

    def tensor_header(self, rel: str) -> fmt.TensorHeader:
        """The parsed header of a tensor file (kept open inside :meth:`session`).

        Raises:
            CorruptCheckpointError: missing file or malformed header (names the file).
            StorageError: the storage failed (names the URL).
        """
        if self._held is not None and rel in self._held:
            return self._held[rel].header
        opened = self._open_tensor_file(rel)
        if self._held is not None:
            self._held[rel] = opened
        else:
            opened.file.close()
        return opened.header

    def read_bytes(self, rel: str) -> bytes:
        """A whole file's bytes, verified against the manifest when ``verify`` is on.

        Raises:
            CorruptCheckpointError: missing, or size/checksum mismatch (names the file).
        """
        fmt.check_relpath(rel, source=self.url)
        expected = self._expected(rel)
        with self._open(rel) as f, storage_errors(f"{self.url}/{rel}", "reading"):
            data = f.read()
        if expected is not None:
            hasher = fmt.new_hasher()
            hasher.update(data)
            check_against(f"{self.url}/{rel}", expected, len(data), hasher)
        return data

    def load_tensors(
        self, rel: str, into: Mapping[str, torch.Tensor] | None = None, names: list[str] | None = None
    ) -> dict[str, torch.Tensor]:
        """Read a safetensors file (through the file its header was read from, inside
        :meth:`session`), verified when ``verify`` is on.

        Raises:
            CorruptCheckpointError: missing file, malformed header, truncated data, size or
                checksum mismatch (names the file).
        """
        opened = self._held.pop(rel, None) if self._held is not None else None
        if opened is None:
            opened = self._open_tensor_file(rel)
        url = f"{self.url}/{rel}"
        f, expected = opened.file, opened.expected
        try:
            with storage_errors(url, "reading"):
                fresh, ready = (self._ahead.take(rel), self._ahead.ready) if self._ahead is not None else (None, None)
                tensors, header = fmt.read_tensors(
                    f, url, opened.size, into=into, names=names, hasher=opened.hasher, fresh=fresh, ready=ready,
                    header=opened.header,
                )
                seen = header.data_start + header.data_bytes  # the bytes the header accounts for
                if expected is not None and seen == expected.size_bytes:
                    seen = f.seek(0, 2)  # bytes appended after them are never read: the open file's size says
        finally:
            f.close()
        if expected is not None:
            check_against(url, expected, seen, opened.hasher)
        return tensors

    def load_json(self, rel: str) -> Any:
        """A JSON file's value (verified when ``verify`` is on).

        Raises:
            CorruptCheckpointError: missing, mismatched or not JSON (names the file).
        """
        return self._decode_json(rel, self.read_bytes(rel))

    def _decode_json(self, rel: str, data: bytes) -> Any:
        try:
            return json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CorruptCheckpointError(f"{self.url}/{rel}: not valid JSON: {exc}", path=f"{self.url}/{rel}") from None

    def load_state(self, base: str, shapes_only: bool = False) -> Any:
        """What ``save_state`` wrote under ``base`` (see :meth:`statekit.Checkpoint.load_state`).

        Raises:
            CorruptCheckpointError, StateMismatchError, FormatVersionError: as there.
        """
        rel = f"{base}.json"
        data = self._kept_json.pop(rel, None) if self._kept_json is not None else None
        if data is None:
            data = self.read_bytes(rel)
        if shapes_only and self._kept_json is not None:
            self._kept_json[rel] = data  # the skeleton (no tensor data), for the full read
        doc = self._decode_json(rel, data)
        if not isinstance(doc, dict) or "state" not in doc:
            raise CorruptCheckpointError(f"{self.url}/{rel}: not a statekit state file", path=f"{self.url}/{rel}")
        if not doc.get("tensors"):
            tensors = {}
        elif shapes_only:
            tensors = self._meta_tensors(f"{base}.safetensors")
        else:
            tensors = self.load_tensors(f"{base}.safetensors")
        return codec.decode(doc["state"], tensors, source=f"{self.url}/{rel}", root=base, version=doc.get("codec", 1))

    def _meta_tensors(self, rel: str) -> dict[str, torch.Tensor]:
        """``name -> meta tensor`` of a tensor file's header (aliases included); reads the header only."""
        header = self.tensor_header(rel)
        tensors = {e.name: torch.empty(e.shape, dtype=e.dtype, device="meta") for e in header.entries}
        tensors.update({alias: tensors[name] for alias, name in header.aliases.items()})
        return tensors
