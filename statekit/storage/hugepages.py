"""Host memory for ``O_DIRECT`` I/O, backed by transparent huge pages where the kernel allows
(https://docs.kernel.org/admin-guide/mm/transhuge.html; measured: docs/benchmark.md, "Huge pages").
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
from typing import Any

MADV_HUGEPAGE = 14
"""From ``<linux/mman.h>`` (Python's :mod:`mmap` exports it only on some builds)."""

_PAGE = mmap.PAGESIZE


def _huge_page_bytes() -> int:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 2 * 1024 * 1024


HUGE_PAGE_BYTES = _huge_page_bytes()
"""Bytes per transparent huge page (``hpage_pmd_size``; 2 MiB on x86-64 and most arm64)."""


def _libc_madvise() -> Any:
    try:
        fn = ctypes.CDLL(None).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_madvise = _libc_madvise()


def advise_huge(address: int, nbytes: int) -> bool:
    """``madvise(MADV_HUGEPAGE)`` for ``[address, address + nbytes)``; True when the kernel took it."""
    if _madvise is None or nbytes < 1:
        return False
    start = address - address % _PAGE
    return _madvise(start, address + nbytes - start, MADV_HUGEPAGE) == 0


class IOBuffer:
    """``nbytes`` of private anonymous memory starting on a huge-page boundary (so page-aligned, as
    ``O_DIRECT`` needs), advised to use huge pages, for reuse across requests.

    Attributes:
        view: a writable ``memoryview`` of the ``nbytes`` bytes.
        address: the address of ``view``'s first byte.
        nbytes: its length in bytes.

    Raises:
        OSError: the kernel refused the mapping (out of address space).
    """

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._map = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        whole = memoryview(self._map)
        base = ctypes.addressof(ctypes.c_char.from_buffer(whole))
        start = -base % HUGE_PAGE_BYTES  # to the next huge-page boundary
        self.view = whole[start : start + nbytes]
        whole.release()
        self.address = base + start
        advise_huge(self.address, nbytes)

    def close(self) -> None:
        """Unmap it; where a view of it is still alive (a traceback's frame), it is freed
        with that view instead."""
        self.view.release()
        with contextlib.suppress(BufferError):
            self._map.close()
