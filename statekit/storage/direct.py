"""Local file reads below the page cache: :class:`DirectReader` (``O_DIRECT`` reads
straight into the caller's memory, the next piece read while the caller checksums the
last). Writes: :mod:`statekit.storage.direct_write`."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from statekit.storage.hugepages import IOBuffer

DIRECT_ALIGN = 4096
"""Bytes: file offsets, lengths and memory addresses of ``O_DIRECT`` reads are multiples
of this (4 KiB covers the logical block sizes of common disks)."""

READ_PIECE_BYTES = 32 * 1024 * 1024
"""Largest single read of a :class:`DirectReader`: on this VM's virtio disk one 32 MiB
``O_DIRECT`` request (split into 4 MiB requests in flight) read about 1.3x faster than
16 MiB buffered ``readinto`` calls (bench/load_profile.py)."""

BOUNCE_PIECE_BYTES = 16 * 1024 * 1024
"""Bytes per ``O_DIRECT`` read into a bounce buffer, for a destination whose address does
not agree with the file position modulo :data:`DIRECT_ALIGN` (a model's existing
parameters: the allocator puts large tensors 64 bytes past a page). Two such buffers per
reader: one is read into while the other is copied out and checksummed."""

_DIRECT_MIN_BYTES = 1024 * 1024  # smaller reads go through the page cache


def buffer_address(view: memoryview) -> int:
    """Memory address of the first byte of a writable buffer (``ctypes``)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view)) if len(view) else 0


class DirectReader:
    """A read-only local file whose large reads bypass the page cache (``O_DIRECT``).

    :meth:`fill` reads a whole destination (a tensor's bytes) from the current position:
    when the destination's address and the file position agree modulo
    :data:`DIRECT_ALIGN` the aligned middle is read with ``O_DIRECT`` straight into it in
    pieces of up to :data:`READ_PIECE_BYTES` (no intermediate copy), on a helper thread
    one piece ahead of the caller's ``on_chunk`` (the checksum), since ``os.preadv``
    releases the GIL; a large destination that does not agree is read with ``O_DIRECT``
    into two alternating page-aligned bounce buffers of :data:`BOUNCE_PIECE_BYTES`, one
    piece ahead, and copied out on the caller's thread with the GIL released (instead of
    page-cache reads: the cold 1 GiB benchmark load took 0.60x the time,
    ``bench/compare_commits.py``, docs/benchmark.md); the unaligned head and tail
    and small reads use ``os.preadv`` on an ordinary descriptor (page cache).
    Where ``O_DIRECT`` is refused (tmpfs, some network file systems) every read goes
    through the page cache. ``read``/``readinto``/``seek``/``tell`` make it usable as a
    binary file for header parsing.

    Args:
        path: the local file to read.

    Raises:
        FileNotFoundError: no such file.
        OSError: it cannot be opened.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self._direct_fd: int | None = None
        if hasattr(os, "O_DIRECT"):
            try:
                self._direct_fd = os.open(path, os.O_RDONLY | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0))
            except OSError:
                self._direct_fd = None
        self._pos = 0
        self._pool: ThreadPoolExecutor | None = None
        self._bounce: list[IOBuffer] = []  # made on the first misaligned fill
        self.closed = False

    @property
    def direct(self) -> bool:
        """Whether large aligned reads bypass the page cache."""
        return self._direct_fd is not None

    def readable(self) -> bool:
        """Always True."""
        return True

    def seekable(self) -> bool:
        """Always True."""
        return True

    def tell(self) -> int:
        """The current position, bytes from the start."""
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        """Move the position (``whence`` 0: absolute, 1: relative, 2: from the end); returns it."""
        base = {0: 0, 1: self._pos, 2: os.fstat(self._fd).st_size}[whence]
        self._pos = base + offset
        return self._pos

    def read(self, n: int = -1) -> bytes:
        """Read up to ``n`` bytes (the rest with -1) through the page cache."""
        if n is None or n < 0:
            n = max(0, os.fstat(self._fd).st_size - self._pos)
        data = os.pread(self._fd, n, self._pos)
        self._pos += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        """Fill ``buffer`` (writable bytes-like) as :meth:`fill` does; returns bytes read."""
        return self.fill(memoryview(buffer).cast("B"))

    def fill(self, view: memoryview, on_chunk: Callable[[memoryview], Any] | None = None) -> int:
        """Read ``len(view)`` bytes from the current position into ``view``.

        Args:
            view: the destination bytes (e.g. a tensor's storage as ``uint8``).
            on_chunk: called on the caller's thread with each piece read, in file order,
                while the next piece is read (the checksum update), or None.

        Returns:
            Bytes read: ``len(view)``, or fewer where the file ends first.

        Raises:
            OSError: a read failed.
        """
        pieces = self._plan(view)
        done = 0
        pending = self._submit(view, pieces, 0)
        for i in range(len(pieces)):
            got = pending.result() if isinstance(pending, Future) else pending
            start, end, mode = pieces[i]
            full = got == end - start
            pending = self._submit(view, pieces, i + 1) if full else 0
            if mode == "bounce" and got:  # piece i+1 goes to the other buffer meanwhile
                # ctypes calls release the GIL: the helper thread issues the next read while this copies
                source = self._bounce[i % 2].address + (self._pos + start) % DIRECT_ALIGN
                ctypes.memmove(buffer_address(view[start : start + got]), source, got)
            if got and on_chunk is not None:
                on_chunk(view[start : start + got])
            done += got
            if not full:
                break
        self._pos += done
        return done

    def _plan(self, view: memoryview) -> list[tuple[int, int, str]]:
        """``(start, end, mode)`` pieces of ``view``; mode ``"direct"`` (into ``view``),
        ``"bounce"`` (``O_DIRECT`` into a bounce buffer, then copied) or ``"cache"``."""
        n = len(view)
        if self._direct_fd is None or n < _DIRECT_MIN_BYTES:
            return [(s, min(n, s + READ_PIECE_BYTES), "cache") for s in range(0, n, READ_PIECE_BYTES)]
        if (buffer_address(view) - self._pos) % DIRECT_ALIGN:
            if not self._bounce:
                self._bounce = [IOBuffer(BOUNCE_PIECE_BYTES + DIRECT_ALIGN) for _ in range(2)]
            return [(s, min(n, s + BOUNCE_PIECE_BYTES), "bounce") for s in range(0, n, BOUNCE_PIECE_BYTES)]
        head = (-self._pos) % DIRECT_ALIGN
        stop = head + (n - head) // DIRECT_ALIGN * DIRECT_ALIGN
        pieces = [(0, head, "cache")] if head else []
        pieces += [(s, min(stop, s + READ_PIECE_BYTES), "direct") for s in range(head, stop, READ_PIECE_BYTES)]
        if stop < n:
            pieces.append((stop, n, "cache"))
        return pieces

    def _submit(self, view: memoryview, pieces: list[tuple[int, int, str]], i: int) -> Future | int:
        if i >= len(pieces):
            return 0
        start, end, mode = pieces[i]
        if mode == "cache" or (mode == "direct" and end - start < _DIRECT_MIN_BYTES):
            return self._read_piece(view[start:end], self._pos + start, mode == "direct")
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="statekit-read")
        if mode == "bounce":
            return self._pool.submit(self._read_bounced, i % 2, self._pos + start, end - start)
        return self._pool.submit(self._read_piece, view[start:end], self._pos + start, True)

    def _read_bounced(self, which: int, offset: int, n: int) -> int:
        """``O_DIRECT``-read the aligned file range around ``[offset, offset + n)`` into
        bounce buffer ``which`` (the bytes start at ``offset % DIRECT_ALIGN`` in it);
        returns how many of the ``n`` bytes it holds."""
        skew = offset % DIRECT_ALIGN
        length = (skew + n + DIRECT_ALIGN - 1) // DIRECT_ALIGN * DIRECT_ALIGN
        got = self._read_piece(self._bounce[which].view[:length], offset - skew, True)
        return max(0, min(n, got - skew))

    def _read_piece(self, piece: memoryview, offset: int, direct: bool) -> int:
        done = 0
        while done < len(piece):
            fd = self._direct_fd if direct and self._direct_fd is not None else self._fd
            try:
                got = os.preadv(fd, [piece[done:]], offset + done)
            except OSError as exc:
                if fd == self._fd or exc.errno != 22:  # EINVAL: O_DIRECT refused for this read
                    raise
                direct = False
                continue
            if not got:
                break
            done += got
            if direct and done % DIRECT_ALIGN:
                direct = False  # a short O_DIRECT read (end of file): finish through the page cache
        return done

    def close(self) -> None:
        """Close both descriptors and the helper thread. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for buffer in self._bounce:
            buffer.close()
        self._bounce = []
        os.close(self._fd)
        if self._direct_fd is not None:
            os.close(self._direct_fd)

    def __enter__(self) -> DirectReader:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
