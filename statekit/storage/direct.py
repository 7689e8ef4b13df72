"""Local file I/O below the page cache: :class:`DirectWriter` (``O_DIRECT`` with two
reused aligned buffers and a writer thread), :class:`DirectReader` (``O_DIRECT`` reads
straight into the caller's memory, the next piece read while the caller checksums the
last) and :func:`fsync_dir`."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import mmap
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


DIRECT_BUFFER_BYTES = 16 * 1024 * 1024
"""Size of each aligned buffer of a :class:`DirectWriter` (two per writer, pooled)."""

_DIRECT_ALIGN = 4096
_buffer_pool: list[mmap.mmap] = []
_buffer_lock = threading.Lock()


def _take_buffer() -> mmap.mmap:
    with _buffer_lock:
        if _buffer_pool:
            return _buffer_pool.pop()
    return mmap.mmap(-1, DIRECT_BUFFER_BYTES)  # page-aligned, as O_DIRECT needs


def _give_buffer(buf: mmap.mmap) -> None:
    with _buffer_lock:
        if len(_buffer_pool) < 4:
            _buffer_pool.append(buf)
            return
    with contextlib.suppress(BufferError):
        buf.close()


def _address(view: memoryview) -> int:
    """Memory address of a writable buffer's first byte; 1 (never aligned) for a
    read-only or empty one, which then takes the copying path."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    except (TypeError, ValueError):
        return 1


class DirectWriter:
    """A write-only local file that bypasses the page cache (``O_DIRECT``) where allowed.

    Bytes given to :meth:`write` are copied into one of two page-aligned buffers
    (:data:`DIRECT_BUFFER_BYTES` each, reused across files); a full buffer is written by a
    helper thread (``os.write`` releases the GIL) while the caller fills the other, so the
    copy overlaps the I/O. The last, partial block is written padded to 4 KiB and the
    file truncated to its true size. Where the file system refuses ``O_DIRECT`` (tmpfs,
    some network file systems) the same code writes through the page cache. On this VM
    buffered writes of 1 GiB ran at 0.11-0.29 GB/s (dirty-page throttling), ``O_DIRECT``
    at about 1 GB/s (see docs/benchmark.md).

    Args:
        path: the file to create (truncated if it exists).
    """

    def __init__(self, path: str) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        direct = getattr(os, "O_DIRECT", 0)
        self.direct = bool(direct)
        try:
            self._fd = os.open(path, flags | direct, 0o644)
        except OSError:
            if not direct:
                raise
            self.direct = False
            self._fd = os.open(path, flags, 0o644)
        self._bufs = [_take_buffer(), _take_buffer()]
        self._views = [memoryview(b) for b in self._bufs]
        self._view = self._views[0]
        self._fill = 0
        self._size = 0
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._allocated = 0
        self.closed = False

    def fileno(self) -> int:
        """The OS file descriptor."""
        return self._fd

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def tell(self) -> int:
        """Bytes written so far."""
        return self._size

    def write(self, data: Any) -> int:
        """Copy ``data`` (any bytes-like) into the buffers; full buffers go to the disk."""
        view = memoryview(data).cast("B")
        n = len(view)
        pos = 0
        while pos < n:
            take = min(n - pos, DIRECT_BUFFER_BYTES - self._fill)
            self._view[self._fill : self._fill + take] = view[pos : pos + take]
            self._fill += take
            pos += take
            if self._fill == DIRECT_BUFFER_BYTES:
                self._submit(DIRECT_BUFFER_BYTES)
        self._size += n
        return n

    def write_stable(self, data: Any) -> int:
        """:meth:`write` without the copy where it can: the page-aligned part of ``data``
        goes to the disk straight from the caller's memory (``O_DIRECT``) when that memory
        is page-aligned and the file position is too; the rest is copied as by
        :meth:`write`. The caller keeps ``data`` alive and unchanged until :meth:`close`
        (a staging arena does: it is reused only by the next save).

        Returns:
            ``len(data)`` in bytes.
        """
        view = memoryview(data).cast("B")
        whole = len(view) // _DIRECT_ALIGN * _DIRECT_ALIGN
        if not self.direct or not whole or self._fill % _DIRECT_ALIGN or _address(view) % _DIRECT_ALIGN:
            return self.write(view)
        if self._fill:
            self._submit(self._fill)
        self._wait()
        self._thread = threading.Thread(target=self._write_all, args=(view[:whole],), daemon=True)
        self._thread.start()
        self._size += whole
        if whole < len(view):
            self.write(view[whole:])
        return len(view)

    def flush(self) -> None:
        """No-op: data reaches the file in whole buffers and at :meth:`close`."""

    def preallocate(self, size: int) -> None:
        """Reserve ``size`` bytes on disk up front (``posix_fallocate``; best effort) so the
        file gets contiguous extents: ``O_DIRECT`` writes in 16 MiB pieces otherwise leave a
        file fragmented enough to read back 2x slower cold on ext4 (docs/benchmark.md)."""
        if size <= 0 or not hasattr(os, "posix_fallocate"):
            return
        try:
            os.posix_fallocate(self._fd, 0, size)
            self._allocated = size
        except OSError:
            pass

    def _wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _submit(self, length: int) -> None:
        self._wait()
        view = self._view[:length]
        self._thread = threading.Thread(target=self._write_all, args=(view,), daemon=True)
        self._thread.start()
        self._views.reverse()
        self._view = self._views[0]
        self._fill = 0

    def _write_all(self, view: memoryview) -> None:
        try:
            done = 0
            while done < len(view):
                try:
                    done += os.write(self._fd, view[done:])
                except OSError as exc:
                    if not self.direct or exc.errno != 22:  # EINVAL: O_DIRECT refused here
                        raise
                    fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~os.O_DIRECT)
                    self.direct = False
        except BaseException as exc:  # noqa: BLE001 - raised on the caller's thread
            self._error = exc

    def close(self) -> None:
        """Write the tail, truncate to the true size, fsync, close. Idempotent."""
        if self.closed:
            return
        self.closed = True
        try:
            tail = self._fill
            if tail:
                padded = -(-tail // _DIRECT_ALIGN) * _DIRECT_ALIGN if self.direct else tail
                if padded != tail:
                    self._view[tail:padded] = bytes(padded - tail)
                self._submit(padded)
                self._wait()
                if padded != tail:
                    os.ftruncate(self._fd, self._size)
            self._wait()
            if self._allocated > self._size:
                os.ftruncate(self._fd, self._size)
            os.fsync(self._fd)
        finally:
            self._release()

    def abort(self) -> None:
        """Close without fsync after a failure (the caller removes or ignores the file)."""
        if self.closed:
            return
        self.closed = True
        self._release()

    def _release(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        os.close(self._fd)
        self._view = None  # type: ignore[assignment]
        for view in self._views:
            view.release()
        for buf in self._bufs:
            _give_buffer(buf)
        self._views, self._bufs = [], []

    def __enter__(self) -> DirectWriter:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if exc_info[0] is None:
            self.close()
        else:
            self.abort()


def fsync_dir(path: str) -> None:
    """fsync a local directory so a rename or create in it is durable (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


DIRECT_ALIGN = _DIRECT_ALIGN
"""Bytes: file offsets, lengths and memory addresses of ``O_DIRECT`` reads are multiples
of this (4 KiB covers the logical block sizes of common disks)."""

READ_PIECE_BYTES = 32 * 1024 * 1024
"""Largest single read of a :class:`DirectReader`: on this VM's virtio disk one 32 MiB
``O_DIRECT`` request (split into 4 MiB requests in flight) read about 1.3x faster than
16 MiB buffered ``readinto`` calls (bench/load_profile.py)."""

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
    releases the GIL; the unaligned head and tail, small reads and misaligned
    destinations are read with ``os.preadv`` on an ordinary descriptor (page cache).
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
            start, end, _ = pieces[i]
            full = got == end - start
            pending = self._submit(view, pieces, i + 1) if full else 0
            if got and on_chunk is not None:
                on_chunk(view[start : start + got])
            done += got
            if not full:
                break
        self._pos += done
        return done

    def _plan(self, view: memoryview) -> list[tuple[int, int, bool]]:
        """``(start, end, direct)`` pieces of ``view``: head and tail through the page cache."""
        n = len(view)
        if self._direct_fd is None or n < _DIRECT_MIN_BYTES or (buffer_address(view) - self._pos) % DIRECT_ALIGN:
            return [(s, min(n, s + READ_PIECE_BYTES), False) for s in range(0, n, READ_PIECE_BYTES)]
        head = (-self._pos) % DIRECT_ALIGN
        stop = head + (n - head) // DIRECT_ALIGN * DIRECT_ALIGN
        pieces = [(0, head, False)] if head else []
        pieces += [(s, min(stop, s + READ_PIECE_BYTES), True) for s in range(head, stop, READ_PIECE_BYTES)]
        if stop < n:
            pieces.append((stop, n, False))
        return pieces

    def _submit(self, view: memoryview, pieces: list[tuple[int, int, bool]], i: int) -> Future | int:
        if i >= len(pieces):
            return 0
        start, end, direct = pieces[i]
        if not direct or end - start < _DIRECT_MIN_BYTES:
            return self._read_piece(view[start:end], self._pos + start, direct)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="statekit-read")
        return self._pool.submit(self._read_piece, view[start:end], self._pos + start, direct)

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
        os.close(self._fd)
        if self._direct_fd is not None:
            os.close(self._direct_fd)

    def __enter__(self) -> DirectReader:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
