"""Hedged remote copies (issue 30 item 3): a file upload to the remote tier that makes no
progress for ``replicate_hedge_after_s`` is raced by a second attempt; the first to finish
is committed, the stalled one is abandoned and removes its temporary file when it ends.

The stall is real and deterministic: the remote filesystem (an fsspec memory filesystem of
this test, or the local disk through a held first upload) blocks the first upload of a
file on a ``threading.Event`` after writing half of it, until the test releases it. No
sleeps: the test waits for events and for ``manager.wait()``.
"""

from __future__ import annotations

import errno
import threading
import warnings

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

import statekit
import statekit_replicate.remote_copy as remote_copy
from statekit.testing import assert_state_equal

DATA = ".safetensors"


class StallingFile:
    """A file being written that stops half way through its first write until released."""

    def __init__(self, inner, fs: type[StallFS]) -> None:
        self.inner, self.fs = inner, fs

    def write(self, data) -> int:
        data = bytes(data)
        half = len(data) // 2
        self.inner.write(data[:half])  # visible in the store: a partial file under the temporary name
        self.fs.stalled.set()
        assert self.fs.release.wait(60), "the test never released the stalled upload"
        return half + self.inner.write(data[half:])

    def close(self) -> None:
        self.inner.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class StallFS(MemoryFileSystem):
    """A remote tier whose first upload of a data file stalls (see :class:`StallingFile`);
    records what was written under which name."""

    protocol = "stallmem"
    store: dict = {}
    pseudo_dirs = [""]
    stalled = threading.Event()
    release = threading.Event()
    stalled_path: str | None = None
    stalled_removed = threading.Event()
    opened_for_write: list[str] = []
    renamed: list[tuple[str, str, bytes]] = []
    fail_hedge = False
    hedge_failed = threading.Event()

    @classmethod
    def reset(cls) -> None:
        cls.store.clear()
        cls.pseudo_dirs[:] = [""]
        cls.stalled, cls.release, cls.stalled_removed = threading.Event(), threading.Event(), threading.Event()
        cls.stalled_path = None
        cls.opened_for_write = []
        cls.renamed = []
        cls.fail_hedge = False
        cls.hedge_failed = threading.Event()

    def _open(self, path, mode="rb", **kwargs):
        if "w" in mode and StallFS.fail_hedge and ".attempt2.tmp" in path:
            StallFS.hedge_failed.set()
            raise OSError(errno.EIO, "Input/output error", path)
        f = super()._open(path, mode, **kwargs)
        if "w" in mode:
            path = self._strip_protocol(path)
            StallFS.opened_for_write.append(path)
            if DATA in path and StallFS.stalled_path is None:
                StallFS.stalled_path = path
                return StallingFile(f, StallFS)
        return f

    def cp_file(self, path1, path2, **kwargs):
        StallFS.renamed.append((self._strip_protocol(path1), self._strip_protocol(path2),
                                bytes(self.store[self._strip_protocol(path1)].getvalue())))
        super().cp_file(path1, path2, **kwargs)

    def rm_file(self, path):
        super().rm_file(path)
        if self._strip_protocol(path) == StallFS.stalled_path:
            StallFS.stalled_removed.set()


@pytest.fixture
def stallfs():
    fsspec.register_implementation("stallmem", StallFS, clobber=True)
    StallFS.reset()
    yield StallFS
    StallFS.release.set()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 8))


def _local_bytes(local_dir) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in local_dir.iterdir() if p.name.endswith(DATA)}


def _resume_from_remote(tmp_path, remote: str, expected: torch.nn.Module) -> None:
    """A fresh node (empty local root) resumes from the remote tier, exactly."""
    statekit.verify(f"{remote}/checkpoint-00000001")
    fresh = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 8))
    resumed = statekit.CheckpointManager({"model": fresh}, str(tmp_path / "fresh-node"), replicate_to=remote)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no RNG plugin state in this small model
        assert resumed.resume() == 1
    assert resumed.resumed_from == f"{remote}/checkpoint-00000001"
    assert_state_equal(fresh.state_dict(), expected.state_dict())


def test_a_stalled_upload_is_raced_and_the_hedge_is_committed(stallfs, plugin_manager, tmp_path):
    model = _model()
    remote = "stallmem://bucket/run"
    manager = statekit.CheckpointManager({"model": model}, str(tmp_path / "local"), replicate_to=remote,
                                         replicate_hedge_after_s=0.2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        manager.save(1)
        assert stallfs.stalled.wait(60)
        # the first upload of a data file is stuck half way; the hedge finishes the copy
        assert manager.plugin_state["replicate"].wait(timeout=60) == []
    stalled = stallfs.stalled_path
    name = stalled.rsplit("/", 1)[-1]
    assert ".attempt1.tmp" in name
    final = stalled.rsplit("/", 1)[0] + "/" + name[1:].split(".attempt1.tmp")[0].rsplit(".", 1)[0]
    assert final.endswith(DATA)
    # the stalled attempt has not ended: its partial file is still there, under its own name
    assert stalled in stallfs.store and stallfs.store[stalled].getbuffer().nbytes > 0
    local = _local_bytes(tmp_path / "local" / "checkpoint-00000001")
    assert bytes(stallfs.store[final].getvalue()) == local[final.rsplit("/", 1)[-1]]
    # the hedge won; said by a warning naming the file and by the stats
    messages = [str(w.message) for w in caught]
    assert any(f"stallmem://{final.split('://')[-1].lstrip('/')}: hedged copy: no progress for 0.2 s" in m and "attempt 2 finished first and was committed" in m
               for m in messages), messages
    replication = manager.stats().replication
    assert replication["hedged"] >= 1 and replication["hedges_won"] >= 1
    # no data file was ever written under its final name: only whole, verified temporary
    # files were renamed to it, with exactly the local bytes
    assert not [p for p in stallfs.opened_for_write if p.endswith(DATA)]
    renamed_to_final = {dst: data for src, dst, data in stallfs.renamed if dst.endswith(DATA)}
    assert {p.rsplit("/", 1)[-1]: d for p, d in renamed_to_final.items()} == local
    assert all(".tmp" in src for src, dst, _ in stallfs.renamed)
    _resume_from_remote(tmp_path, remote, model)

    # released, the stalled attempt finishes, loses, and removes its temporary file
    stallfs.release.set()
    assert stallfs.stalled_removed.wait(60)
    assert not [p for p in stallfs.store if p.endswith(".tmp")]
    statekit.verify(f"{remote}/checkpoint-00000001")
    assert manager.plugin_state["replicate"].copied_names() == {"checkpoint-00000001"}


def test_the_stalled_attempt_wins_when_the_hedge_fails(stallfs, plugin_manager, tmp_path):
    """The second attempt fails (EIO); the copy waits for the first, which is committed."""
    stallfs.fail_hedge = True
    model = _model()
    remote = "stallmem://bucket/run"
    manager = statekit.CheckpointManager({"model": model}, str(tmp_path / "local"), replicate_to=remote,
                                         replicate_hedge_after_s=0.2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        manager.save(1)
        assert stallfs.stalled.wait(60)
        assert stallfs.hedge_failed.wait(60)
        assert manager.plugin_state["replicate"].pending() == ["checkpoint-00000001"]  # not failed: the first attempt still runs
        stallfs.release.set()
        assert manager.plugin_state["replicate"].wait(timeout=60) == []
    messages = [str(w.message) for w in caught]
    assert any("hedged copy" in m and "attempt 1 finished first and was committed" in m for m in messages), messages
    assert not any("replication try" in m for m in messages)  # the try did not fail
    replication = manager.stats().replication
    assert replication["hedged"] >= 1 and replication["hedges_won"] == 0
    assert not [p for p in stallfs.store if p.endswith(".tmp")]
    _resume_from_remote(tmp_path, remote, model)


@pytest.mark.parametrize("disabled", [None, 0])
def test_hedging_disabled_waits_for_the_stalled_upload(stallfs, plugin_manager, tmp_path, disabled):
    model = _model()
    remote = "stallmem://bucket/run"
    manager = statekit.CheckpointManager({"model": model}, str(tmp_path / "local"), replicate_to=remote,
                                         replicate_hedge_after_s=disabled)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        manager.save(1)
        assert stallfs.stalled.wait(60)
        # nothing races the stalled upload: the copy stays pending with no remote commit
        assert manager.plugin_state["replicate"].wait(timeout=1.0) == ["checkpoint-00000001"]
        assert "bucket/run/checkpoint-00000001/manifest.json" not in str(list(stallfs.store))
        stallfs.release.set()
        assert manager.plugin_state["replicate"].wait(timeout=60) == []
    assert not any("hedged copy" in str(w.message) for w in caught)
    assert manager.stats().replication["hedged"] == 0
    # one attempt per file, written under its final name (no temporary file, no rename)
    assert stallfs.stalled_path.endswith(DATA)
    assert stallfs.opened_for_write.count(stallfs.stalled_path) == 1
    assert not [p for p in stallfs.store if p.endswith(".tmp")] and not stallfs.renamed
    _resume_from_remote(tmp_path, remote, model)


def test_a_hedged_copy_to_a_local_remote_root_renames_the_winner(plugin_manager, tmp_path, monkeypatch):
    """file:// remote root: the first upload of a data file writes half its bytes to its
    temporary file and stalls; the hedge's file is renamed to the final name."""
    release, stalled, cleaned = threading.Event(), threading.Event(), threading.Event()
    held: dict[str, str] = {}
    real_copy, real_remove = remote_copy._copy_file, remote_copy._remove_quietly

    def stalling_copy(src, dst, rel, meta, *, to=None, progress=None):
        if rel.endswith(DATA) and not held:
            held["temp"] = dst.path_of(to)
            with open(held["temp"], "wb") as f:
                f.write(src.read_bytes(rel)[: meta.size_bytes // 2])  # a partial file on disk
            stalled.set()
            assert release.wait(60)
        return real_copy(src, dst, rel, meta, to=to, progress=progress)

    def watching_remove(dst, rel):
        real_remove(dst, rel)
        if dst.path_of(rel) == held.get("temp"):
            cleaned.set()

    monkeypatch.setattr(remote_copy, "_copy_file", stalling_copy)
    monkeypatch.setattr(remote_copy, "_remove_quietly", watching_remove)
    model = _model()
    remote = tmp_path / "remote"
    manager = statekit.CheckpointManager({"model": model}, str(tmp_path / "local"), replicate_to=str(remote),
                                         replicate_hedge_after_s=0.2)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            manager.save(1)
            assert stalled.wait(60)
            assert manager.plugin_state["replicate"].wait(timeout=60) == []
        copy = remote / "checkpoint-00000001"
        temps = [p.name for p in copy.iterdir() if p.name.endswith(".tmp")]
        assert temps == [held["temp"].rsplit("/", 1)[-1]]  # only the stalled attempt's, still open
        assert _local_bytes(copy) == _local_bytes(tmp_path / "local" / "checkpoint-00000001")
        assert manager.stats().replication["hedges_won"] >= 1
        _resume_from_remote(tmp_path, str(remote), model)
    finally:
        release.set()
    assert cleaned.wait(60)
    assert not [p for p in (remote / "checkpoint-00000001").iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("value", [-1, float("nan"), float("inf"), "30", True])
def test_bad_hedge_option_is_refused(plugin_manager, tmp_path, value):
    with pytest.raises(statekit.InvalidOptionError) as info:
        statekit.CheckpointManager({"model": torch.nn.Linear(2, 2)}, str(tmp_path), replicate_to=str(tmp_path / "r"),
                                   replicate_hedge_after_s=value)
    assert str(info.value) == ("replicate_hedge_after_s must be a finite number of seconds >= 0 or None (0 or None: "
                               f"no hedged copies), got {value!r}")


def test_a_hedged_copy_to_an_object_store_writes_the_final_name_without_a_rename(plugin_manager, tmp_path, monkeypatch, s3_bucket):
    """s3:// (moto): an object appears only once written whole and both attempts hold the
    same bytes, so the hedge writes the final key itself: no temporary object, no rename
    (a server-side copy of every file); the stalled attempt, released, writes the same bytes."""
    from statekit.plugin_api import Storage

    release, stalled, ended = threading.Event(), threading.Event(), threading.Event()
    held: dict[str, str] = {}
    real_copy = remote_copy._copy_file
    renames = []
    monkeypatch.setattr(Storage, "rename", lambda self, rel, to: renames.append((rel, to)))

    def stalling_copy(src, dst, rel, meta, *, to=None, progress=None):
        if rel.endswith(DATA) and not held:
            held["to"] = to
            stalled.set()
            assert release.wait(60)
            try:
                return real_copy(src, dst, rel, meta, to=to, progress=progress)
            finally:
                ended.set()
        return real_copy(src, dst, rel, meta, to=to, progress=progress)

    monkeypatch.setattr(remote_copy, "_copy_file", stalling_copy)
    model = _model()
    remote = f"{s3_bucket}/run"
    manager = statekit.CheckpointManager({"model": model}, str(tmp_path / "local"), replicate_to=remote,
                                         replicate_hedge_after_s=0.2)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            manager.save(1)
            assert stalled.wait(60)
            assert manager.plugin_state["replicate"].wait(timeout=60) == []
        assert held["to"].endswith(DATA) and ".tmp" not in held["to"]  # the stalled attempt targets the final key
        assert renames == []
        assert manager.stats().replication["hedges_won"] >= 1
        _resume_from_remote(tmp_path, remote, model)
    finally:
        release.set()
    assert ended.wait(60)
    statekit.verify(f"{remote}/checkpoint-00000001")  # the late attempt wrote the same bytes
    listed = Storage(f"{remote}/checkpoint-00000001").find()
    assert not [p for p in listed if p.endswith(".tmp")]
