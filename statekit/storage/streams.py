"""The file-like interface through which the format streams bulk bytes, knowing nothing of
``O_DIRECT``: :func:`bulk_writer` (a ``DirectWriter`` as it is, any other file a
:class:`PlainWriter`) and :func:`fill`. Imports nothing else of statekit.
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
    """The :class:`BulkWriter` for the binary file ``f``: ``f`` itself when it is one (a
    :class:`~statekit.storage.direct_write.DirectWriter`), else a :class:`PlainWriter`."""
    return f if isinstance(f, BulkWriter) else PlainWriter(f)


def fill(f: Any, view: memoryview, on_chunk: Callable[[memoryview], Any] | None = None) -> int:
    """Read ``len(view)`` bytes from ``f``'s position into ``view`` in place; ``on_chunk`` gets each
    filled part in order, or None. Returns the bytes read (fewer where the file ends first).

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
