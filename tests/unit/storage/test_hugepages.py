"""Huge-page-backed I/O buffers (:mod:`statekit.storage.hugepages`): placement, use by the
``O_DIRECT`` writer and reader, and the advice itself where the kernel offers it."""

from __future__ import annotations

import os

import pytest

from statekit.storage import direct_write, hugepages
from statekit.storage.direct import DirectReader
from statekit.storage.hugepages import HUGE_PAGE_BYTES, IOBuffer


def test_io_buffer_starts_on_a_huge_page_and_holds_what_is_written():
    buf = IOBuffer(3 * 1024 * 1024 + 5)
    try:
        assert buf.address % HUGE_PAGE_BYTES == 0
        assert len(buf.view) == buf.nbytes == 3 * 1024 * 1024 + 5
        buf.view[-5:] = b"tail!"
        buf.view[:4] = b"head"
        assert bytes(buf.view[:4]) == b"head" and bytes(buf.view[-5:]) == b"tail!"
    finally:
        buf.close()


def test_io_buffer_close_with_a_live_slice_keeps_the_slice_valid():
    buf = IOBuffer(1 << 20)
    buf.view[:3] = b"abc"
    piece = buf.view[:3]  # e.g. held by a traceback frame
    buf.close()
    assert bytes(piece) == b"abc"


def test_advice_on_an_empty_range_does_nothing():
    assert hugepages.advise_huge(4096, 0) is False


@pytest.mark.skipif(not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"), reason="no transparent huge pages")
def test_advice_is_taken_where_the_kernel_has_transparent_huge_pages():
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        if "[never]" in f.read():
            pytest.skip("transparent huge pages are off")
    buf = IOBuffer(HUGE_PAGE_BYTES)
    try:
        assert hugepages.advise_huge(buf.address, buf.nbytes)
    finally:
        buf.close()


def test_writer_buffers_are_huge_page_aligned_and_pooled(tmp_path, monkeypatch):
    monkeypatch.setattr(direct_write, "_buffer_pool", [])
    data = os.urandom(direct_write.DIRECT_BUFFER_BYTES + 12345)
    with direct_write.DirectWriter(str(tmp_path / "a")) as f:
        f.write(data)
    pooled = {b.address for b in direct_write._buffer_pool}
    assert len(pooled) >= 2 and all(a % HUGE_PAGE_BYTES == 0 for a in pooled)  # given back for the next file
    with direct_write.DirectWriter(str(tmp_path / "b")) as f:
        f.write(data)
        assert len(direct_write._buffer_pool) < len(pooled)  # taken again, none made
    assert {b.address for b in direct_write._buffer_pool} == pooled
    assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes() == data


def test_reader_bounce_buffers_are_huge_page_aligned(tmp_path):
    data = os.urandom(3 * 1024 * 1024)
    (tmp_path / "f").write_bytes(data)
    dest = IOBuffer(len(data) + 64)
    view = dest.view[64 : 64 + len(data)]  # 64 bytes past a page, the file's bytes at 0: bounced
    with DirectReader(str(tmp_path / "f")) as f:
        assert f.fill(view) == len(data)
        if f.direct:
            assert f._bounce and all(b.address % HUGE_PAGE_BYTES == 0 for b in f._bounce)
    assert bytes(view) == data
    dest.close()
