"""Local file writes below the page cache: :class:`DirectWriter` (``O_DIRECT`` with two
reused aligned buffers and a writer thread, or straight from the caller's aligned memory:
:meth:`DirectWriter.write_stable`) and :func:`fsync_path`. Reads: :mod:`statekit.storage.direct`."""

from __future__ import annotations

import ctypes
import fcntl
import os
import threading
from typing import Any

from statekit.storage.direct import DIRECT_ALIGN as _DIRECT_ALIGN
from statekit.storage.direct import buffer_address
from statekit.storage.hugepages import IOBuffer

DIRECT_BUFFER_BYTES = 8 * 1024 * 1024
"""Size of each aligned buffer of a :class:`DirectWriter` (two per writer, pooled): small
enough to stay in cache between the copy into it and the write from it. 1 GiB saves on
the benchmark VM against 16 MiB buffers: 0.920, 0.925 and 0.992 of the time (8, 12 and
12 alternating runs); 4 MiB 0.970, 2 MiB 1.019."""

_buffer_pool: list[IOBuffer] = []
_buffer_lock = threading.Lock()


def _take_buffer() -> IOBuffer:
    with _buffer_lock:
        if _buffer_pool:
            return _buffer_pool.pop()
    return IOBuffer(DIRECT_BUFFER_BYTES)  # huge-page aligned and backed: half the write time


def _give_buffer(buf: IOBuffer) -> None:
    with _buffer_lock:
        if len(_buffer_pool) < 4:
            _buffer_pool.append(buf)
            return
    buf.close()


def _address(view: memoryview) -> int:
    """:func:`buffer_address`, or 1 (never aligned) for a read-only or empty buffer, which
    then takes the copying path."""
    try:
        return buffer_address(view) if len(view) else 1
    except (TypeError, ValueError):
        return 1


class DirectWriter:
    """A write-only local file that bypasses the page cache (``O_DIRECT``) where allowed.

    Bytes given to :meth:`write` are copied into one of two huge-page-backed buffers
    (:class:`statekit.storage.hugepages.IOBuffer`, :data:`DIRECT_BUFFER_BYTES` each,
    reused across files); a full buffer is written by a
    helper thread (``os.write`` releases the GIL) while the caller fills the other, so the
    copy overlaps the I/O. Each buffer's thread is started while the write before it still
    runs and goes on the moment it ends, so the disk does not wait for the caller to wake
    up between buffers (1 GiB saves 0.816 and 0.937 of the time before, 10+10 runs twice).
    The last, partial block is written padded to 4 KiB and the file truncated to its true
    size. Where the file system refuses ``O_DIRECT`` (tmpfs,
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
        self._views = [b.view for b in self._bufs]
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
        """Copy ``data`` (any bytes-like) into the buffers; full buffers go to the disk.

        The copy is ``ctypes.memmove``, which releases the GIL (a slice assignment holds it:
        the next buffer's writer thread then waited for it before it could start its write:
        1 GiB saves take 0.945 of the time with memmove, median of 10+10 alternating fresh
        processes, ``bench/compare_commits.py``),
        except for read-only data (``bytes``: headers), which is copied by slicing.
        """
        view = memoryview(data).cast("B")
        n = len(view)
        source = _address(view)
        pos = 0
        while pos < n:
            take = min(n - pos, DIRECT_BUFFER_BYTES - self._fill)
            if source != 1:
                ctypes.memmove(self._bufs[0].address + self._fill, source + pos, take)
            else:
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
        self._join(self._chain(view[:whole]))  # bounds the writes in flight to two, as _submit
        self._size += whole
        if whole < len(view):
            self.write(view[whole:])
        return len(view)

    def flush(self) -> None:
        """No-op: data reaches the file in whole buffers and at :meth:`close`."""

    def preallocate(self, size: int) -> None:
        """Reserve ``size`` bytes on disk up front (``posix_fallocate``; best effort) so the
        file gets contiguous extents: ``O_DIRECT`` writes in 8 MiB pieces otherwise leave a
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
        """Hand the filled buffer to a new writer thread, which starts writing the moment
        the write before it ends (not once this thread has woken up and started it), then
        wait for that earlier write: its buffer is the one filled next."""
        previous = self._chain(self._view[:length])
        self._bufs.reverse()
        self._views.reverse()
        self._view = self._views[0]
        self._fill = 0
        self._join(previous)

    def _chain(self, view: memoryview) -> threading.Thread | None:
        """Start the thread that writes ``view`` after the current one; returns the one before."""
        previous = self._thread
        self._thread = threading.Thread(target=self._write_after, args=(previous, view), name="statekit-write", daemon=True)
        self._thread.start()
        return previous

    def _join(self, previous: threading.Thread | None) -> None:
        """Wait for an earlier write; raise the first write error seen."""
        if previous is not None:
            previous.join()
        if self._error is not None:
            self._wait()  # raises it

    def _write_after(self, previous: threading.Thread | None, view: memoryview) -> None:
        if previous is not None:
            previous.join()  # writes go to the file in order
        if self._error is None:
            self._write_all(view)

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


def fsync_path(path: str) -> None:
    """fsync a local file (its data) or directory (a rename or create in it) so it is
    durable; a no-op where unsupported or when ``path`` is gone."""
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
