"""StagingPool: what an async save copies, into which host memory, and when it is done.

The accelerator path (pinned host buffers, non-blocking device-to-host copies, one event
per device) runs for real only where CUDA is present (``test_cuda_staging_is_pinned_and_exact``);
on CPU the seams ``allocate_host``/``record_copies`` show the same wiring."""

from __future__ import annotations

import pytest
import torch

from statekit.api.saveload import save_objects
from statekit.engine import staging
from statekit.engine.entries import classify
from statekit.engine.staging import StagingPool
from statekit.storage.hugepages import HUGE_PAGE_BYTES


def test_cpu_tensors_are_copied_into_reused_unpinned_buffers():
    pool = StagingPool()
    t = {"a": torch.randn(64, 32), "b": torch.arange(10)}
    first = pool.stage("f.safetensors", t)
    assert all(torch.equal(first[k], t[k]) and first[k].data_ptr() != t[k].data_ptr() for k in t)
    assert not first["a"].is_pinned()
    allocated = pool.allocated_bytes
    t["a"].add_(1)
    second = pool.stage("f.safetensors", t)
    assert second["a"].data_ptr() == first["a"].data_ptr() and torch.equal(second["a"], t["a"])
    assert pool.allocated_bytes == allocated  # steady state allocates nothing


def test_a_files_tensors_are_staged_back_to_back_in_one_aligned_arena():
    t = {"w": torch.randn(300, 7), "b": torch.randn(5), "h": torch.randn(6).half(), "i": torch.arange(4)}
    staged = StagingPool().stage("f.safetensors", t)
    assert list(staged) == list(t) and all(torch.equal(staged[k], t[k]) for k in t)
    assert staged["w"].data_ptr() == staged.arena.data_ptr() and staged.arena.data_ptr() % staging.ARENA_ALIGN == 0
    assert staged.arena.data_ptr() % HUGE_PAGE_BYTES == 0  # unpinned: starts on a huge page (asks for huge pages)
    position = staged["w"].data_ptr()
    for k in t:  # the file's layout: each tensor right after the one before
        assert staged[k].data_ptr() == position, k
        position += t[k].numel() * t[k].element_size()


def test_an_offset_that_does_not_suit_a_dtype_still_stages_in_the_arena():
    t = {"odd": torch.arange(3, dtype=torch.int8), "f": torch.randn(4), "l": torch.arange(2)}  # f at byte 3
    pool = StagingPool()
    staged = pool.stage("f.safetensors", t)
    assert all(torch.equal(staged[k], t[k]) for k in t)
    assert staged["f"].data_ptr() == staged.arena.data_ptr() + 3 and staged["l"].data_ptr() == staged.arena.data_ptr() + 19
    t["f"].add_(1)
    again = pool.stage("f.safetensors", t)
    assert again["f"].data_ptr() == staged["f"].data_ptr() and torch.equal(again["f"], t["f"])  # reused


def test_tied_views_share_one_buffer():
    w = torch.randn(8, 8)
    staged = StagingPool().stage("m.safetensors", {"w": w, "tied": w})
    assert staged["w"] is staged["tied"]


def test_accelerator_tensors_stage_pinned_and_wait_once(monkeypatch):
    """Stand-in accelerator (CPU tensors treated as on a device): buffers are asked
    pinned, copies are queued non-blocking, and the pool waits for the device once, in
    settle(), on events recorded after each file's copies (on the stream current when they
    were queued) for every file staged since the last settle; release() settles too."""
    pins: list[bool] = []
    waits: list[set] = []
    monkeypatch.setattr(staging, "pin_memory_for", lambda device: True)
    monkeypatch.setattr(staging, "allocate_host", lambda shape, dtype, pin: pins.append(pin) or torch.empty(shape, dtype=dtype))
    recorded: list[set] = []

    class Event:
        def __init__(self, devices):
            self.devices = devices

        def synchronize(self):
            waits.append(self.devices)

    monkeypatch.setattr(staging, "record_copies", lambda devices: recorded.append(set(devices)) or [Event(set(devices))])
    pool = StagingPool()
    t = {"a": torch.randn(4, 4), "b": torch.randn(3)}
    staged = pool.stage("f.safetensors", t)
    other = pool.stage("g.safetensors", {"c": torch.randn(2)})
    assert pins == [True, True]  # one pinned arena per file
    assert recorded == [{torch.device("cpu")}] * 2  # an event after each file's copies, on the stream current then
    assert waits == []  # not waited for yet
    pool.settle()
    assert waits == [{torch.device("cpu")}] * 2  # both, in one settle()
    assert all(torch.equal(staged[k], t[k]) for k in t) and other["c"].shape == (2,)
    pool.settle()
    assert len(waits) == 2  # nothing queued since
    pool.stage("f.safetensors", t)
    pool.hold()
    pool.release()  # a save that failed before settle(): no buffer is given back mid-copy
    assert len(waits) == 3


def test_an_async_save_settles_the_copies_once_before_it_returns(tmp_path, monkeypatch):
    """An async save (save_objects(blocking=False), under save() and the manager) waits for the device-to-host copies of all its files in one
    settle(), after the last file is staged and before it returns."""
    calls: list[str] = []
    real_stage, real_settle = StagingPool.stage, StagingPool.settle
    monkeypatch.setattr(StagingPool, "stage", lambda self, rel, t: calls.append(f"stage {rel}") or real_stage(self, rel, t))
    monkeypatch.setattr(StagingPool, "settle", lambda self: calls.append("settle") or real_settle(self))
    model = torch.nn.Linear(3, 2)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(1, 3)).sum().backward()
    optim.step()
    pending = save_objects(str(tmp_path / "c"), [classify("model", model), classify("optim", optim)], blocking=False)
    settled = list(calls)
    pending.wait()
    assert settled[-1] == "settle" and settled.count("settle") == 1
    assert sum(c.startswith("stage") for c in settled) >= 2  # model and optimizer files, then one settle


def test_pin_memory_only_off_the_cpu():
    assert staging.pin_memory_for(torch.device("cuda", 0))
    assert not staging.pin_memory_for(torch.device("cpu"))
    assert not staging.pin_memory_for(torch.device("meta"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_staging_is_pinned_and_exact():
    t = {"w": torch.randn(1024, 1024, device="cuda"), "h": torch.randn(7, device="cuda").half()}
    staged = StagingPool().stage("f.safetensors", t)
    for k, v in t.items():
        assert staged[k].device.type == "cpu" and staged[k].is_pinned()
        assert torch.equal(staged[k], v.cpu())


@pytest.mark.parametrize("dtype", [torch.complex128, torch.complex64, torch.float64])
@pytest.mark.parametrize("shape", [(), (5,), (3, 4)])
def test_a_dtype_at_an_arena_offset_it_cannot_be_aligned_to_stages_bytes_exactly(dtype, shape):
    """complex128's copy kernel assumes 16-byte-aligned memory: staged at byte 8 of the
    arena (after a uint8 tensor) it crashed the process with SIGSEGV."""
    pool = StagingPool()
    for first in (1, 8, 12):
        t = {"pad": torch.arange(first, dtype=torch.uint8), "x": torch.randn(shape, dtype=dtype),
             "conj": torch.randn(2, 3, dtype=dtype).conj() if dtype.is_complex else torch.randn(2, 3, dtype=dtype),
             "t": torch.randn(4, 6, dtype=dtype).t()}
        staged = pool.stage(f"f{first}.safetensors", t)
        assert all(torch.equal(staged[k], v) and staged[k].dtype == v.dtype and staged[k].shape == v.shape for k, v in t.items())
        t["x"].add_(1)
        assert torch.equal(pool.stage(f"f{first}.safetensors", t)["x"], t["x"])  # reused buffers too


def test_a_second_save_holding_the_pool_waits_until_the_first_releases_it():
    import threading

    pool = StagingPool()
    pool.hold()
    taken = threading.Event()
    second = threading.Thread(target=lambda: (pool.hold(), taken.set()))
    second.start()
    assert not taken.wait(0.2)  # the first save still writes from the buffers
    pool.release()
    assert taken.wait(5)
    second.join()
    pool.release()
