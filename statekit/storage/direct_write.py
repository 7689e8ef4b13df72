"""Local file writes below the page cache: :class:`DirectWriter` (``O_DIRECT`` from reused
aligned buffers, several writes in flight on helper threads, or straight from the caller's
aligned memory: :meth:`DirectWriter.write_stable`). Reads: :mod:`statekit.storage.direct`."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import queue
import threading
from typing import Any

from statekit.storage.direct import DIRECT_ALIGN as _DIRECT_ALIGN
from statekit.storage.direct import buffer_address
from statekit.storage.hugepages import IOBuffer

DIRECT_BUFFER_BYTES = 4 * 1024 * 1024
"""Size of each aligned buffer of a :class:`DirectWriter`, bytes: one request of the
virtio disk (its ``max_sectors_kb`` is 4096 on the benchmark VM), small enough to stay in
cache between the copy into it and the write from it."""

DIRECT_DEPTH = 4
"""Writer threads of one :class:`DirectWriter`, so writes in flight at once; it holds one
more buffer than this (the one being filled) and queues at most one write beyond them.
1 GiB sync save: 0.308 s against 0.338 s with one write in flight (other depths and
buffer sizes: docs/design-notes.md, "Performance")."""

_buffer_pool: list[IOBuffer] = []
_buffer_lock = threading.Lock()


def _pooled_buffer() -> IOBuffer | None:
    """A buffer from the pool, or None when it has none."""
    with _buffer_lock:
        return _buffer_pool.pop() if _buffer_pool else None


def _new_buffer() -> IOBuffer:
    return IOBuffer(DIRECT_BUFFER_BYTES)  # huge-page aligned and backed: half the write time


def _give_buffer(buf: IOBuffer) -> None:
    with _buffer_lock:
        if len(_buffer_pool) <= DIRECT_DEPTH and buf.nbytes == DIRECT_BUFFER_BYTES:
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
    """A write-only local file (``path``, truncated if it exists) that bypasses the page cache
    (``O_DIRECT``) where allowed, through the page cache where refused (tmpfs): :meth:`write`
    copies into reused huge-page buffers written by up to :data:`DIRECT_DEPTH` threads at once.
    After a failed write none is started; the next call raises it, and the file's content is
    undefined. Design and measurements: docs/design-notes.md, "Performance".

    Raises:
        OSError: the file cannot be created.
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
        self._buf: IOBuffer | None = None  # being filled
        self._held = 0  # buffers taken (current, spare and in flight), at most DIRECT_DEPTH + 1
        self._fill = 0  # bytes in self._buf
        self._offset = 0  # file offset of self._buf's first byte
        self._size = 0
        self._spare: list[IOBuffer] = []  # held, not in flight
        self._inflight = 0  # writes handed to the writer threads and not yet reported done
        self._jobs: queue.SimpleQueue[tuple[memoryview, int, IOBuffer | None] | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[tuple[IOBuffer | None, bool]] = queue.SimpleQueue()  # (buffer, was written)
        self._making = 0  # buffers a helper thread is still making for this writer
        self._made_short = False  # one could not be made (out of memory)
        self._threads: list[threading.Thread] = []
        self._helpers: list[threading.Thread] = []  # _make_buffers threads
        self._error: BaseException | None = None
        self._flag_lock = threading.Lock()
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
        """Copy ``data`` (any bytes-like) into the buffers; full buffers go to the disk. Returns
        ``len(data)`` in bytes.

        Raises:
            OSError: an earlier write failed (the first failure).
        """
        self._raise_failure()
        view = memoryview(data).cast("B")
        n = len(view)
        source = _address(view)
        pos = 0
        while pos < n:
            if self._buf is None:
                self._buf = self._next_buffer()
            take = min(n - pos, DIRECT_BUFFER_BYTES - self._fill)
            if source != 1:
                ctypes.memmove(self._buf.address + self._fill, source + pos, take)
            else:
                self._buf.view[self._fill : self._fill + take] = view[pos : pos + take]
            self._fill += take
            pos += take
            if self._fill == DIRECT_BUFFER_BYTES:
                self._submit_buffer(DIRECT_BUFFER_BYTES)
        self._size += n
        return n

    def write_stable(self, data: Any) -> int:
        """:meth:`write` without the copy where ``data`` and the file position are page-aligned; the
        caller keeps ``data`` alive and unchanged until :meth:`close`. Returns ``len(data)`` in bytes.

        Raises:
            OSError: an earlier write failed (the first failure).
        """
        view = memoryview(data).cast("B")
        whole = len(view) // _DIRECT_ALIGN * _DIRECT_ALIGN
        if not self.direct or not whole or self._fill % _DIRECT_ALIGN or _address(view) % _DIRECT_ALIGN:
            return self.write(view)
        self._raise_failure()
        if self._fill:
            self._submit_buffer(self._fill)
        for start in range(0, whole, DIRECT_BUFFER_BYTES):
            piece = view[start : min(whole, start + DIRECT_BUFFER_BYTES)]
            self._make_room()
            self._start(piece, self._offset, None)
            self._offset += len(piece)
        self._size += whole
        if whole < len(view):
            self.write(view[whole:])
        return len(view)

    def flush(self) -> None:
        """No-op: data reaches the file in whole buffers and at :meth:`close`."""

    def preallocate(self, size: int) -> None:
        """Reserve ``size`` bytes up front (``posix_fallocate``, best effort): contiguous extents read
        back faster (docs/benchmark.md), and ext4 runs the writes in flight side by side.
        """
        if size <= 0 or not hasattr(os, "posix_fallocate"):
            return
        try:
            os.posix_fallocate(self._fd, 0, size)
            self._allocated = size
        except OSError:
            pass

    def _submit_buffer(self, length: int) -> None:
        """Send the first ``length`` bytes of the current buffer to the disk at its offset."""
        self._make_room()
        self._start(self._buf.view[:length], self._offset, self._buf)  # type: ignore[union-attr]
        self._offset += length
        self._fill = 0
        self._buf = None  # the next one is taken when bytes come for it

    def _next_buffer(self) -> IOBuffer:
        """A spare buffer, else one from the pool while fewer than :data:`DIRECT_DEPTH` + 1 are held,
        else the first one a finished write or :meth:`_make_buffers` hands back.
        """
        while not self._spare:
            if self._held + self._making <= DIRECT_DEPTH:
                buf = _pooled_buffer()
                if buf is None and not self._inflight and not self._making:
                    buf = _new_buffer()
                if buf is not None:
                    self._held += 1
                    return buf
                if not self._made_short:
                    count = DIRECT_DEPTH + 1 - self._held - self._making
                    helper = threading.Thread(
                        target=self._make_buffers, args=(count,), name="statekit-buffers", daemon=True
                    )
                    self._helpers.append(helper)
                    self._making += count
                    helper.start()
            self._finish_one()
        return self._spare.pop()

    def _make_buffers(self, count: int) -> None:
        """Make ``count`` buffers and fault them in on a helper thread (fresh memory is slow to touch
        on a VM), handing each over as it is ready (None: one that could not be made).
        """
        for made in range(count):
            buf: IOBuffer | None = None
            try:
                buf = _new_buffer()
                ctypes.memset(buf.address, 0, buf.nbytes)  # the page faults, GIL released
            except BaseException:  # noqa: BLE001 - out of memory: the writer goes on with fewer
                if buf is not None:
                    buf.close()
                for _ in range(count - made):
                    self._done.put((None, False))
                return
            self._done.put((buf, False))

    def _make_room(self) -> None:
        """Wait until at most :data:`DIRECT_DEPTH` writes are outstanding (one per writer thread plus
        one queued, so a thread takes the next write at once; measured in docs/design-notes.md).
        """
        while self._inflight > DIRECT_DEPTH:
            self._finish_one()

    def _start(self, view: memoryview, offset: int, buf: IOBuffer | None) -> None:
        if len(self._threads) < min(DIRECT_DEPTH, self._inflight + 1):  # started as writes overlap
            thread = threading.Thread(target=self._serve, name="statekit-write", daemon=True)
            self._threads.append(thread)  # first: an interrupt inside start() leaves no thread _release misses
            thread.start()
        self._jobs.put((view, offset, buf))
        self._inflight += 1  # after the put: an interrupt between them leaves no count that no write reports

    def _finish_one(self) -> None:
        """Wait until a write ends (its buffer becomes spare) or a buffer being made
        arrives. Raises the first write error seen."""
        self._take_done()
        self._raise_failure()

    def _take_done(self) -> None:
        buf, wrote = self._done.get()
        if wrote:
            self._inflight -= 1
        else:
            self._making -= 1
            self._held += buf is not None
            self._made_short |= buf is None  # no more tries: go on with the buffers held
        if buf is not None:
            self._spare.append(buf)

    def _serve(self) -> None:
        """A writer thread: writes jobs until it gets None, reporting each one done."""
        while (job := self._jobs.get()) is not None:
            view, offset, buf = job
            self._write_at(view, offset)
            self._done.put((buf, True))

    def _raise_failure(self) -> None:
        if self._error is not None:
            raise self._error

    def _write_at(self, view: memoryview, offset: int) -> None:
        """Write all of ``view`` at ``offset`` (helper thread). Keeps the first error and
        skips the write once one is kept, so nothing is started after a failure."""
        if self._error is not None:
            return
        try:
            done = 0
            while done < len(view):
                was_direct = self.direct  # (another writer thread may drop O_DIRECT meanwhile)
                try:
                    done += os.pwrite(self._fd, view[done:], offset + done)
                except OSError as exc:
                    if not was_direct or exc.errno != errno.EINVAL:  # O_DIRECT refused here
                        raise
                    self._drop_direct()
        except BaseException as exc:  # noqa: BLE001 - raised on the caller's thread
            if self._error is None:
                self._error = exc

    def _drop_direct(self) -> None:
        with self._flag_lock:
            if self.direct:
                fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~os.O_DIRECT)
                self.direct = False

    def _drain(self) -> None:
        """Wait for every write in flight and every buffer being made, keeping the
        buffers (errors stay in self._error)."""
        while self._inflight or self._making:
            self._take_done()

    def close(self) -> None:
        """Write the tail, wait for every write, truncate to the true size, fsync, close.
        Idempotent.

        Raises:
            OSError: a write, the truncate or the fsync failed (the first failure).
        """
        if self.closed:
            return
        self.closed = True
        try:
            tail = self._fill
            if tail and self._error is None:
                padded = -(-tail // _DIRECT_ALIGN) * _DIRECT_ALIGN if self.direct else tail
                if padded != tail:
                    self._buf.view[tail:padded] = bytes(padded - tail)  # type: ignore[union-attr]
                self._submit_buffer(padded)
            self._drain()
            self._raise_failure()
            if self._allocated > self._size or self._offset > self._size:
                os.ftruncate(self._fd, self._size)
            os.fsync(self._fd)
        finally:
            self._release()

    def abort(self) -> None:
        """Close without fsync after a failure (the caller removes or ignores the file);
        waits for the writes in flight, which read from buffers it gives back."""
        if self.closed:
            return
        self.closed = True
        self._release()

    def _release(self) -> None:
        # Waits for the threads themselves, not for the counts: an interrupt (KeyboardInterrupt)
        # on the caller's thread may have left a count that no report will match (a report
        # taken from self._done but not yet counted): a wait for it would never end.
        for _ in self._threads:
            self._jobs.put(None)  # after every job queued: each thread ends once those are written
        for thread in (*self._threads, *self._helpers):
            if thread.ident is not None:  # (one whose start() was interrupted may never have run)
                thread.join()
        self._threads, self._helpers = [], []
        while not self._done.empty():  # every thread has ended: no report comes later
            buf, _ = self._done.get_nowait()
            if buf is not None:
                self._spare.append(buf)
        self._inflight = self._making = 0
        os.close(self._fd)
        for buf in (self._buf, *self._spare):
            if buf is not None:
                _give_buffer(buf)
        self._buf, self._spare = None, []

    def __enter__(self) -> DirectWriter:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if exc_info[0] is None:
            self.close()
        else:
            self.abort()
