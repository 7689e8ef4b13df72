"""Local file reads below the page cache: :class:`DirectReader`. Writes:
:mod:`statekit.storage.direct_write`.
"""

from __future__ import annotations

import collections
import ctypes
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from statekit.storage.hugepages import IOBuffer
from statekit.storage.streams import CACHE_STEP_BYTES

DIRECT_ALIGN = 4096
"""Bytes: file offsets, lengths and memory addresses of ``O_DIRECT`` reads are multiples
of this (4 KiB covers the logical block sizes of common disks)."""

BOUNCE_PIECE_BYTES = 8 * 1024 * 1024
"""Bytes per ``O_DIRECT`` read of a :class:`DirectReader` (one bounce buffer; a reader
holds :data:`READS_AHEAD` + 1 of them: the reads ahead go into the others while one is
copied out and checksummed). Small enough that a piece is still in cache when it is copied out, large enough for two
4 MiB requests in flight (a virtio disk's ``max_sectors_kb``). Cold 1 GiB load on the
benchmark VM against 16 MiB pieces: 0.877 and 0.895 of the time (8 and 12 alternating
runs); 2 MiB pieces were 4 % faster still (0.958 of 8 MiB's, within this VM's noise), but
one 2 MiB request in flight leaves a disk with longer latency idle, and 1 MiB took 1.8x."""

READS_AHEAD = 2
"""Reads a :class:`DirectReader` keeps in flight (or queued) ahead of the piece being
copied out, on as many threads. Alone, fio read this VM's disk as fast with one 8 MiB
request in flight as with eight; in a load, where the copy-out, the checksum and the
faulting-in of fresh memory run beside the reads, a cold 1 GiB load took 0.407 s with two
ahead against 0.437 s with one (medians of 10+10 alternating fresh processes,
``bench/compare_commits.py``)."""


_DIRECT_MIN_BYTES = 1024 * 1024  # a small read that does not continue the stream goes through the page cache


def buffer_address(view: memoryview) -> int:
    """Memory address of the first byte of a writable buffer (``ctypes``)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view)) if len(view) else 0


class DirectReader:
    """A read-only local file read sequentially below the page cache (``O_DIRECT``), opened by
    ``Storage.open_read(rel, bulk=True)``: :meth:`fill` streams aligned pieces into huge-page
    bounce buffers on helper threads, :data:`READS_AHEAD` ahead; small reads off the stream, or
    where ``O_DIRECT`` is refused, use the page cache. Why: docs/design-notes.md, "Reading tensor files".

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
        self._bounce: list[IOBuffer] = []  # made on the first large fill
        self._loaded: tuple[int, int, int] | None = None  # (file offset, bytes held, buffer) of the piece being copied out
        # (file offset, read, buffer) of the next pieces, in file order
        self._ahead: collections.deque[tuple[int, Future, int]] = collections.deque()
        self.closed = False

    @property
    def direct(self) -> bool:
        """Whether large reads bypass the page cache."""
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
        """Read ``len(view)`` bytes (a tensor's storage as ``uint8``) from the current position;
        ``on_chunk`` gets each step copied out (at most :data:`CACHE_STEP_BYTES`), in file order, on the
        caller's thread. Returns the bytes read (fewer where the file ends first).

        Raises:
            OSError: a read failed.
        """
        n = len(view)
        if self._direct_fd is None or (n < _DIRECT_MIN_BYTES and not self._streaming(self._pos)):
            return self._fill_cached(view, on_chunk)
        done = 0
        while done < n:
            piece = self._piece_at(self._pos + done)
            start = self._pos + done - piece[0]
            if start >= piece[1]:
                break  # end of file
            take = min(piece[1] - start, n - done)
            source = self._bounce[piece[2]].address + start
            for step in range(0, take, CACHE_STEP_BYTES):
                part = view[done + step : done + min(take, step + CACHE_STEP_BYTES)]
                ctypes.memmove(buffer_address(part), source + step, len(part))
                if on_chunk is not None:
                    on_chunk(part)  # while the step is still in the core's cache
            done += take
        self._pos += done
        return done

    def _fill_cached(self, view: memoryview, on_chunk: Callable[[memoryview], Any] | None) -> int:
        step = CACHE_STEP_BYTES if on_chunk is not None else BOUNCE_PIECE_BYTES  # tmpfs, 1 GiB: 0.110 s against 0.120
        done = 0
        while done < len(view):
            got = self._read_piece(view[done : done + step], self._pos + done, False)
            if not got:
                break
            if on_chunk is not None:
                on_chunk(view[done : done + got])
            done += got
        self._pos += done
        return done

    def _holds(self, position: int) -> tuple[bool, bool]:
        """Whether ``position`` lies in the piece being copied out, and in the ones read ahead."""
        loaded, ahead = self._loaded, self._ahead
        in_loaded = loaded is not None and loaded[0] <= position < loaded[0] + loaded[1]
        in_ahead = bool(ahead) and ahead[0][0] <= position < ahead[-1][0] + BOUNCE_PIECE_BYTES
        return in_loaded, in_ahead

    def _streaming(self, position: int) -> bool:
        """Whether ``position`` lies in the piece being copied out or the ones read ahead."""
        return any(self._holds(position))

    def _piece_at(self, position: int) -> tuple[int, int, int]:
        """``(file offset, bytes held, buffer)`` of the loaded piece holding ``position``
        (or ending before it at the end of the file), with the next pieces read ahead."""
        in_loaded, in_ahead = self._holds(position)
        if in_loaded:
            return self._loaded  # type: ignore[return-value]
        if in_ahead:
            while not self._ahead[0][0] <= position < self._ahead[0][0] + BOUNCE_PIECE_BYTES:
                self._ahead.popleft()[1].exception()  # skipped over (a seek forward)
        else:
            self._drain()  # a seek (or the first read): restart the stream here
            if not self._bounce:
                self._bounce = [IOBuffer(BOUNCE_PIECE_BYTES) for _ in range(READS_AHEAD + 1)]
            self._start(position - position % DIRECT_ALIGN, 0)
        offset, future, which = self._ahead.popleft()
        # The buffers not read into have been copied out: queue the next pieces into them
        # before waiting, so the read threads go on the moment a piece is in, not once this
        # thread has woken up and asked. Past the end of the file those reads get 0 bytes.
        busy = {which, *(b for _, _, b in self._ahead)}
        for free in (b for b in range(len(self._bounce)) if b not in busy):
            last = self._ahead[-1][0] if self._ahead else offset
            self._start(last + BOUNCE_PIECE_BYTES, free)
        self._loaded = (offset, future.result(), which)
        return self._loaded

    def _start(self, offset: int, which: int) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(READS_AHEAD, thread_name_prefix="statekit-read")
        future = self._pool.submit(self._read_piece, self._bounce[which].view, offset, True)
        self._ahead.append((offset, future, which))

    def _drain(self) -> None:
        """Forget the stream; reads still in flight finish first (their buffers are reused)."""
        while self._ahead:
            self._ahead.popleft()[1].exception()  # waits; a failed read-ahead nobody needs is dropped
        self._loaded = None

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
        self._loaded = None
        self._ahead.clear()
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
