"""The file-like interface through which the format writes and reads bulk bytes (tensor data).

:mod:`statekit.format.tensors` streams tensor bytes to and from any binary file object; it
knows nothing of how the storage moves them (``O_DIRECT``, alignment, bounce buffers,
preallocation). The storage's own files do that behind three calls, and every other file
object (an fsspec file, ``io.BytesIO``, a plugin's file) does the plain thing:

- :func:`bulk_writer` ``(f)`` -> an object with ``preallocate(nbytes)`` (a size hint),
  ``write(data)`` and ``write_stable(data)`` (``data`` stays valid and unchanged until the
  file is closed, so it may be written without a copy). A
  :class:`statekit.storage.direct_write.DirectWriter` is returned as it is (contiguous
  extents, page-aligned writes straight from the caller's memory); any other file gets
  :class:`PlainWriter` (no hint, both writes are its ``write``).
- :func:`fill` ``(f, view, on_chunk)`` reads ``len(view)`` bytes into ``view``: a
  :class:`statekit.storage.direct.DirectReader` by its own ``fill`` (``O_DIRECT`` pieces
  read ahead, the copy-out and ``on_chunk`` overlapped with the next read); any other file
  by ``readinto`` (or ``read``) in steps of :data:`CHUNK_BYTES`.

Nothing here imports the rest of statekit: the direct reader and writer import
:data:`CACHE_STEP_BYTES` from here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

CHUNK_BYTES = 16 * 1024 * 1024
"""Largest single write/read of a plain file, bytes: big enough for sequential I/O, small
enough to bound buffers."""

CACHE_STEP_BYTES = 256 * 1024
"""Bytes a copy and the checksum of the same bytes alternate in (copy a step, hash it,
next step): the hash then reads the step from the core's L2 cache (1 MiB on the benchmark
VM), not from memory. A second pass over memory costs a load or save time beside the
copy itself, and on a VM it also slows the disk (docs/benchmark.md, "The VM")."""


@runtime_checkable
class BulkWriter(Protocol):
    """What the format writes tensor files through (see :func:`bulk_writer`)."""

    def preallocate(self, size: int) -> None:
        """Hint: the file will hold ``size`` bytes."""

    def write(self, data: Any) -> int:
        """Write ``data`` (copied before the call returns); returns ``len(data)``."""

    def write_stable(self, data: Any) -> int:
        """Write ``data``, which the caller keeps alive and unchanged until the file is closed."""


class PlainWriter:
    """:class:`BulkWriter` over any binary file: no size hint, both writes are its ``write``.

    Args:
        f: a binary file open for writing.
    """

    def __init__(self, f: Any) -> None:
        self.write = f.write
        self.write_stable = f.write

    def preallocate(self, size: int) -> None:
        """Nothing: a plain file grows as it is written."""


def bulk_writer(f: Any) -> BulkWriter:
    """The :class:`BulkWriter` for ``f``: ``f`` itself when it is one (the storage's
    :class:`~statekit.storage.direct_write.DirectWriter`), else a :class:`PlainWriter`.

    Args:
        f: a binary file open for writing.

    Returns:
        An object with ``preallocate``, ``write`` and ``write_stable``.
    """
    return f if isinstance(f, BulkWriter) else PlainWriter(f)


def fill(f: Any, view: memoryview, on_chunk: Callable[[memoryview], Any] | None = None) -> int:
    """Read ``len(view)`` bytes from ``f``'s position into ``view``, in place.

    Args:
        f: a binary file (a :class:`~statekit.storage.direct.DirectReader` reads with its
            own ``fill``; others with ``readinto``, or ``read`` and a copy).
        view: the destination bytes (a tensor's storage as bytes).
        on_chunk: called with each part of ``view`` as it is filled, in order (the
            checksum update), or None.

    Returns:
        Bytes read: ``len(view)``, or fewer where the file ends first.

    Raises:
        OSError: a read failed (and whatever ``f`` raises).
    """
    own = getattr(f, "fill", None)
    if own is not None:  # fewer than len(view) only at the end of the file
        return own(view, on_chunk)
    done, total = 0, len(view)
    readinto = getattr(f, "readinto", None)
    while done < total:
        want = min(CHUNK_BYTES, total - done)
        if readinto is not None:
            got = readinto(view[done : done + want])
        else:
            data = f.read(want)
            got = len(data)
            view[done : done + got] = data
        if not got:
            break
        if on_chunk is not None:
            on_chunk(view[done : done + got])
        done += got
    return done
