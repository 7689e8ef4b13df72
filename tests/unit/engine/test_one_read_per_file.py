"""A load opens each checkpoint file once and parses each tensor file's header once.

The fit checks before a load (every model's keys and shapes, every optimizer's state
shapes) read the tensor files' headers; the load then reads the data through the same
open file. Counted against ``memory://`` (every open of a file) and against an S3 server
(every GET of an object: one per file, the manifest included, beyond the ranged reads of
the same open file), for a native load of a model, an optimizer and a scheduler and for
``CheckpointManager.resume``. A load that fails half-way leaves no file open.
"""

from __future__ import annotations

import collections
import os

import pytest
import torch

import statekit
from statekit.format import header as header_module

pytest.importorskip("accelerate")


def _state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    model(torch.randn(3, 16)).sum().backward()
    optimizer.step()
    scheduler.step()
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler}


def _assert_same(saved: dict, loaded: dict) -> None:
    for name, t in saved["model"].state_dict().items():
        assert torch.equal(t, loaded["model"].state_dict()[name]), name
    for p_saved, p_loaded in zip(saved["optimizer"].state.values(), loaded["optimizer"].state.values()):
        for k in p_saved:
            assert torch.equal(torch.as_tensor(p_saved[k]), torch.as_tensor(p_loaded[k])), k
    assert saved["scheduler"].state_dict() == loaded["scheduler"].state_dict()


class _Tracked:
    """A ``memory://`` file that records its close (the store's own file never closes)."""

    def __init__(self, f, opened: dict, path: str) -> None:
        self._f, self._opened, self._path = f, opened, path
        opened[path] += 1

    def __getattr__(self, name):
        return getattr(self._f, name)

    def close(self) -> None:
        if self._path in self._opened and self._opened[self._path] > 0:
            self._opened[self._path] -= 1
            self._path = None

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


@pytest.fixture
def memory_opens(monkeypatch):
    """Every ``memory://`` file opened for reading: ``(opens per path, open now per path)``."""
    from fsspec.implementations.memory import MemoryFileSystem

    opens: collections.Counter = collections.Counter()
    still_open: collections.Counter = collections.Counter()
    real_open = MemoryFileSystem._open

    def counting_open(self, path, mode="rb", *args, **kwargs):
        f = real_open(self, path, mode, *args, **kwargs)
        if mode != "rb":
            return f
        path = self._strip_protocol(path)
        opens[path] += 1
        return _Tracked(f, still_open, path)

    monkeypatch.setattr(MemoryFileSystem, "_open", counting_open)
    return opens, still_open


@pytest.fixture
def header_parses(monkeypatch):
    """How many times each file's safetensors header was parsed (by URL)."""
    parsed: collections.Counter = collections.Counter()
    real_parse = header_module.parse_header

    def counting_parse(prefix, read_more, file_size, source):
        parsed[source] += 1
        return real_parse(prefix, read_more, file_size, source)

    monkeypatch.setattr(header_module, "parse_header", counting_parse)
    return parsed


def _files_of(url: str, fs=None) -> list[str]:
    """The checkpoint's data files (not the manifest, not hidden names), relative paths."""
    import fsspec

    fs = fs or fsspec.filesystem("memory")
    root = fs._strip_protocol(url).rstrip("/")
    found = [p[len(root) + 1 :] for p in fs.find(root)]
    return sorted(p for p in found if p != "statekit.json" and not p.rsplit("/", 1)[-1].startswith("."))


def test_a_native_load_opens_each_memory_file_once_and_parses_each_header_once(plugin_manager, memory_opens, header_parses):
    url = "memory://statekit-one-read/native"
    saved = _state(0)
    statekit.save(url, saved)
    opens, still_open = memory_opens
    opens.clear()
    loaded = _state(1)
    statekit.load(url, loaded)
    _assert_same(saved, loaded)
    files = _files_of(url)
    assert {"model.safetensors", "optimizer.safetensors", "optimizer.json", "scheduler.json"} <= set(files)
    base = "/statekit-one-read/native"
    assert {f: opens[f"{base}/{f}"] for f in files} == {f: 1 for f in files}
    assert opens[f"{base}/statekit.json"] <= 1  # (memory:// reads it without opening it)
    assert {source: n for source, n in header_parses.items() if n != 1} == {}
    assert not +still_open  # every file closed


def test_a_load_that_fails_half_way_leaves_no_memory_file_open(plugin_manager, memory_opens):
    url = "memory://statekit-one-read/failed"
    statekit.save(url, {"a": torch.nn.Linear(4, 4), "b": torch.nn.Linear(4, 4)})
    _, still_open = memory_opens
    with pytest.raises(statekit.StateMismatchError, match=r"model 'b'"):
        statekit.load(url, {"a": torch.nn.Linear(4, 4), "b": torch.nn.Linear(4, 5)})  # a's header is read first
    assert not +still_open


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc/self/fd")
def test_a_local_load_that_fails_half_way_leaves_no_descriptor_open(tmp_path, plugin_manager):
    url = str(tmp_path / "ckpt")
    saved = _state(0)
    statekit.save(url, saved)
    with open(tmp_path / "ckpt" / "optimizer.safetensors", "r+b") as f:  # a flipped byte in the optimizer's data
        f.seek(-5, os.SEEK_END)
        byte = f.read(1)
        f.seek(-5, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    loaded = _state(1)
    before = _open_fds()
    with pytest.raises(statekit.CorruptCheckpointError, match=r"optimizer\.safetensors"):
        statekit.load(url, loaded)  # models are filled, then the optimizer's checksum fails
    assert _open_fds() == before
    with pytest.raises(statekit.StateMismatchError, match=r"model 'model'"):
        statekit.load(url, {**_state(1), "model": torch.nn.Linear(16, 4)})  # refused at the fit check
    assert _open_fds() == before


def test_manager_resume_opens_each_memory_file_once(tiny_accelerate, installed_plugin_manager, memory_opens, header_parses):
    run = tiny_accelerate
    root = "memory://statekit-one-read/run"
    manager = statekit.CheckpointManager(run.accelerator, root)
    for step, batch in enumerate(run.loader, start=1):
        run.train_step(batch)
        if step == 3:
            break
    manager.save(3)
    opens, still_open = memory_opens
    opens.clear()
    assert statekit.CheckpointManager(run.accelerator, root).resume() == 3
    url = manager.latest()
    base = url.replace("memory://", "/")
    files = _files_of(url)
    assert any(f.endswith(".safetensors") for f in files)
    assert {f: opens[f"{base}/{f}"] for f in files} == {f: 1 for f in files}
    assert {source: n for source, n in header_parses.items() if n != 1} == {}
    assert not +still_open


@pytest.fixture
def s3_gets(monkeypatch):
    """Every S3 GET of an object (``get_object``), by key."""
    s3fs = pytest.importorskip("s3fs")
    gets: collections.Counter = collections.Counter()
    real_call = s3fs.S3FileSystem._call_s3

    async def counting_call(self, method, *args, **kwargs):
        if method == "get_object":
            gets[kwargs.get("Key")] += 1
        return await real_call(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", counting_call)
    return gets


@pytest.mark.s3
def test_a_native_load_gets_each_s3_object_once(s3_server, s3_bucket, plugin_manager, s3_gets):
    url = f"{s3_bucket}/native"
    saved = _state(0)
    statekit.save(url, saved)
    files = _files_of(url, s3_server.filesystem())
    s3_gets.clear()
    loaded = _state(1)
    statekit.load(url, loaded)
    _assert_same(saved, loaded)
    assert {f"native/{f}": s3_gets[f"native/{f}"] for f in files} == {f"native/{f}": 1 for f in files}
    assert s3_gets["native/statekit.json"] == 1
    assert sum(s3_gets.values()) == len(files) + 1


@pytest.mark.s3
def test_manager_resume_gets_each_s3_object_once(s3_server, s3_bucket, tiny_accelerate, installed_plugin_manager, s3_gets):
    run = tiny_accelerate
    root = f"{s3_bucket}/run"
    manager = statekit.CheckpointManager(run.accelerator, root)
    for step, batch in enumerate(run.loader, start=1):
        run.train_step(batch)
        if step == 2:
            break
    manager.save(2)
    url = manager.latest()
    files = _files_of(url, s3_server.filesystem())
    s3_gets.clear()
    assert statekit.CheckpointManager(run.accelerator, root).resume() == 2
    prefix = url[len(s3_bucket) + 1 :]
    assert {f: s3_gets[f"{prefix}/{f}"] for f in files} == {f: 1 for f in files}
    # the manifest: once by the listing that picks the checkpoint, once by the load (design-notes, "Kept on purpose")
    assert s3_gets[f"{prefix}/statekit.json"] == 2
