"""storage: fsspec-backed directories (memory://, local, S3 via moto), commit, listing, removal."""

from __future__ import annotations

import os
import uuid

import torch

import pytest

import statekit
from statekit import storage as st
from statekit.errors import CheckpointExistsError, StatekitError, StorageError


@pytest.fixture
def store(storage_url):
    return st.Storage(storage_url)


def test_fresh_url_does_not_exist(store):
    assert not store.exists()
    assert store.listdir() == []
    assert store.find() == []


def test_write_read_size(store):
    store.write_bytes("a.bin", b"hello")
    with store.open_write("sub/dir/b.bin") as f:
        f.write(b"x" * 10)
        f.write(memoryview(b"yz"))
    assert store.read_bytes("a.bin") == b"hello"
    assert store.read_bytes("sub/dir/b.bin") == b"x" * 10 + b"yz"
    with store.open_read("sub/dir/b.bin") as f:
        assert f.read(3) == b"xxx"
        f.seek(10)
        assert f.read() == b"yz"
    assert store.size("a.bin") == 5
    assert store.size("sub/dir/b.bin") == 12


def test_empty_file(store):
    store.write_bytes("empty", b"")
    assert store.exists("empty")
    assert store.size("empty") == 0
    assert store.read_bytes("empty") == b""


def test_overwrite_file(store):
    store.write_bytes("f", b"first version")
    store.write_bytes("f", b"second")
    assert store.read_bytes("f") == b"second"


def test_missing_file_is_file_not_found(store):
    store.write_bytes("present", b"1")
    with pytest.raises(FileNotFoundError):
        store.read_bytes("absent")
    with pytest.raises(FileNotFoundError):
        store.open_read("absent")
    with pytest.raises(FileNotFoundError):
        store.size("absent")


def test_exists(store):
    assert not store.exists("d/f")
    store.write_bytes("d/f", b"1")
    assert store.exists()
    assert store.exists("d")
    assert store.exists("d/f")
    assert not store.exists("d/g")
    assert not store.exists("e")


def test_listdir(store):
    store.write_bytes("b.json", b"{}")
    store.write_bytes("a.safetensors", b"1")
    store.write_bytes("rng/rank-00000.json", b"{}")
    store.write_bytes("rng/rank-00001.json", b"{}")
    assert store.listdir() == ["a.safetensors", "b.json", "rng"]
    assert store.listdir("rng") == ["rank-00000.json", "rank-00001.json"]
    assert store.listdir("nope") == []


def test_find(store):
    files = ["statekit.json", "model.safetensors", "unet/config.json", "unet/sub/x.bin"]
    for rel in files:
        store.write_bytes(rel, rel.encode())
    assert store.find() == sorted(files)
    assert store.child("unet").find() == ["config.json", "sub/x.bin"]


def test_child_and_urls(store, storage_url):
    child = store.child("checkpoint-00000010")
    assert child.url == f"{storage_url}/checkpoint-00000010"
    assert child.fs is store.fs
    assert store.url_of("a/b") == f"{storage_url}/a/b"
    assert store.url_of("") == storage_url
    child.write_bytes("x", b"1")
    assert store.read_bytes("checkpoint-00000010/x") == b"1"
    assert store.listdir() == ["checkpoint-00000010"]


def test_trailing_slash_is_ignored(storage_url):
    a = st.Storage(storage_url + "/")
    a.write_bytes("x", b"1")
    assert a.url == storage_url
    assert st.Storage(storage_url).read_bytes("x") == b"1"


def test_protocol(store, storage_url):
    expected = storage_url.split("://", 1)[0] if "://" in storage_url else "file"
    assert store.protocol == expected
    assert store.is_local == (expected == "file")


def test_remove(store):
    store.write_bytes("a", b"1")
    store.write_bytes("b", b"2")
    store.remove("a")
    assert not store.exists("a")
    assert store.exists("b")
    store.remove("a")  # missing: no error
    store.remove("never-existed")


def test_remove_tree_stays_inside_its_prefix(storage_url):
    root = st.Storage(storage_url)
    ckpt = root.child("ckpt")
    sibling = root.child("ckpt-2")  # shares the string prefix "ckpt"
    ckpt.write_bytes("model.safetensors", b"1")
    ckpt.write_bytes("rng/rank-00000.json", b"2")
    sibling.write_bytes("model.safetensors", b"3")
    root.write_bytes("latest", b"ckpt")
    ckpt.remove_tree()
    assert not ckpt.exists()
    assert ckpt.find() == []
    assert sibling.read_bytes("model.safetensors") == b"3"
    assert root.read_bytes("latest") == b"ckpt"
    ckpt.remove_tree()  # already gone: no error
    ckpt.write_bytes("again/x", b"4")  # writing after removal recreates directories
    assert ckpt.read_bytes("again/x") == b"4"


def test_commit(store):
    store.write_bytes("model.safetensors", b"data")
    store.commit("statekit.json", b'{"v": 1}')
    assert store.read_bytes("statekit.json") == b'{"v": 1}'
    store.commit("statekit.json", b'{"v": 2}')  # not exclusive: replaces
    assert store.read_bytes("statekit.json") == b'{"v": 2}'
    assert sorted(store.listdir()) == ["model.safetensors", "statekit.json"]  # no temporary files left


def test_commit_exclusive(store):
    store.commit("statekit.json", b"first", exclusive=True)
    with pytest.raises(CheckpointExistsError) as info:
        store.commit("statekit.json", b"second", exclusive=True)
    assert "statekit.json" in str(info.value)
    assert isinstance(info.value, FileExistsError)
    assert store.read_bytes("statekit.json") == b"first"
    assert store.listdir() == ["statekit.json"]


def test_commit_into_new_directory(store):
    store.commit("statekit.json", b"{}", exclusive=True)
    assert store.exists("statekit.json")


def test_invalidate_sees_new_files(store, storage_url):
    store.write_bytes("a", b"1")
    assert store.listdir() == ["a"]
    other = st.Storage(storage_url)  # another writer (same process: may share the fs)
    other.write_bytes("b", b"2")
    store.invalidate()
    assert store.listdir() == ["a", "b"]


def test_unknown_scheme_names_url():
    with pytest.raises(StorageError) as info:
        st.Storage("nosuch://bucket/x")
    assert "nosuch://bucket/x" in str(info.value)
    assert info.value.url == "nosuch://bucket/x"
    assert isinstance(info.value, StatekitError) and isinstance(info.value, OSError)


def test_not_a_url():
    with pytest.raises(StorageError, match="URL or path"):
        st.url_to_fs(5)  # type: ignore[arg-type]


def test_file_url_and_pathlike(tmp_path):
    url = f"file://{tmp_path}/ckpt"
    s = st.Storage(url)
    s.write_bytes("x/y", b"1")
    assert (tmp_path / "ckpt" / "x" / "y").read_bytes() == b"1"
    assert s.is_local
    s2 = st.Storage(tmp_path / "ckpt")  # os.PathLike
    assert s2.read_bytes("x/y") == b"1"
    assert s2.find() == ["x/y"]


def test_local_commit_leaves_no_temporary(tmp_path):
    s = st.Storage(str(tmp_path / "c"))
    s.commit("statekit.json", b"1", exclusive=True)
    with pytest.raises(CheckpointExistsError):
        s.commit("statekit.json", b"2", exclusive=True)
    assert os.listdir(tmp_path / "c") == ["statekit.json"]


def test_storage_errors_wraps_with_url():
    with pytest.raises(StorageError, match=r"writing s3://b/x failed: RuntimeError: boom") as info:
        with st.storage_errors("s3://b/x", "writing"):
            raise RuntimeError("boom")
    assert info.value.url == "s3://b/x"
    assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(FileNotFoundError), st.storage_errors("u", "reading"):  # passes through
        raise FileNotFoundError("u")
    with pytest.raises(CheckpointExistsError), st.storage_errors("u", "committing"):  # statekit errors too
        raise CheckpointExistsError("u")


def test_write_failure_is_storage_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    s = st.Storage(str(blocker / "ckpt"))  # a directory below a regular file
    with pytest.raises(StorageError) as info:
        s.write_bytes("x", b"1")
    assert str(blocker / "ckpt") in str(info.value)


def test_fsync_path_tolerates_missing(tmp_path):
    st.fsync_path(str(tmp_path / "missing"))
    st.fsync_path(str(tmp_path))


@pytest.mark.s3
def test_s3_explicit_storage_options(s3_server, s3_bucket, monkeypatch):
    """Without AWS_ENDPOINT_URL, S3Server.storage_options reach the server (older s3fs)."""
    import s3fs

    monkeypatch.delenv("AWS_ENDPOINT_URL")
    s3fs.S3FileSystem.clear_instance_cache()
    store = st.Storage(f"{s3_bucket}/explicit", storage_options=s3_server.storage_options)
    store.write_bytes("a", b"1")
    store.commit("statekit.json", b"{}", exclusive=True)
    assert store.find() == ["a", "statekit.json"]
    assert s3_server.filesystem().cat(f"{s3_bucket.removeprefix('s3://')}/explicit/a") == b"1"
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.mark.s3
def test_s3_environment(s3_server):
    assert os.environ["AWS_ENDPOINT_URL"] == s3_server.endpoint_url
    assert os.environ["AWS_ACCESS_KEY_ID"] == "testing"
    assert os.environ["AWS_SECRET_ACCESS_KEY"] == "testing"
    assert os.environ["AWS_DEFAULT_REGION"] == "us-east-1"
    assert s3_server.endpoint_url.startswith("http://127.0.0.1:")


@pytest.mark.s3
def test_s3_missing_bucket_is_named_and_never_created(s3_server, plugin_manager):
    """A typo in a bucket name is an error naming the bucket, not a new bucket."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    bucket = f"statekit-no-such-{uuid.uuid4().hex[:10]}"
    for attempt in (
        lambda: statekit.save(f"s3://{bucket}/run/ckpt", {"t": torch.arange(4)}),
        lambda: statekit.CheckpointManager({"t": torch.arange(4)}, f"s3://{bucket}/run").save(1),
    ):
        with pytest.raises(statekit.StorageError, match=rf"bucket '{bucket}' does not exist; statekit never creates buckets") as info:
            attempt()
        assert info.value.url.startswith(f"s3://{bucket}/run")
    server = s3_server.filesystem()
    server.invalidate_cache()
    assert bucket not in [b.rstrip("/") for b in server.ls("")]
    s3fs.S3FileSystem.clear_instance_cache()


def test_storage_answers_its_capabilities(tmp_path, monkeypatch):
    """Callers outside storage/ ask a Storage what it can do (a local path for mmap and
    fsync, whether other processes see it) instead of reading is_local or protocol names."""
    local = st.Storage(str(tmp_path / "ckpt"))
    assert local.local_path("a/b.bin") == str(tmp_path / "ckpt" / "a" / "b.bin")
    assert local.local_path() == str(tmp_path / "ckpt") and local.shared_between_processes
    memory = st.Storage(f"memory://{tmp_path.name}/ckpt")
    assert memory.local_path("a.bin") is None and not memory.shared_between_processes
    synced = []
    monkeypatch.setattr("statekit.storage.fs.fsync_path", synced.append)
    local.write_bytes("a/b.bin", b"x")
    synced.clear()
    local.make_durable(["a/b.bin"])
    assert synced == [str(tmp_path / "ckpt" / "a" / "b.bin"), str(tmp_path / "ckpt" / "a")]  # the file, then its directory
    memory.make_durable(["a.bin"])  # an object store's write is durable when it returns: nothing to do
    assert len(synced) == 2
