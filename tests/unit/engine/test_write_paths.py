"""The write path of tensor files: a staged file (one arena, StagingPool) goes to the disk
straight from the arena (DirectWriter.write_stable, no second copy), with the same bytes
and checksum as the copying path; large files start their data on a 4 KiB boundary."""

from __future__ import annotations

import gc
import os
import struct
import threading
import time

import pytest
import torch
from safetensors import safe_open

from statekit.engine.staging import StagingPool
from statekit.format import tensors as tensor_files
from statekit.format import write_tensors
from statekit.storage import DirectWriter, direct_write
from statekit.storage.hashing import checksum_bytes, checksum_string, new_hasher


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"w": torch.randn(1000, 333), "b": torch.randn(333), "h": torch.randn(5).half(), "i": torch.arange(3)}  # i: at an odd offset


def _write(path, tensors, monkeypatch) -> tuple[str, int]:
    copied = []
    real = DirectWriter.write
    monkeypatch.setattr(DirectWriter, "write", lambda self, data: copied.append(len(memoryview(data).cast("B"))) or real(self, data))
    hasher = new_hasher()
    with open(path, "wb"):
        pass
    writer = DirectWriter(str(path))
    size = write_tensors(writer, tensors, {"k": "v"}, hasher)
    writer.close()
    monkeypatch.setattr(DirectWriter, "write", real)
    assert path.stat().st_size == size
    return checksum_string(hasher), sum(copied)


def test_a_staged_file_is_written_from_its_arena_with_the_same_bytes(tmp_path, monkeypatch):
    state = _state()
    staged = StagingPool().stage("f.safetensors", state)
    plain_sum, plain_copied = _write(tmp_path / "plain.safetensors", state, monkeypatch)
    staged_sum, staged_copied = _write(tmp_path / "staged.safetensors", staged, monkeypatch)
    assert (tmp_path / "plain.safetensors").read_bytes() == (tmp_path / "staged.safetensors").read_bytes()
    assert staged_sum == plain_sum
    data = sum(t.numel() * t.element_size() for t in state.values())
    assert plain_copied >= data
    if DirectWriter(str(tmp_path / "probe")).direct:  # tmpfs refuses O_DIRECT: everything is copied there
        assert staged_copied < 8192  # the header page and the unaligned tail only
    with safe_open(str(tmp_path / "staged.safetensors"), "pt") as f:
        assert all(torch.equal(f.get_tensor(k), state[k]) for k in state)


def test_copied_bytes_are_hashed_in_cache_sized_steps_and_the_checksum_is_the_files(tmp_path, monkeypatch):
    """The copying path alternates copy and checksum in steps of CACHE_STEP_BYTES (an
    odd size here, so steps end inside tensors); the checksum is still the whole file's."""
    monkeypatch.setattr(tensor_files, "CACHE_STEP_BYTES", 100_003)
    writes: list[int] = []
    real = DirectWriter.write
    monkeypatch.setattr(DirectWriter, "write", lambda self, data: writes.append(len(memoryview(data).cast("B"))) or real(self, data))
    state = _state()
    hasher = new_hasher()
    path = tmp_path / "stepped.safetensors"
    with DirectWriter(str(path)) as writer:
        write_tensors(writer, state, None, hasher)
    data = sum(t.numel() * t.element_size() for t in state.values())
    assert max(writes[1:]) == 100_003 and len(writes) - 1 >= data // 100_003  # writes[0]: the header
    assert sum(writes[1:]) == data
    assert checksum_string(hasher) == checksum_bytes(path.read_bytes())
    with safe_open(str(path), "pt") as f:
        assert all(torch.equal(f.get_tensor(k), state[k]) for k in state)


@pytest.fixture
def small_buffers(monkeypatch):
    """DirectWriter buffers of 64 KiB (a fresh pool), so a few hundred KiB make several writes."""
    monkeypatch.setattr(direct_write, "DIRECT_BUFFER_BYTES", 64 * 1024)
    monkeypatch.setattr(direct_write, "_buffer_pool", [])
    return 64 * 1024


@pytest.fixture
def held_first_write(monkeypatch) -> tuple[threading.Event, list[int]]:
    """The writer's write at offset 0 waits until the returned event is set; the list gets
    the offset of every other write once it is done."""
    release = threading.Event()
    real_pwrite = os.pwrite
    done: list[int] = []

    def held(fd, data, offset):
        if offset == 0:
            assert release.wait(10)
        n = real_pwrite(fd, data, offset)
        if offset:
            done.append(offset)
        return n

    monkeypatch.setattr(direct_write.os, "pwrite", held)
    return release, done


def _writes_done_while_held(held: tuple[threading.Event, list[int]], work: threading.Thread, expect: int) -> list[int]:
    """Start ``work``; wait (up to 10 s) until ``expect`` later writes are done while the
    first is held, then release it; returns the offsets done while it was held (sorted)."""
    release, done = held
    work.start()
    deadline = time.monotonic() + 10
    while len(done) < expect and time.monotonic() < deadline:
        time.sleep(0.001)
    seen = sorted(done)
    release.set()
    work.join()
    return seen


def test_later_buffers_are_written_while_the_first_write_is_held(tmp_path, small_buffers, held_first_write):
    """Several writes are in flight, and a slow one does not hold up the rest: while the
    first buffer's write is held, every later full buffer reaches the file at its offset
    (the tail waits for close); the file is complete once the first write ends."""
    data = os.urandom(9 * small_buffers + 123)
    path = tmp_path / "f.bin"
    writer = DirectWriter(str(path))
    seen = _writes_done_while_held(held_first_write, threading.Thread(target=writer.write, args=(data,)), 8)
    writer.close()
    assert seen == [i * small_buffers for i in range(1, 9)]
    assert path.read_bytes() == data


def test_stable_writes_are_in_flight_together_too(tmp_path, small_buffers, held_first_write):
    """write_stable (a staged arena, written from its own memory) sends pieces of
    DIRECT_BUFFER_BYTES the same way: all later pieces land while the first is held."""
    from statekit.storage.hugepages import IOBuffer

    arena = IOBuffer(1 << 20)
    payload = os.urandom(1 << 20)
    arena.view[:] = payload
    path = tmp_path / "f.bin"
    writer = DirectWriter(str(path))
    if not writer.direct:
        writer.abort()
        pytest.skip("O_DIRECT refused here: write_stable copies")
    seen = _writes_done_while_held(held_first_write, threading.Thread(target=writer.write_stable, args=(arena.view,)), 15)
    writer.close()
    arena.close()
    assert seen == [i * small_buffers for i in range(1, 16)]
    assert path.read_bytes() == payload


def test_a_failed_write_is_raised_and_no_write_starts_after_it(tmp_path, monkeypatch, small_buffers):
    real_pwrite = os.pwrite
    calls = []

    def disk_full_at_first_write(fd, data, offset):
        calls.append(offset)
        if offset == 0:
            raise OSError(28, "No space left on device")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(direct_write.os, "pwrite", disk_full_at_first_write)
    writer = DirectWriter(str(tmp_path / "f.bin"))
    with pytest.raises(OSError, match="No space left"):
        writer.write(os.urandom(12 * small_buffers))
        writer.close()
    writer.abort()
    assert 1 <= len(calls) <= direct_write.DIRECT_DEPTH + 1  # at most those in flight with it, of 12


def test_the_error_is_raised_by_close_when_the_last_write_fails(tmp_path, monkeypatch):
    monkeypatch.setattr(direct_write.os, "pwrite", lambda fd, data, offset: (_ for _ in ()).throw(OSError(5, "Input/output error")))
    writer = DirectWriter(str(tmp_path / "f.bin"))
    writer.write(b"x" * 1000)
    with pytest.raises(OSError, match="Input/output error"):
        writer.close()
    assert writer.closed


@pytest.mark.parametrize(("numel", "offset"), [(300_000, 4096), (10, None)])
def test_large_files_start_their_data_on_a_page(tmp_path, numel, offset):
    path = tmp_path / "t.safetensors"
    writer = DirectWriter(str(path))
    write_tensors(writer, {"x": torch.ones(numel)})
    writer.close()
    data_start = 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]
    assert data_start == offset if offset else data_start % 8 == 0 and data_start < 4096


def test_write_stable_copies_what_it_cannot_send_directly(tmp_path):
    path = tmp_path / "f.bin"
    writer = DirectWriter(str(path))
    payload = bytes(range(256)) * 100  # read-only: no address to send from
    writer.write(b"abc")
    writer.write_stable(payload)
    arena = torch.arange(3 * 4096, dtype=torch.uint8)  # unaligned file position after "abc"
    writer.write_stable(memoryview(arena.numpy()))
    writer.close()
    assert path.read_bytes() == b"abc" + payload + bytes(arena.tolist())


def test_accelerator_tensors_pass_through_one_reused_host_buffer(tmp_path, monkeypatch):
    """Stand-in accelerator (CPU tensors treated as on a device): a sync write copies each
    tensor through one host buffer, allocated once and smaller than the largest tensor
    here, so chunks end inside tensors; the file is byte for byte the plain path's."""
    state = {**_state(), "t": torch.randn(64, 48).t(), "c": torch.randn(7, dtype=torch.complex64).conj()}
    plain = tmp_path / "plain.safetensors"
    with DirectWriter(str(plain)) as writer:
        write_tensors(writer, state, {"k": "v"}, new_hasher())
    buffers: list[int] = []
    monkeypatch.setattr(tensor_files, "is_accelerator", lambda device: True)
    monkeypatch.setattr(tensor_files, "host_buffer", lambda n: buffers.append(n) or torch.empty(n, dtype=torch.uint8))
    monkeypatch.setattr(tensor_files, "BOUNCE_BYTES", 100_003)
    real_tensor_bytes = tensor_files.tensor_bytes
    whole = []  # strided and conj tensors are copied whole (no device-side temporary)
    monkeypatch.setattr(tensor_files, "tensor_bytes", lambda t: whole.append(tuple(t.shape)) or real_tensor_bytes(t))
    hasher = new_hasher()
    path = tmp_path / "bounced.safetensors"
    with DirectWriter(str(path)) as writer:
        write_tensors(writer, state, {"k": "v"}, hasher)
    assert buffers == [100_003]
    assert sorted(whole) == [(7,), (48, 64)]  # the conj and the transposed one; the rest bounced
    assert path.read_bytes() == plain.read_bytes()
    assert checksum_string(hasher) == checksum_bytes(path.read_bytes())
    with safe_open(str(path), "pt") as f:
        assert all(torch.equal(f.get_tensor(k), state[k].resolve_conj()) for k in state)


def _new_buffer_on_helper(monkeypatch, helper) -> list[str]:
    """Route direct_write._new_buffer: the writer's own thread makes real buffers, the
    statekit-buffers helper calls ``helper(real)``; returns the names of the threads that
    asked."""
    real = direct_write._new_buffer
    asked: list[str] = []

    def new_buffer():
        name = threading.current_thread().name
        asked.append(name)
        return helper(real) if name == "statekit-buffers" else real()

    monkeypatch.setattr(direct_write, "_new_buffer", new_buffer)
    return asked


def test_a_writer_goes_on_while_its_other_buffers_are_made(tmp_path, monkeypatch, small_buffers):
    """With an empty pool the writer makes its first buffer itself and the others on a
    helper thread; it does not wait for them: here they are held back until the whole
    payload is written with the one buffer. Then they arrive and go to the pool."""
    release = threading.Event()
    asked = _new_buffer_on_helper(monkeypatch, lambda real: release.wait(10) and real())
    data = os.urandom(6 * small_buffers + 99)
    path = tmp_path / "f.bin"
    writer = DirectWriter(str(path))
    writer.write(data)  # would wait forever if it needed a buffer still being made
    assert asked[0] == "MainThread" and "statekit-buffers" in asked
    release.set()
    writer.close()
    assert path.read_bytes() == data
    assert len(direct_write._buffer_pool) == direct_write.DIRECT_DEPTH + 1  # its own and the four made


def test_a_buffer_that_cannot_be_made_is_done_without(tmp_path, monkeypatch, small_buffers):
    """Out of memory on the helper thread: the writer goes on with the buffers it has, and
    asks for no more."""

    def out_of_memory(real):
        raise MemoryError

    asked = _new_buffer_on_helper(monkeypatch, out_of_memory)
    data = os.urandom(9 * small_buffers + 5)
    path = tmp_path / "f.bin"
    with DirectWriter(str(path)) as writer:
        writer.write(data)
    assert path.read_bytes() == data
    assert asked.count("statekit-buffers") == 1  # the helper stops at the first failure, and is not started again


def test_o_direct_refused_for_two_writes_in_flight_falls_back_for_both(tmp_path, monkeypatch, small_buffers):
    """Two writes issued with O_DIRECT are both refused (EINVAL), the second after the
    first has already dropped O_DIRECT: both are retried through the page cache."""
    import errno
    import fcntl

    real_pwrite = os.pwrite
    both = threading.Barrier(2, timeout=10)

    def refuse_direct(fd, data, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            if offset in (0, small_buffers) and both.wait():
                time.sleep(0.05)  # refused after the other one dropped O_DIRECT
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(direct_write.os, "pwrite", refuse_direct)
    data = os.urandom(4 * small_buffers + 77)
    path = tmp_path / "f.bin"
    writer = DirectWriter(str(path))
    if not writer.direct:
        writer.abort()
        pytest.skip("O_DIRECT refused at open here")
    writer.write(data)
    writer.close()
    assert not writer.direct
    assert path.read_bytes() == data


def _ends_within(target, seconds: float = 20) -> bool:
    # Earlier tests' cyclic garbage first: a leaked DataLoader iterator with workers, when
    # the collector ran on target's thread, joined its workers there (5 s each) and took
    # the 20 s (tests/unit/engine/test_write_paths.py in a full run, faulthandler dump).
    gc.collect()
    done = threading.Event()

    def run():
        try:
            target()
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    return done.wait(seconds)


@pytest.mark.parametrize("where", ["report-taken", "thread-start"])
def test_an_interrupt_mid_write_leaves_no_hang_and_no_thread(tmp_path, monkeypatch, small_buffers, where):
    """A KeyboardInterrupt on the caller's thread lands right after a write's report was
    taken (before it was counted), or inside a writer thread's start() once the thread
    runs: abort() (the ``with`` block's exit) still returns, and no writer thread is left."""
    if where == "report-taken":
        real_take = DirectWriter._take_done

        def taken_then_interrupted(self):
            if getattr(self, "_interrupted", False):
                return real_take(self)
            self._interrupted = True
            self._done.get()
            raise KeyboardInterrupt

        monkeypatch.setattr(DirectWriter, "_take_done", taken_then_interrupted)
    else:
        # The first write waits for the interrupt, so writes overlap and a second writer
        # thread is started even when the caller is slow (under load, each write could
        # end before the next one is handed over: one thread, no interrupt, a plain
        # close()). Only writer threads count, and only their start() raises: the patch
        # replaces threading.Thread for every thread (the test's own _ends_within too).
        started = []
        interrupted_start = threading.Event()
        real_pwrite = os.pwrite

        def first_write_waits(fd, data, offset):
            if offset == 0 and threading.current_thread() in started:
                interrupted_start.wait(10)
            return real_pwrite(fd, data, offset)

        class InterruptedStart(threading.Thread):
            def start(self):
                super().start()
                if self.name == "statekit-write":
                    started.append(self)
                    if len(started) == 2:
                        interrupted_start.set()
                        raise KeyboardInterrupt

        monkeypatch.setattr(direct_write.os, "pwrite", first_write_waits)
        monkeypatch.setattr(direct_write.threading, "Thread", InterruptedStart)
    interrupted = []

    def save():
        try:
            with DirectWriter(str(tmp_path / "f.bin")) as writer:
                writer.write(os.urandom(12 * small_buffers))
        except KeyboardInterrupt:
            interrupted.append(True)

    assert _ends_within(save)
    assert interrupted
    time.sleep(0.1)
    assert not [t for t in threading.enumerate() if t.name in ("statekit-write", "statekit-buffers")]  # (other tests' threads may run)
