"""Checksums while bytes move: the XXH3-64 hasher (https://xxhash.com), a hashing writer and a
verifying reader, so a checksum is computed in the same pass as the write or the read.
:mod:`statekit.format` re-exports :func:`new_hasher`, :func:`checksum_string`, :func:`checksum_bytes`.
"""

from __future__ import annotations

from typing import Any, BinaryIO, Protocol

import xxhash

from statekit.errors import CorruptCheckpointError


def new_hasher() -> Any:
    """A fresh XXH3-64 hasher (``update(bytes-like)``, ``hexdigest()``).

    Returns:
        The hasher.
    """
    return xxhash.xxh3_64()


def checksum_string(hasher: Any) -> str:
    """A hasher's digest as the manifest stores it.

    Args:
        hasher: a hasher from :func:`new_hasher` that has seen the file's bytes.

    Returns:
        ``"xxh3_64:<16 hex digits>"``.
    """
    return f"xxh3_64:{hasher.hexdigest()}"


def checksum_bytes(data: bytes) -> str:
    """Checksum of an in-memory buffer, as the manifest stores it.

    Args:
        data: the whole file's bytes.

    Returns:
        ``"xxh3_64:<16 hex digits>"``.
    """
    return f"xxh3_64:{xxhash.xxh3_64_hexdigest(data)}"


class Expected(Protocol):
    """What a verifying read compares with: a file's manifest entry
    (:class:`statekit.format.manifest_types.FileEntry`, a layer above, fits)."""

    size_bytes: int
    checksum: str


def check_against(url: str, expected: Expected, size_bytes: int, hasher: Any) -> None:
    """Compare what was read with a file's manifest entry: size first, then checksum.

    Args:
        url: the file's URL, named in the error.
        expected: its manifest entry (``.size_bytes``, ``.checksum``).
        size_bytes: bytes read.
        hasher: the hasher that saw every byte read.

    Raises:
        CorruptCheckpointError: size or checksum differs (names the file).
    """
    if size_bytes != expected.size_bytes:
        raise CorruptCheckpointError(f"{url}: size {size_bytes} bytes, manifest says {expected.size_bytes}", path=url)
    actual = checksum_string(hasher)
    if actual != expected.checksum:
        raise CorruptCheckpointError(f"{url}: checksum {actual}, manifest says {expected.checksum}", path=url)


class HashingWriter:
    """File wrapper that checksums and counts what passes through ``write``; it answers the ``io``
    queries itself (so ``io.TextIOWrapper`` can wrap it), other attributes are the file's.

    Args:
        f: a binary file open for writing.

    Attributes:
        hasher: the XXH3-64 hasher of everything written.
        size_bytes (int): bytes written.
    """

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self.hasher = new_hasher()
        self.size_bytes = 0

    def write(self, data: Any) -> int:
        """Write ``data`` and account for it.

        Args:
            data: the bytes to write (any bytes-like object).

        Returns:
            The number of bytes written.
        """
        view = memoryview(data).cast("B")
        self._f.write(view)
        self.hasher.update(view)
        self.size_bytes += len(view)
        return len(view)

    def writable(self) -> bool:
        """Always True."""
        return True

    def readable(self) -> bool:
        """Always False."""
        return False

    def seekable(self) -> bool:
        """Always False: a seek would break the checksum computed in order."""
        return False

    @property
    def closed(self) -> bool:
        """Whether the wrapped file is closed."""
        return bool(getattr(self._f, "closed", False))

    def flush(self) -> None:
        """Flush the wrapped file, if it can be flushed."""
        flush = getattr(self._f, "flush", None)
        if flush is not None:
            flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


class VerifyingReader:
    """File wrapper that checksums sequential reads and checks size and checksum against a
    manifest entry at the end (a read returning nothing, or ``read()``); reading past the size
    fails at once, and a ``seek`` turns checking off.

    Args:
        f: a binary file open for reading at offset 0.
        url: its URL, named in errors.
        expected: its manifest entry (``.size_bytes``, ``.checksum``).
    """

    def __init__(self, f: BinaryIO, url: str, expected: Expected) -> None:
        self._f = f
        self._url = url
        self._expected = expected
        self._hasher = new_hasher()
        self._size = 0
        self._sequential = True
        self._checked = False

    def _account(self, data: Any) -> None:
        if self._sequential:
            self._hasher.update(data)
            self._size += len(data)
            if self._size > self._expected.size_bytes:
                self._sequential = False
                raise CorruptCheckpointError(
                    f"{self._url}: longer than the {self._expected.size_bytes} bytes the manifest says", path=self._url
                )

    def read(self, n: int = -1) -> bytes:
        """Read up to ``n`` bytes, checking the file at its end.

        Args:
            n: bytes to read, or -1 / None for the rest of the file.

        Returns:
            The bytes read (empty at the end of the file).

        Raises:
            CorruptCheckpointError: the file is longer than, or its size or checksum differs
                from, what the manifest says (names the file).
        """
        data = self._f.read(n)
        self._account(data)
        if self._sequential and (not data or n is None or n < 0):
            self._finish()
        return data

    def read1(self, n: int = -1) -> bytes:
        """As :meth:`read` (``io.TextIOWrapper`` reads through ``read1``).

        Args:
            n: bytes to read, or -1 for the rest of the file.

        Returns:
            The bytes read (empty at the end of the file).
        """
        return self.read(n)

    def readinto(self, buffer: Any) -> int:
        """Read into a writable buffer, checking the file at its end.

        Args:
            buffer: a writable bytes-like object.

        Returns:
            The number of bytes read (0 at the end of the file).

        Raises:
            CorruptCheckpointError: as :meth:`read`.
        """
        got = self._f.readinto(buffer)
        self._account(memoryview(buffer)[:got])
        if not got:
            self._finish()
        return got

    def seek(self, offset: int, whence: int = 0) -> int:
        """Seek in the file; from then on nothing is checked.

        Args:
            offset: as ``io.IOBase.seek``.
            whence: as ``io.IOBase.seek``.

        Returns:
            The new position.
        """
        self._sequential = False
        return self._f.seek(offset, whence)

    def readable(self) -> bool:
        """Always True."""
        return True

    def writable(self) -> bool:
        """Always False."""
        return False

    @property
    def closed(self) -> bool:
        """Whether the wrapped file is closed."""
        return bool(getattr(self._f, "closed", False))

    def _finish(self) -> None:
        if self._checked or not self._sequential:
            return
        self._checked = True
        check_against(self._url, self._expected, self._size, self._hasher)

    def close(self) -> None:
        """Close the wrapped file (nothing is checked)."""
        self._f.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


PREFIX_STEP_BYTES = 64 * 1024 * 1024
"""A :class:`PrefixHasher` records the running checksum every this many bytes of a file
(after its first ``head`` bytes): the points at which an incremental save can tell, while
hashing a would-be file from memory, that it differs from a committed one, and stop."""


PREFIX_FIRST_BYTES = 1024 * 1024
"""After a :meth:`PrefixHasher.mark` (the end of a header), the next record comes after this
many bytes: a file of a fully trained model differs in its first tensor, and a save that
compares it stops after hashing this much instead of :data:`PREFIX_STEP_BYTES`."""


class PrefixHasher:
    """The XXH3-64 hasher of a file that also records the checksum of its first ``n`` bytes at
    chosen offsets, in the same pass (XXH3's streaming digest,
    https://github.com/Cyan4973/xxHash): the evidence for incremental saves
    (:func:`statekit.checks.files.compare_file`).

    Args:
        step: a record every ``step`` bytes (:data:`PREFIX_STEP_BYTES`) after the last one;
            :meth:`mark` adds one at a boundary the caller knows (the end of a header).

    Attributes:
        prefixes (list[tuple[int, str]]): ``(offset, 16 hex digits)`` per record, in order
            (the whole file's checksum is not among them).
    """

    def __init__(self, step: int = PREFIX_STEP_BYTES) -> None:
        self._hasher = new_hasher()
        self._step = step
        self._next = step
        self.size_bytes = 0
        self.prefixes: list[tuple[int, str]] = []

    def mark(self) -> None:
        """Record the checksum of the bytes so far; the next record follows after
        :data:`PREFIX_FIRST_BYTES`, then every ``step`` bytes.
        """
        self.prefixes.append((self.size_bytes, self._hasher.hexdigest()))
        self._next = self.size_bytes + min(PREFIX_FIRST_BYTES, self._step)

    def update(self, data: Any) -> None:
        """Hash ``data`` (bytes-like), recording the checksum at every offset it passes."""
        view = memoryview(data).cast("B")
        while self.size_bytes + len(view) >= self._next:
            cut = self._next - self.size_bytes
            self._hasher.update(view[:cut])
            self.size_bytes += cut
            view = view[cut:]
            self.prefixes.append((self.size_bytes, self._hasher.hexdigest()))
            self._next += self._step
        self._hasher.update(view)
        self.size_bytes += len(view)

    def hexdigest(self) -> str:
        """The checksum of every byte so far (16 hex digits)."""
        return self._hasher.hexdigest()
