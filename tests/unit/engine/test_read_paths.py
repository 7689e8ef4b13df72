"""Every way a tensor file is read: ``O_DIRECT`` into the targets (local disk), the page
cache where ``O_DIRECT`` is refused, and fsspec streams (``memory://``); each one loads
exactly, and catches a flipped byte and a truncated file, naming the file."""

from __future__ import annotations

import os
import threading
import time

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


def _exact_round_trip(tmp_path, monkeypatch) -> tuple[str, list[bool]]:
    """Save _state(0) to tmp_path/c, load it into _state(1), check it is exact; returns
    the URL and, per DirectReader opened by the load, whether it read with O_DIRECT."""
    url = str(tmp_path / "c")
    saved = _state(0)
    statekit.save(url, saved)
    seen = _opened_direct(monkeypatch)
    fresh = _state(1)
    statekit.load(url, fresh)
    _assert_equal_states(saved, fresh)
    return url, seen


def test_local_load_is_exact(tmp_path, plugin_manager, read_path, monkeypatch):
    if read_path == "direct" and not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    _, seen = _exact_round_trip(tmp_path, monkeypatch)
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


@pytest.mark.parametrize("where", [0.3, 0.5, 0.999])
def test_a_flipped_byte_is_caught_with_many_pieces_read_ahead(tmp_path, plugin_manager, monkeypatch, where):
    """256 KiB pieces: every file is dozens of pieces, each read while READS_AHEAD more
    are in flight; the load is exact, and a byte flipped anywhere is caught and named."""
    monkeypatch.setattr(direct, "BOUNCE_PIECE_BYTES", 256 * 1024)
    url, seen = _exact_round_trip(tmp_path, monkeypatch)
    if not all(seen):
        pytest.skip("O_DIRECT refused here: no read-ahead stream")
    path = tmp_path / "c" / "optim.safetensors"
    data = bytearray(path.read_bytes())
    data[int(len(data) * where)] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(statekit.CorruptCheckpointError) as info:
        statekit.load(url, _state(1))
    assert info.value.path == f"{url}/optim.safetensors"


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
    """Pieces (O_DIRECT into the bounce buffers, whatever the alignment) land in place and
    reach ``on_chunk`` in file order, so the streaming checksum is the file's."""
    monkeypatch.setattr(direct, "BOUNCE_PIECE_BYTES", 1 << 20)  # several pieces per fill
    monkeypatch.setattr(direct, "CACHE_STEP_BYTES", 300_007)  # copy/checksum steps end inside pieces
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
    if f.direct:  # every byte is read O_DIRECT (through the bounce buffers), copied out in steps
        assert sum(direct_bytes) >= want and len(chunks) >= 3
        assert max(map(len, chunks)) == 300_007 and len(chunks) > want // 300_007


def test_page_cache_fill_hands_the_checksum_cache_sized_steps(tmp_path, monkeypatch):
    """Where ``O_DIRECT`` is refused (tmpfs) a fill reads and checksums in
    CACHE_STEP_BYTES steps too; every byte lands in place and reaches ``on_chunk`` in order."""
    monkeypatch.setattr(direct, "CACHE_STEP_BYTES", 300_007)
    data = os.urandom((2 << 20) + 4321)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    chunks: list[bytes] = []
    out = bytearray(len(data) - 11)
    with DirectReader(str(path)) as f:
        f._direct_fd = None  # as where O_DIRECT is refused
        f.seek(11)
        assert f.fill(memoryview(out), lambda c: chunks.append(bytes(c))) == len(out)
    assert bytes(out) == data[11:] and b"".join(chunks) == data[11:]
    assert max(map(len, chunks)) == 300_007 and len(chunks) == -(-len(out) // 300_007)


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


def test_direct_reader_streams_across_fills_and_restarts_after_a_seek(tmp_path, monkeypatch):
    """Consecutive fills (a file's tensors, small ones too) continue one stream of pieces,
    read once each; a seek outside it restarts the stream; every byte lands where it belongs."""
    monkeypatch.setattr(direct, "BOUNCE_PIECE_BYTES", 1 << 20)
    data = os.urandom((5 << 20) + 777)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    offsets: list[int] = []
    real_preadv = os.preadv

    def spy(fd, buffers, at):
        if fd == f._direct_fd:
            offsets.append(at)
        return real_preadv(fd, buffers, at)

    monkeypatch.setattr(direct.os, "preadv", spy)
    sizes = [(2 << 20) + 13, 100, 4096, (1 << 20) - 7, (1 << 20) + 5000]
    with DirectReader(str(path)) as f:
        f.seek(9)
        position = 9
        for size in sizes:
            out = bytearray(size)
            assert f.fill(memoryview(out)) == size
            assert bytes(out) == data[position : position + size]
            position += size
        if f.direct:
            assert offsets == sorted(set(offsets)) and offsets[0] == 0  # each piece read once, in order
        f.seek(3 << 20)  # backwards: a new stream
        out = bytearray(1 << 20)
        assert f.fill(memoryview(out)) == 1 << 20 and bytes(out) == data[3 << 20 : 4 << 20]
        rest = bytearray(2 << 20)
        assert f.fill(memoryview(rest)) == len(data) - (4 << 20)  # stops at the end of the file
        assert bytes(rest[: len(data) - (4 << 20)]) == data[4 << 20 :]


def test_the_next_pieces_are_queued_before_the_reader_waits_for_the_one_in_flight(tmp_path, monkeypatch):
    """Once a piece is copied out, the read into its buffer is queued before the caller
    waits for the next piece, so the read threads never wait for the caller to wake:
    while the second piece's read is held, the reads READS_AHEAD pieces past it are queued
    (and the data still arrives whole and in order)."""
    piece = 1 << 20
    monkeypatch.setattr(direct, "BOUNCE_PIECE_BYTES", piece)
    data = os.urandom((direct.READS_AHEAD + 3) * piece)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    release = threading.Event()
    real_read_piece = DirectReader._read_piece

    def held_second_piece(self, view, offset, use_direct):
        if offset == piece:
            assert release.wait(10)
        return real_read_piece(self, view, offset, use_direct)

    monkeypatch.setattr(DirectReader, "_read_piece", held_second_piece)
    out = bytearray(len(data))
    last = (direct.READS_AHEAD + 1) * piece  # the last piece queued behind the held one

    def queued() -> bool:
        return any(offset == last for offset, _, _ in list(f._ahead))

    with DirectReader(str(path)) as f:
        if not f.direct:
            pytest.skip("O_DIRECT refused here: no read-ahead stream")
        filling = threading.Thread(target=f.fill, args=(memoryview(out),))
        filling.start()
        deadline = time.monotonic() + 10
        while not queued() and time.monotonic() < deadline:
            time.sleep(0.001)
        seen = queued()
        release.set()
        filling.join()
    assert seen
    assert bytes(out) == data


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


def test_prefaulter_skips_a_buffer_handed_over_before_it_started():
    """A buffer the reader claims first is never written by the helper: its bytes stay."""
    claimed = torch.arange(1 << 20, dtype=torch.int32)
    before = claimed.clone()
    other = torch.full((1 << 20,), 7, dtype=torch.int32)
    faulter = prefault.Prefaulter([claimed, other])
    faulter.ready(claimed)
    faulter.run()
    assert torch.equal(claimed, before)
    assert not other.any()  # the helper faulted this one in by writing zeros


@pytest.fixture
def held_helper(monkeypatch):
    """The helper's zeroing blocks in its first piece until ``release`` is set (1 MiB pieces)."""
    started, release = threading.Event(), threading.Event()
    real_memset = prefault.ctypes.memset

    def slow_memset(address, value, nbytes):
        started.set()
        release.wait(10)
        return real_memset(address, value, nbytes)

    monkeypatch.setattr(prefault.ctypes, "memset", slow_memset)
    monkeypatch.setattr(prefault, "PIECE_BYTES", 1 << 20)
    try:
        yield started, release
    finally:
        release.set()


def _ready_in_thread(faulter, buffer):
    handed = threading.Event()
    thread = threading.Thread(target=lambda: (faulter.ready(buffer), handed.set()), daemon=True)
    thread.start()
    return handed


def test_ready_waits_for_the_piece_being_zeroed_then_the_helper_leaves_the_buffer(held_helper):
    """A claimed buffer is handed over when the piece in progress is zeroed, and the helper
    writes nothing to it afterwards: the read's bytes cannot be overwritten by a late zero."""
    started, release = held_helper
    buffer = torch.full((1 << 20,), 7, dtype=torch.int32)  # 4 MiB: four pieces
    with prefault.Prefaulter([buffer, torch.empty(32 << 20, dtype=torch.uint8)]) as faulter:
        assert started.wait(10)
        handed = _ready_in_thread(faulter, buffer)
        assert not handed.wait(0.2)  # its first piece is still being zeroed
        release.set()
        assert handed.wait(10)
        assert not buffer[: 1 << 18].any() and bool((buffer[1 << 18 :] == 7).all())  # one piece zeroed, then left
        buffer.fill_(3)  # the read's bytes
    assert torch.equal(buffer, torch.full_like(buffer, 3))


def test_a_stopped_prefaulter_hands_every_buffer_over(held_helper):
    """Stopped in the middle of a buffer, the helper hands that one and every other over."""
    started, release = held_helper
    buffers = [torch.empty(8 << 20, dtype=torch.uint8) for _ in range(4)]
    with prefault.Prefaulter(buffers) as faulter:
        assert started.wait(10)
        faulter.stop()
        release.set()
        handed = [_ready_in_thread(faulter, b) for b in buffers]
        assert all(h.wait(10) for h in handed)
    prefault.Prefaulter(buffers).ready(torch.empty(4))  # not one of its buffers: returns


@pytest.mark.parametrize("made_ahead", [False, True], ids=["fresh-in-read", "fresh-ahead"])
def test_load_exact_while_a_slow_helper_zeroes_fresh_memory(tmp_path, plugin_manager, monkeypatch, made_ahead):
    """Reads and a slowed helper interleave piece by piece (both the buffers a read makes
    and those made ahead): the load stays exact, so no zero lands on read bytes."""
    from statekit.engine import read_ahead

    if made_ahead:
        monkeypatch.setattr(read_ahead, "PREFAULT_MIN_BYTES", 0)
    monkeypatch.setattr(prefault, "PREFAULT_MIN_BYTES", 0)
    monkeypatch.setattr(prefault, "PIECE_BYTES", 64 << 10)
    real_memset = prefault.ctypes.memset

    def slow_memset(address, value, nbytes):
        time.sleep(0.0005)
        return real_memset(address, value, nbytes)

    monkeypatch.setattr(prefault.ctypes, "memset", slow_memset)
    url = str(tmp_path / "c")
    saved = _state(0)
    statekit.save(url, saved)
    for _ in range(2):
        fresh = _state(1)
        statekit.load(url, fresh)
        _assert_equal_states(saved, fresh)


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


@pytest.fixture
def read_ahead_everything(monkeypatch):
    """Fresh memory made ahead for every tensor file, however small (the threshold is for speed)."""
    from statekit.engine import read_ahead

    monkeypatch.setattr(read_ahead, "PREFAULT_MIN_BYTES", 0)
    taken: list[tuple[str, bool]] = []
    real_take = read_ahead.FreshAhead.take

    def spy(self, rel):
        buffers = real_take(self, rel)
        taken.append((rel, buffers is not None))
        return buffers

    monkeypatch.setattr(read_ahead.FreshAhead, "take", spy)
    return taken


def test_load_with_fresh_memory_made_ahead_is_exact(tmp_path, plugin_manager, read_path, read_ahead_everything):
    url = str(tmp_path / "c")
    saved = _state(0)
    statekit.save(url, saved)
    fresh = _state(1)
    statekit.load(url, fresh)
    _assert_equal_states(saved, fresh)
    assert ("optim.safetensors", True) in read_ahead_everything  # the optimizer state was read into them
    assert not [t for t in threading.enumerate() if t.name == "statekit-fresh-ahead"]


def test_flipped_byte_is_caught_with_fresh_memory_made_ahead(tmp_path, plugin_manager, read_ahead_everything):
    url = str(tmp_path / "c")
    statekit.save(url, _state(0))
    _flip_middle(tmp_path / "c" / "optim.safetensors")
    with pytest.raises(statekit.CorruptCheckpointError) as info:
        statekit.load(url, _state(1))
    assert info.value.path == f"{url}/optim.safetensors"
    assert not [t for t in threading.enumerate() if t.name == "statekit-fresh-ahead"]


def test_fresh_ahead_hands_out_each_files_buffers_once_and_skips_what_it_cannot_parse(tmp_path, plugin_manager, read_ahead_everything):
    from statekit.engine.context import Checkpoint
    from statekit.format import read_manifest
    from statekit.storage import Storage

    url = str(tmp_path / "c")
    statekit.save(url, _state(0))
    (tmp_path / "c" / "bad.safetensors").write_bytes(b"not a safetensors file")
    storage = Storage(url)
    checkpoint = Checkpoint(storage, mode="load", manifest=read_manifest(storage), verify=False)
    rels = ["bad.safetensors", "optim.safetensors", "missing.safetensors"]
    with checkpoint.reading_each_file_once(), checkpoint.fresh_memory_ahead(rels):
        ahead = checkpoint.reader._ahead
        assert ahead.take("bad.safetensors") is None and ahead.take("missing.safetensors") is None
        buffers = ahead.take("optim.safetensors")
        assert buffers and all(b.device.type == "cpu" and b.is_contiguous() for b in buffers.values())
        assert ahead.take("optim.safetensors") is None  # handed out once
        assert ahead.take("model.safetensors") is None  # not one of its files
    assert not [t for t in threading.enumerate() if t.name == "statekit-fresh-ahead"]


def test_fresh_memory_is_made_ahead_only_when_the_models_load_in_place(tmp_path, plugin_manager, read_ahead_everything, monkeypatch):
    """A model off the CPU reads its file through fresh CPU buffers: making the optimizer's
    buffers ahead would hold both at once, so nothing is made ahead then."""
    from statekit.engine import read

    url = str(tmp_path / "c")
    saved = _state(0)
    statekit.save(url, saved)
    assert read.loads_in_place([saved["model"]])
    monkeypatch.setattr(read, "loads_in_place", lambda models: False)
    fresh = _state(1)
    statekit.load(url, fresh)
    _assert_equal_states(saved, fresh)
    assert read_ahead_everything == []
    meta = torch.nn.Linear(2, 2, device="meta")
    assert not read.loads_in_place([meta])


def test_a_conjugate_view_target_is_filled_with_its_values(tmp_path, plugin_manager):
    """A buffer that is a lazy conjugate view (contiguous, conj bit set): the in-place read
    raised StorageError ("view is not supported for conjugate view tensors") after
    overwriting the tensors before it; it is filled through ``copy_`` now."""

    class Module(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.register_buffer("z", torch.randn(1000, dtype=torch.complex64).conj())

    model = Module()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    statekit.save(str(tmp_path / "c"), {"model": model})
    fresh = Module()
    assert fresh.z.is_conj()
    statekit.load(str(tmp_path / "c"), {"model": fresh})
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in expected.items())


def test_bytes_appended_to_a_tensor_file_are_caught_by_a_verifying_load(tmp_path):
    url = str(tmp_path / "c")
    statekit.save(url, {"model": torch.nn.Linear(64, 64)})
    with open(tmp_path / "c" / "model.safetensors", "ab") as f:
        f.write(b"\0" * 10)
    with pytest.raises(statekit.CorruptCheckpointError, match=r"model\.safetensors.*size") as info:
        statekit.load(url, {"model": torch.nn.Linear(64, 64)})
    assert info.value.path.endswith("model.safetensors")
