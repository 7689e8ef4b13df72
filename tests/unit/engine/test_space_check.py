"""The free-space check before a local save (issue 15, item 6): a save that cannot fit
fails at once with StorageError naming the path, the bytes needed and the bytes free,
before any byte is written; the previous checkpoint stays intact."""

from __future__ import annotations

import re
import subprocess

import pytest
import torch

import statekit
from statekit.engine.entries import classify, tensor_bytes
from statekit.storage import Storage
from statekit.storage.fs import SAVE_RESERVE_BYTES, Storage as FsStorage


def _model(n: int) -> torch.nn.Module:
    torch.manual_seed(n)
    return torch.nn.Linear(n, n)  # (n*n + n) * 4 bytes


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 4 MiB tmpfs (skips where this machine does not let us mount)."""
    path = tmp_path / "small"
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(path)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield path
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _numbers(message: str) -> tuple[int, int]:
    needed = int(re.search(r"needs about ([\d,]+) bytes", message).group(1).replace(",", ""))
    free = int(re.search(r"has ([\d,]+) bytes free", message).group(1).replace(",", ""))
    return needed, free


def test_a_save_that_does_not_fit_fails_before_writing_on_a_small_tmpfs(small_tmpfs, plugin_manager):
    root = small_tmpfs / "run"
    manager = statekit.CheckpointManager({"model": _model(256)}, str(root))
    manager.save(1)  # 257 KiB: fits
    big = _model(1100)  # 4.6 MiB of weights: cannot fit in 4 MiB
    with pytest.raises(statekit.StorageError) as info:
        statekit.save(str(root / "big"), {"model": big})
    message = str(info.value)
    needed, free = _numbers(message)
    assert needed >= 1100 * 1101 * 4 and free < needed
    assert str(root / "big") in message and str(small_tmpfs) in message
    assert info.value.url == str(root / "big")
    assert not (root / "big").exists()  # nothing created, not even the directory
    statekit.verify(manager.latest())  # the previous checkpoint is intact


def _pretend_free(monkeypatch, free: int) -> None:
    real = FsStorage.free_bytes

    def fake(self):
        measured = real(self)
        return None if measured is None else (free, measured[1])

    monkeypatch.setattr(FsStorage, "free_bytes", fake)


def test_manager_and_async_saves_are_checked_before_staging(tmp_path, plugin_manager, monkeypatch):
    _pretend_free(monkeypatch, 100_000)
    manager = statekit.CheckpointManager({"model": _model(300)}, str(tmp_path / "run"), async_save=True)
    with pytest.raises(statekit.StorageError, match=r"No space left for this save"):
        manager.save(1)
    assert not (tmp_path / "run" / "checkpoint_1").exists() and manager.latest() is None


def test_overwrite_counts_the_bytes_it_replaces(tmp_path, plugin_manager, monkeypatch):
    url = str(tmp_path / "c")
    model = _model(400)  # 642 KB
    statekit.save(url, {"model": model})
    on_disk = sum(p.stat().st_size for p in (tmp_path / "c").rglob("*") if p.is_file())
    _pretend_free(monkeypatch, SAVE_RESERVE_BYTES)  # room for the reserve only
    with pytest.raises(statekit.StorageError, match="No space left"):
        statekit.save(str(tmp_path / "other"), {"model": model})
    statekit.save(url, {"model": model}, overwrite=True)  # the old files' bytes are reclaimed
    assert on_disk > 400 * 400 * 4
    statekit.verify(url)


def test_remote_storage_is_not_checked():
    assert Storage("memory://statekit-space/c").free_bytes() is None


def test_local_free_bytes_measures_the_nearest_existing_ancestor(tmp_path):
    free, measured = Storage(str(tmp_path / "a" / "b" / "c")).free_bytes()
    assert measured == str(tmp_path) and free > 0
    assert not (tmp_path / "a").exists()


def test_tensor_bytes_counts_each_rank_share_once():
    model = _model(64)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    shared = torch.nn.Module()
    shared.p = torch.nn.Parameter(model.weight.detach())  # same storage as model.weight
    per_rank = torch.arange(10.0)
    entries = [classify("model", model), classify("optim", opt), classify("shared", shared), classify("g", per_rank, per_rank=True)]
    weights = (64 * 64 + 64) * 4
    assert tensor_bytes(entries, rank=0) == weights + 2 * weights + 4 + 4 + 40  # + 2 step tensors + per-rank
    assert tensor_bytes(entries, rank=1) == 40
