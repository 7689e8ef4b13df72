"""Is a would-be file the same as a committed one? The incremental save's verdict, decided
from memory without writing: host tensors by the committed file's running XXH3-64 records,
accelerator tensors by their file digest computed on the device.
Why: docs/design-notes.md, "Incremental checkpoints".
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from statekit.checks.digest import file_digest, on_accelerator
from statekit.format import tensors as tensors_mod
from statekit.storage.hashing import checksum_string, new_hasher
from statekit.storage.streams import CHUNK_BYTES


def digest_on_device(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None) -> str | None:
    """The file digest of what ``write_tensors`` writes for ``tensors``, computed on their device,
    when one is on an accelerator; None for host tensors.

    Args:
        tensors: ``name -> tensor``, as for :func:`~statekit.format.tensors.write_tensors`.
        metadata: extra ``__metadata__`` entries (str -> str), or None.

    Returns:
        ``"mix64:<16 hex digits>"``, or None.

    Raises:
        UnsupportedDtypeError: a tensor cannot be stored (names the key).
    """
    if not on_accelerator(tensors):
        return None
    header, planned = tensors_mod.plan_file(tensors, metadata)
    return file_digest(header, [p.tensor for p in planned])



def compare_file(
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str] | None,
    size_bytes: int,
    checksum: str,
    prefixes: Iterable[tuple[int, str]],
    digest: str | None = None,
) -> tuple[bool, str | None]:
    """Whether :func:`~statekit.format.tensors.write_tensors` would write exactly the committed
    file, decided without writing (stops at the first differing record).

    Args:
        tensors: ``name -> tensor``, as for ``write_tensors``.
        metadata: extra ``__metadata__`` entries, as for ``write_tensors``.
        size_bytes: the committed file's size, bytes.
        checksum: its ``"xxh3_64:<hex>"``.
        prefixes: its ``(offset, hex)`` records.
        digest: its ``"mix64:<hex>"`` device digest, or None.

    Returns:
        ``(same, digest)``: True when every byte would be the same; the device digest of
        the would-be file when one was computed, else None.

    Raises:
        UnsupportedDtypeError: a tensor cannot be stored (names the key), as the write would.
    """
    header, planned = tensors_mod.plan_file(tensors, metadata)
    if len(header) + sum(p.nbytes for p in planned) != size_bytes:
        return False, None
    if digest is not None and on_accelerator(tensors):
        mine = file_digest(header, [p.tensor for p in planned])
        return mine == digest, mine
    chunks = itertools.chain([header], tensors_mod.host_chunks(planned, CHUNK_BYTES))
    return same_stream_bytes(chunks, size_bytes, checksum, prefixes), None


def same_stream_bytes(chunks: Iterable[Any], size_bytes: int, checksum: str, prefixes: Iterable[tuple[int, str]]) -> bool:
    """Whether the bytes ``chunks`` yields are exactly the committed file (:func:`compare_file` for
    bytes from elsewhere); the first difference, or a byte past ``size_bytes``, stops the iteration.

    Args:
        chunks: the bytes in order, as bytes-like pieces of any size.
        size_bytes: the committed file's size, bytes.
        checksum: its ``"xxh3_64:<hex>"``.
        prefixes: its ``(offset, hex)`` records (none: compared by the checksum alone).

    Returns:
        True when every byte is the same and there are exactly ``size_bytes`` of them.
    """
    check = PrefixCheck(tuple(tuple(p) for p in prefixes))
    for chunk in chunks:
        if not check.update(chunk) or check.size_bytes > size_bytes:
            return False
    return check.size_bytes == size_bytes and check.checksum() == checksum


class PrefixCheck:
    """Hashes bytes and compares the running checksum with a committed file's records,
    for :func:`compare_file`.

    Args:
        prefixes: the committed file's ``(offset, hex)`` records (:class:`PrefixHasher`).

    Attributes:
        differs (bool): a record did not match (the caller stops hashing).
    """

    def __init__(self, prefixes: list[tuple[int, str]] | tuple[tuple[int, str], ...]) -> None:
        self._hasher = new_hasher()
        self._marks = list(prefixes)
        self._i = 0
        self.size_bytes = 0
        self.differs = False

    def update(self, data: Any) -> bool:
        """Hash ``data``; returns False as soon as a record passed differs."""
        view = memoryview(data).cast("B")
        while self._i < len(self._marks) and self.size_bytes + len(view) >= self._marks[self._i][0]:
            offset, expected = self._marks[self._i]
            cut = offset - self.size_bytes
            self._hasher.update(view[:cut])
            self.size_bytes += cut
            view = view[cut:]
            self._i += 1
            if self._hasher.hexdigest() != expected:
                self.differs = True
                return False
        self._hasher.update(view)
        self.size_bytes += len(view)
        return True

    def checksum(self) -> str:
        """``"xxh3_64:<hex>"`` of every byte hashed, as the manifest stores a file's checksum."""
        return checksum_string(self._hasher)


__all__ = ["PrefixCheck", "compare_file", "digest_on_device", "same_stream_bytes"]
