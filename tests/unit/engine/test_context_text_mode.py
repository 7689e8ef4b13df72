"""``checkpoint.open`` in text modes ("w"/"r", UTF-8, as fsspec's ``open``), for sync and async saves."""

from __future__ import annotations

import io

import pytest
import torch

import statekit
from statekit.manager.manager import checkpoint_name
from statekit.engine.context import Checkpoint
from statekit.storage import Storage
from statekit.storage.hashing import checksum_bytes

NOTES = "step notes: ünïcödé ✓\nsecond line\n"


class Notes:
    """A plugin writing ``notes.txt`` in text mode and reading it back the same way."""

    def __init__(self) -> None:
        self.read: list[str] = []

    @statekit.hookimpl
    def statekit_save_state_pre(self, checkpoint):
        with checkpoint.open("notes.txt", "w") as f:
            assert isinstance(f, io.TextIOBase)
            f.write(NOTES)
        with checkpoint.open("more/closed.txt", "w") as f:
            f.write("closed early")
            f.close()  # only flushes: the checkpoint closes and records the file

    @statekit.hookimpl
    def statekit_load_state_post(self, checkpoint):
        with checkpoint.open("notes.txt", "r") as f:
            self.read.append(f.read())
        with checkpoint.open("more/closed.txt", "r") as f:
            self.read.append("".join(f))  # line iteration reads through read1


def _check_manifest(url: str) -> None:
    files = statekit.verify(url).files
    data = NOTES.encode("utf-8")
    assert files["notes.txt"].size_bytes == len(data)
    assert files["notes.txt"].checksum == checksum_bytes(data)
    assert files["notes.txt"].writer == "notes"
    assert files["more/closed.txt"].size_bytes == len(b"closed early")


def test_text_write_and_read_sync(tmp_path, plugin_manager):
    plugin = Notes()
    plugin_manager.register(plugin, name="notes")
    url = str(tmp_path / "ckpt")
    statekit.save(url, {"t": torch.ones(2)})
    assert (tmp_path / "ckpt" / "notes.txt").read_bytes() == NOTES.encode("utf-8")
    _check_manifest(url)
    statekit.load(url, {"t": torch.zeros(2)})
    assert plugin.read == [NOTES, "closed early"]


def test_text_write_and_read_async(tmp_path, plugin_manager):
    plugin = Notes()
    plugin_manager.register(plugin, name="notes")
    manager = statekit.CheckpointManager({"t": torch.ones(2)}, str(tmp_path), async_save=True)
    manager.save(1)
    manager.wait()
    url = str(tmp_path / checkpoint_name(1))
    assert (tmp_path / checkpoint_name(1) / "notes.txt").read_bytes() == NOTES.encode("utf-8")
    _check_manifest(url)
    statekit.load(url, {"t": torch.zeros(2)})
    assert plugin.read == [NOTES, "closed early"]


def test_text_read_is_verified(tmp_path):
    storage = Storage(str(tmp_path / "c"))
    writer = Checkpoint(storage, mode="save")
    with writer.open("a.txt", "w") as f:
        f.write("hello\n")
    (tmp_path / "c" / "a.txt").write_text("hellO\n")  # same size, other bytes
    manifest = statekit.Manifest(
        statekit_version=statekit.__version__, created="2026-11-27T00:00:00Z", step=None, world_size=1, plugins={},
        objects={}, records={}, metadata={}, files=dict(writer.files),
    )
    reader = Checkpoint(storage, mode="load", manifest=manifest, verify=True)
    with pytest.raises(statekit.CorruptCheckpointError, match="a.txt: checksum"):
        with reader.open("a.txt", "r") as f:
            f.read()
    unverified = Checkpoint(storage, mode="load", manifest=manifest, verify=False)
    with unverified.open("a.txt", "r") as f:
        assert f.read() == "hellO\n"


def test_bad_modes_are_refused(tmp_path):
    checkpoint = Checkpoint(Storage(str(tmp_path / "c")), mode="save")
    for mode in ("a", "r+", "wt", "x"):
        with pytest.raises(ValueError, match="mode must be"):
            with checkpoint.open("x.txt", mode):
                pass


def test_text_write_during_load_is_refused(tmp_path):
    checkpoint = Checkpoint(Storage(str(tmp_path / "c")), mode="load")
    with pytest.raises(statekit.StatekitError, match="not open for writing"):
        with checkpoint.open("x.txt", "w"):
            pass
