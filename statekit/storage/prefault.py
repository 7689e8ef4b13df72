"""Faulting in freshly allocated host memory (a resume's optimizer state) on a helper thread
while the reads that fill it run, by writing zeros (``ctypes.memset``, GIL released), with a
hand-off so a zero never lands on bytes a read wrote. Why zeros and not
``MADV_POPULATE_WRITE``, with measurements: docs/design-notes.md, "Reading tensor files"."""

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
    """Context manager: faults in the pages of ``buffers`` (CPU tensors in read order, each one
    range of ``numel() * element_size()`` bytes from ``data_ptr()``; contents undefined until read
    into), in order, on a daemon thread. A reader calls :meth:`ready` with a buffer before writing
    into it; leaving the context stops and joins the thread (after at most :data:`PIECE_BYTES`)."""

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
        """Call before writing into ``buffer`` (one of the tensors given): afterwards the helper never
        writes to it (a piece in progress finishes first, at most :data:`PIECE_BYTES`).
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
        """Fault the buffers in, in order, on the calling thread, until done or stopped; every buffer
        is handed over when it returns.
        """
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
