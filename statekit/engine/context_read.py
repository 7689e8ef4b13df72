"""The reading half of the checkpoint context: files read through a :class:`~statekit.Checkpoint`.

On load with ``verify`` on, every file read is checked against its manifest entry (size
and XXH3-64 checksum) in the same pass as the read, by
:class:`statekit.storage.hashing.VerifyingReader` or by the hasher handed to
:func:`statekit.format.read_tensors`. :class:`CheckpointReads` is a base class of
:class:`statekit.engine.context.Checkpoint`, which holds the identity of a save or load
and its writing half.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from typing import Any, BinaryIO

import torch

from statekit import format as fmt
from statekit.engine.read_ahead import FreshAhead, worth_reading_ahead
from statekit.errors import CorruptCheckpointError
from statekit.format import codec
from statekit.storage import Storage, storage_errors
from statekit.storage.direct import DirectReader
from statekit.storage.hashing import VerifyingReader, check_against


class CheckpointReads:
    """Reading methods of :class:`statekit.Checkpoint`: ``read_bytes``, ``load_tensors``,
    ``load_json``, ``load_state``, and the reading side of ``open`` (``"rb"``, ``"r"``).

    Attributes:
        storage: the checkpoint's storage.
        url (str): the checkpoint's URL.
        manifest (dict | None): the manifest reads are checked against.
        verify (bool): check sizes and checksums while reading.
    """

    storage: Storage
    url: str
    manifest: dict[str, Any] | None
    verify: bool
    _ahead: FreshAhead | None = None

    @contextlib.contextmanager
    def fresh_memory_ahead(self, rels: list[str]) -> Iterator[None]:
        """Within the block, the large local tensor files among ``rels`` (read later in
        the block into fresh memory, in this order) get their buffers made and faulted
        in ahead, on a helper thread (:class:`statekit.engine.read_ahead.FreshAhead`)."""
        rels = [rel for rel in rels if worth_reading_ahead(self.manifest, rel)]
        if not rels or self._ahead is not None:
            yield
            return
        self._ahead = FreshAhead(self.storage, rels)
        try:
            yield
        finally:
            self._ahead.close()
            self._ahead = None

    @contextlib.contextmanager
    def _reading(self, rel: str) -> Iterator[Any]:
        fmt.check_relpath(rel, source=self.url)
        expected = self._expected(rel)
        f = self._open_read(rel)
        try:
            yield f if expected is None else VerifyingReader(f, f"{self.url}/{rel}", expected)
        finally:
            f.close()

    def _open_read(self, rel: str) -> BinaryIO:
        try:
            return self.storage.open_read(rel)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{self.url}/{rel}: file is missing", path=f"{self.url}/{rel}") from None

    def _open_tensor_file(self, rel: str) -> Any:
        """A local tensor file as a :class:`DirectReader` (``O_DIRECT`` through huge-page
        bounce buffers, the copy-out and checksum overlapped with the next read); remote
        ones as :meth:`_open_read` does."""
        if not self.storage.is_local:
            return self._open_read(rel)
        try:
            return DirectReader(self.storage.path_of(rel))
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{self.url}/{rel}: file is missing", path=f"{self.url}/{rel}") from None
        except OSError:
            return self._open_read(rel)

    def _expected(self, rel: str) -> dict[str, Any] | None:
        if not self.verify or self.manifest is None:
            return None
        entry = self.manifest["files"].get(rel)
        if entry is None:
            raise CorruptCheckpointError(
                f"{self.url}/{rel}: file is not listed in the manifest", path=f"{self.url}/{rel}"
            )
        return entry

    def _check(self, rel: str, expected: dict[str, Any] | None, size_bytes: int, hasher: Any) -> None:
        if expected is not None:
            check_against(f"{self.url}/{rel}", expected, size_bytes, hasher)

    def read_bytes(self, rel: str) -> bytes:
        """Read a whole file, verified against the manifest when ``verify`` is on.

        Args:
            rel: path relative to the checkpoint.

        Returns:
            The file's bytes.

        Raises:
            CorruptCheckpointError: missing, or size/checksum mismatch (names the file).
        """
        fmt.check_relpath(rel, source=self.url)
        expected = self._expected(rel)
        with self._open_read(rel) as f, storage_errors(f"{self.url}/{rel}", "reading"):
            data = f.read()
        if expected is not None:
            hasher = fmt.new_hasher()
            hasher.update(data)
            self._check(rel, expected, len(data), hasher)
        return data

    def load_tensors(
        self,
        rel: str,
        into: Mapping[str, torch.Tensor] | None = None,
        names: list[str] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Read a safetensors file of the checkpoint (verified when ``verify`` is on).

        Args:
            rel: relative path.
            into: tensors to fill in place (see :func:`statekit.format.read_tensors`).
            names: read only these names (ignored while verifying, which reads every byte).

        Returns:
            ``name -> tensor`` (CPU tensors, or the ``into`` targets).

        Raises:
            CorruptCheckpointError: missing file, malformed header, truncated data, size or
                checksum mismatch (names the file). With ``into``, targets read before the
                fault hold new values; the message says the load is incomplete.
        """
        fmt.check_relpath(rel, source=self.url)
        expected = self._expected(rel)
        url = f"{self.url}/{rel}"
        hasher = fmt.new_hasher() if expected is not None else None
        with self._open_tensor_file(rel) as f, storage_errors(url, "reading"):
            size = expected["size_bytes"] if expected is not None else self.storage.size(rel)
            fresh, ready = (self._ahead.take(rel), self._ahead.ready) if self._ahead is not None else (None, None)
            tensors, header = fmt.read_tensors(f, url, size, into=into, names=names, hasher=hasher, fresh=fresh, ready=ready)
            seen = header.data_start + header.data_bytes  # the bytes the header accounts for
            if expected is not None and seen == expected["size_bytes"]:
                seen = f.seek(0, 2)  # bytes appended after them are never read: the open file's size says
        if expected is not None:
            self._check(rel, expected, seen, hasher)
        return tensors

    def load_json(self, rel: str) -> Any:
        """Read a JSON file (verified when ``verify`` is on).

        Args:
            rel: path relative to the checkpoint.

        Returns:
            The decoded JSON value.

        Raises:
            CorruptCheckpointError: missing, mismatched or not JSON (names the file).
        """
        data = self.read_bytes(rel)
        try:
            return json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CorruptCheckpointError(f"{self.url}/{rel}: not valid JSON: {exc}", path=f"{self.url}/{rel}") from None

    def load_state(self, base: str, shapes_only: bool = False) -> Any:
        """Read what :meth:`save_state` wrote under ``base``.

        Args:
            base: the ``base`` given to :meth:`save_state`.
            shapes_only: tensors come back as meta tensors of the saved shapes and dtypes,
                made from the tensor file's header: no tensor data is read (a load checks
                that a state fits before it reads it, :mod:`statekit.engine.optimizer_fit`).
                A value that needs its data to be rebuilt (a NumPy array) raises
                ``TypeError`` or ``RuntimeError``.

        Returns:
            The state, with the same types as saved.

        Raises:
            CorruptCheckpointError: a file is missing, malformed or fails verification.
            StateMismatchError: a saved Enum or namedtuple class is not imported in this
                process (loading never imports code), or lacks the saved value.
            FormatVersionError: the file's codec version is newer than this statekit reads.
        """
        doc = self.load_json(f"{base}.json")
        if not isinstance(doc, dict) or "state" not in doc:
            raise CorruptCheckpointError(f"{self.url}/{base}.json: not a statekit state file", path=f"{self.url}/{base}.json")
        if not doc.get("tensors"):
            tensors = {}
        elif shapes_only:
            tensors = self._meta_tensors(f"{base}.safetensors")
        else:
            tensors = self.load_tensors(f"{base}.safetensors")
        source = f"{self.url}/{base}.json"
        return codec.decode(doc["state"], tensors, source=source, root=base, version=doc.get("codec", 1))

    def _meta_tensors(self, rel: str) -> dict[str, torch.Tensor]:
        """``name -> meta tensor`` of a tensor file's header (aliases included); reads the header only.

        Raises:
            CorruptCheckpointError: missing file or malformed header (names the file).
        """
        fmt.check_relpath(rel, source=self.url)
        expected = self._expected(rel)
        url = f"{self.url}/{rel}"
        with self._open_read(rel) as f, storage_errors(url, "reading"):
            size = expected["size_bytes"] if expected is not None else self.storage.size(rel)
            header = fmt.read_header(f, url, size)
        tensors = {e.name: torch.empty(e.shape, dtype=e.dtype, device="meta") for e in header.entries}
        tensors.update({alias: tensors[name] for alias, name in header.aliases.items()})
        return tensors
