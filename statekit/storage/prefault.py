"""Faulting in freshly allocated host memory ahead of the reads that fill it.

A resume reads most of its bytes (the optimizer state) into tensors allocated for the
load. The first write to each page of such memory costs a page fault (the kernel zeroes
and maps the page; on a virtual machine the host backs it too): about 0.4-0.6 s per GiB
on the benchmark VM, and an ``O_DIRECT`` read pays it inside the request, in series
with the disk. :class:`Prefaulter` asks the kernel to fault the buffers in on a helper
thread while the reads run, with ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+: "populate
(prefault) page tables writable ... but avoid the actual memory access", so it never
changes bytes a concurrent read already wrote; https://man7.org/linux/man-pages/man2/madvise.2.html).
``ctypes`` releases the GIL during the call. Where the kernel lacks it, nothing is done.
"""

from __future__ import annotations

import errno
import threading
from typing import Any

import torch

from statekit.storage.hugepages import MADVISE_AVAILABLE, madvise

MADV_POPULATE_WRITE = 23
"""From ``<linux/mman.h>`` (Python's :mod:`mmap` does not export it)."""

PIECE_BYTES = 8 * 1024 * 1024
"""Bytes populated per call: how soon the helper notices that the load has ended."""

PREFAULT_MIN_BYTES = 16 * 1024 * 1024
"""Below this many bytes in all, a helper thread costs more than it saves."""


def populate(address: int, nbytes: int) -> bool:
    """Fault in the pages of ``[address, address + nbytes)`` writable, contents unchanged.

    Args:
        address: first byte (any alignment; rounded down to its page).
        nbytes: length in bytes.

    Returns:
        False where the kernel or libc cannot (no ``MADV_POPULATE_WRITE``: ``EINVAL``;
        not Linux), True otherwise.
    """
    result = madvise(address, nbytes, MADV_POPULATE_WRITE)
    return result is not None and result not in (errno.EINVAL, errno.ENOSYS)


class Prefaulter:
    """Context manager: faults in the pages of ``buffers``, in order, on a daemon thread.

    The reads need not wait for it and it never writes: a page the reader reaches first
    is faulted by the reader, as without the helper. Leaving the context stops the
    thread (after at most one piece of :data:`PIECE_BYTES`) and joins it, so no thread
    outlives the load (on an error too).

    Args:
        buffers: CPU tensors in the order they are read (their storage bytes from
            ``data_ptr()`` on, ``numel() * element_size()`` of them, must be one range).
    """

    def __init__(self, buffers: list[torch.Tensor]) -> None:
        self._ranges = [(b.data_ptr(), b.numel() * b.element_size()) for b in buffers]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Prefaulter:
        if MADVISE_AVAILABLE and sum(n for _, n in self._ranges) >= PREFAULT_MIN_BYTES:
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

    def run(self) -> None:
        """Fault the buffers in, in order, on the calling thread, until done or stopped
        (what the context's thread runs; a caller with a helper thread of its own runs
        it there)."""
        for address, nbytes in self._ranges:
            for offset in range(0, nbytes, PIECE_BYTES):
                if self._stop.is_set() or not populate(address + offset, min(PIECE_BYTES, nbytes - offset)):
                    return
