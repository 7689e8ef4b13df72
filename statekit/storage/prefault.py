"""Faulting in freshly allocated host memory ahead of the reads that fill it.

A resume reads most of its bytes (the optimizer state) into tensors allocated for the
load. The first write to each page of such memory costs a page fault (the kernel zeroes
and maps the page; on a virtual machine the host backs it too): 0.14-0.22 s per 685 MiB
on the benchmark VM, and a read pays it inside its copy, in series with the disk.
:class:`Prefaulter` faults the buffers in on a helper thread while the reads run, by
writing zeros into them (``ctypes.memset``, GIL released).

Why zeros and not ``madvise(MADV_POPULATE_WRITE)`` (which faults pages in without writing
them, so it may run under a concurrent read): on the benchmark VM writing the pages
faulted 685 MiB in 0.12-0.18 s against 0.22 s for the kernel's populate, and a cold 1 GiB
load took 0.414 s against 0.428 s at the median (``bench/compare_commits.py``, 10+10
alternating fresh-process runs; 0.96-0.97x in two more). Writing needs a
hand-off so a zero never lands on bytes a read already wrote: the reader claims a buffer
(:meth:`Prefaulter.ready`) before writing into it; the helper skips a claimed buffer, and
stops zeroing one it is on after the current piece of :data:`PIECE_BYTES` (the reader
waits for that piece, then faults the rest in itself).
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import torch

PIECE_BYTES = 8 * 1024 * 1024
"""Bytes zeroed per call: how soon the helper notices that the load has ended or that
the reader has claimed the buffer it is on (at most this much zeroing is waited for)."""

PREFAULT_MIN_BYTES = 16 * 1024 * 1024
"""Below this many bytes in all, a helper thread costs more than it saves."""

_PENDING, _FAULTING, _CLAIMED, _HANDED_OVER = 0, 1, 2, 3  # _CLAIMED: faulting, the reader waits


class Prefaulter:
    """Context manager: faults in the pages of ``buffers``, in order, on a daemon thread,
    handing each buffer over to the reader when it asks (:meth:`ready`).

    A reader must call :meth:`ready` with a buffer before writing into it. Leaving the
    context stops the thread (after at most one piece of :data:`PIECE_BYTES`) and joins
    it, so no thread outlives the load (on an error too); a stopped helper hands every
    buffer over at once.

    Args:
        buffers: CPU tensors in the order they are read (their storage bytes from
            ``data_ptr()`` on, ``numel() * element_size()`` of them, must be one range).
            Their contents are undefined until read into (they are fresh memory).
    """

    def __init__(self, buffers: list[torch.Tensor]) -> None:
        self._buffers: list[torch.Tensor] | None = list(buffers)  # alive while written: a failed read drops its own
        self._ranges = [(b.data_ptr(), b.numel() * b.element_size()) for b in buffers]
        self._state = {address: _PENDING for address, _ in self._ranges}
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Prefaulter:
        if sum(n for _, n in self._ranges) >= PREFAULT_MIN_BYTES:
            self._thread = threading.Thread(target=self.run, name="statekit-prefault", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()
        if self._thread is not None:
            self._thread.join()

    def stop(self) -> None:
        """Make :meth:`run` return after the piece it is on (any thread may call it)."""
        self._stop.set()

    def ready(self, buffer: torch.Tensor) -> None:
        """Call before writing into ``buffer`` (one of the tensors given, not a view of
        one): afterwards the helper never writes to it.

        A buffer the helper has not started is handed over at once; one it is zeroing is
        handed over once the piece in progress is done (at most :data:`PIECE_BYTES`, about
        2 ms on the benchmark VM). Pages not faulted in yet are faulted by the read
        itself. A tensor that is not one of the buffers returns at once.
        """
        address = buffer.data_ptr()
        with self._changed:
            if address not in self._state:
                return
            if self._state[address] == _PENDING:
                self._state[address] = _HANDED_OVER
            elif self._state[address] == _FAULTING:
                self._state[address] = _CLAIMED
            while self._state[address] != _HANDED_OVER:
                self._changed.wait()

    def run(self) -> None:
        """Fault the buffers in, in order, on the calling thread, until done or stopped,
        skipping or leaving those the reader claims (what the context's thread runs; a
        caller with a helper thread of its own runs it there). Every buffer is handed over
        when it returns, however it returns."""
        try:
            for address, nbytes in self._ranges:
                with self._changed:
                    if self._stop.is_set() or self._state[address] != _PENDING:
                        continue
                    self._state[address] = _FAULTING
                try:
                    for offset in range(0, nbytes, PIECE_BYTES):
                        with self._changed:
                            if self._stop.is_set() or self._state[address] == _CLAIMED:
                                break
                        ctypes.memset(address + offset, 0, min(PIECE_BYTES, nbytes - offset))
                finally:
                    self._hand_over([address])
        finally:
            self._hand_over(list(self._state))
            self._buffers = None

    def _hand_over(self, addresses: list[int]) -> None:
        with self._changed:
            for address in addresses:
                self._state[address] = _HANDED_OVER
            self._changed.notify_all()
