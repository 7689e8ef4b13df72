"""Every way a tensor file is read: ``O_DIRECT`` into the targets (local disk), the page
cache where ``O_DIRECT`` is refused, and fsspec streams (``memory://``); each one loads
exactly, and catches a flipped byte and a truncated file, naming the file."""

from __future__ import annotations

import os
import threading

import pytest
import torch

import statekit
from statekit.format import new_hasher
from statekit.storage import direct, prefault
from statekit.storage.direct import DIRECT_ALIGN, DirectReader


def _state(seed: int) -> dict:
    """A model (large, odd-sized tensors: unaligned heads and tails, several read pieces)
    and an optimizer whose state is read into fresh memory."""
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(1031, 1029), torch.nn.Linear(1029, 7))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 1031, generator=g)).sum().backward()
    opt.step()
    return {"model": model, "optim": opt, "bf16": torch.randn(3001, 517, generator=g).to(torch.bfloat16)}


def _assert_equal_states(a: dict, b: dict) -> None:
    for (ka, va), (kb, vb) in zip(a["model"].state_dict().items(), b["model"].state_dict().items()):
        assert ka == kb and torch.equal(va, vb), ka
    sa, sb = a["optim"].state_dict()["state"], b["optim"].state_dict()["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        for k in sa[i]:
            assert torch.equal(sa[i][k], sb[i][k]), (i, k)
    assert torch.equal(a["bf16"], b["bf16"])


@pytest.fixture(params=["direct", "page-cache"])
def read_path(request, monkeypatch):
    """Local loads through :class:`DirectReader` with ``O_DIRECT``, or with ``O_DIRECT``
    refused (as on tmpfs), so every read goes through the page cache."""
    if request.param == "page-cache":
        real_open = os.open

        def refuse_direct(path, flags, *args, **kwargs):
            if flags & getattr(os, "O_DIRECT", 0):
                raise OSError(22, "Invalid argument", path)
            return real_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(direct.os, "open", refuse_direct)
    return request.param


def _opened_direct(monkeypatch) -> list[bool]:
    seen: list[bool] = []
    real_init = DirectReader.__init__

    def spy(self, path):
        real_init(self, path)
        seen.append(self.direct)

    monkeypatch.setattr(DirectReader, "__init__", spy)
    return seen


def test_local_load_is_exact(tmp_path, plugin_manager, read_path, monkeypatch):
    if read_path == "direct" and not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    url = str(tmp_path / "c")
    saved = _state(0)
    statekit.save(url, saved)
    seen = _opened_direct(monkeypatch)
    fresh = _state(1)
    statekit.load(url, fresh)
    _assert_equal_states(saved, fresh)
    assert seen and all(s == (read_path == "direct") for s in seen)


def test_memory_load_is_exact(plugin_manager):
    url = "memory://statekit-read-paths/c"
    saved = _state(0)
    statekit.save(url, saved)
    fresh = _state(1)
    statekit.load(url, fresh)
    _assert_equal_states(saved, fresh)


def _flip_middle(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def _truncate(path) -> None:
    path.write_bytes(path.read_bytes()[:-4097])


@pytest.mark.parametrize("damage", [_flip_middle, _truncate], ids=["flipped-byte", "truncated"])
@pytest.mark.parametrize("rel", ["model.safetensors", "optim.safetensors"])
def test_local_damage_is_named(tmp_path, plugin_manager, read_path, damage, rel):
    url = str(tmp_path / "c")
    statekit.save(url, _state(0))
    damage(tmp_path / "c" / rel)
    with pytest.raises(statekit.CorruptCheckpointError) as info:
        statekit.load(url, _state(1))
    assert rel in str(info.value)
    assert info.value.path == f"{url}/{rel}"


@pytest.mark.parametrize("damage", [_flip_middle, _truncate], ids=["flipped-byte", "truncated"])
def test_memory_damage_is_named(plugin_manager, damage, tmp_path):
    import fsspec

    url = f"memory://statekit-read-paths/{damage.__name__}"
    statekit.save(url, _state(0))
    fs = fsspec.filesystem("memory")
    local = tmp_path / "optim.safetensors"
    local.write_bytes(fs.cat_file(f"{url}/optim.safetensors"))
    damage(local)
    fs.pipe_file(f"{url}/optim.safetensors", local.read_bytes())
    with pytest.raises(statekit.CorruptCheckpointError, match="optim.safetensors"):
        statekit.load(url, _state(1))


@pytest.mark.parametrize("offset", [0, 1, DIRECT_ALIGN - 3, DIRECT_ALIGN, 3 * DIRECT_ALIGN + 5])
@pytest.mark.parametrize("misaligned_destination", [False, True])
def test_direct_reader_fill_reads_every_byte_in_order(tmp_path, monkeypatch, offset, misaligned_destination):
    """Pieces (head through the page cache, aligned middle O_DIRECT, tail) land in place
    and reach ``on_chunk`` in file order, so the streaming checksum is the file's."""
    monkeypatch.setattr(direct, "READ_PIECE_BYTES", 1 << 20)  # several pieces per fill
    monkeypatch.setattr(direct, "BOUNCE_PIECE_BYTES", 1 << 20)
    data = os.urandom(3 * (1 << 20) + 12345)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    want = len(data) - offset - 7
    raw = torch.empty(want + 2 * DIRECT_ALIGN, dtype=torch.uint8)
    shift = (offset - raw.data_ptr()) % DIRECT_ALIGN + (1 if misaligned_destination else 0)
    view = memoryview(raw[shift : shift + want].numpy())
    chunks: list[bytes] = []
    direct_bytes = []
    real_preadv = os.preadv

    def spy(fd, buffers, at):
        got = real_preadv(fd, buffers, at)
        if fd == f._direct_fd:
            direct_bytes.append(got)
        return got

    monkeypatch.setattr(direct.os, "preadv", spy)
    with DirectReader(str(path)) as f:
        f.seek(offset)
        assert f.fill(view, lambda c: chunks.append(bytes(c))) == want
        assert f.tell() == offset + want
    assert bytes(view) == data[offset : offset + want]
    assert b"".join(chunks) == data[offset : offset + want]
    if f.direct:  # a misaligned destination is read O_DIRECT too (through the bounce buffers)
        assert sum(direct_bytes) >= want - 2 * DIRECT_ALIGN and len(chunks) >= 3


def test_direct_reader_misaligned_destination_stops_at_end_of_file(tmp_path, monkeypatch):
    monkeypatch.setattr(direct, "BOUNCE_PIECE_BYTES", 1 << 20)
    data = os.urandom((2 << 20) + 123)
    path = tmp_path / "short.bin"
    path.write_bytes(data)
    raw = torch.empty((3 << 20) + DIRECT_ALIGN, dtype=torch.uint8)
    shift = (64 - raw.data_ptr()) % DIRECT_ALIGN  # as the allocator places large tensors
    view = memoryview(raw[shift : shift + (3 << 20)].numpy())
    with DirectReader(str(path)) as f:
        f.seek(5)
        assert f.fill(view) == len(data) - 5
        assert bytes(view[: len(data) - 5]) == data[5:]
        assert f.read() == b""


def test_direct_reader_stops_at_end_of_file(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * (2 << 20))
    view = memoryview(bytearray(3 << 20))
    with DirectReader(str(path)) as f:
        assert f.fill(view) == 2 << 20
        assert f.read() == b""


def test_direct_reader_missing_file_raises(tmp_path):
    with pytest.raises(FileNotFoundError):
        DirectReader(str(tmp_path / "nope.bin"))


def test_populate_leaves_contents_unchanged():
    t = torch.arange(5 << 20, dtype=torch.int32)
    before = t.clone()
    fresh = torch.empty(8 << 20, dtype=torch.uint8)
    if not prefault.populate(fresh.data_ptr(), fresh.numel()):
        pytest.skip("kernel without MADV_POPULATE_WRITE")
    assert prefault.populate(t.data_ptr() + 3, t.numel() * 4 - 3)
    assert torch.equal(t, before)


def test_prefaulter_thread_ends_with_the_context_even_on_error():
    buffers = [torch.empty(32 << 20, dtype=torch.uint8) for _ in range(4)]
    with pytest.raises(ValueError, match="boom"):
        with prefault.Prefaulter(buffers):
            raise ValueError("boom")
    assert not [t for t in threading.enumerate() if t.name == "statekit-prefault"]


def test_checksum_of_a_direct_load_is_the_files(tmp_path, plugin_manager):
    """The streaming hash over the pieces equals a hash of the whole file's bytes."""
    url = str(tmp_path / "c")
    statekit.save(url, _state(0))
    path = tmp_path / "c" / "optim.safetensors"
    whole = new_hasher()
    whole.update(path.read_bytes())
    streamed = new_hasher()
    with DirectReader(str(path)) as f:
        buf = torch.empty(path.stat().st_size, dtype=torch.uint8)
        f.fill(memoryview(buf.numpy()), streamed.update)
    assert streamed.hexdigest() == whole.hexdigest()
