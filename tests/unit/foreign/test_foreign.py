"""Cross-format reading (statekit.foreign): detection, listing from metadata, one-tensor reads, diff."""

from __future__ import annotations

import math
import os
import sys
import warnings

import fsspec
import pytest
import safetensors.torch
import torch

import statekit
from statekit.errors import CheckpointNotFoundError, IncompleteCheckpointError, PickleNotAllowedError, StatekitError
from statekit.foreign import FORMATS, detect_format, diff, open_checkpoint



def _state():
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(3, 4, generator=g), "b": torch.arange(5, dtype=torch.int64), "h": torch.ones(2, dtype=torch.bfloat16)}


def _dcp_save(state, path):
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=str(path))


def test_formats_listed():
    assert FORMATS == ("statekit", "accelerate", "dcp", "trainer", "safetensors", "torch")


def test_safetensors_file_header_listing_and_ranged_read(tmp_path):
    state = _state()
    path = tmp_path / "m.safetensors"
    safetensors.torch.save_file(state, str(path), metadata={"who": "me"})
    assert detect_format(str(path)) == "safetensors"
    reader = open_checkpoint(str(path))
    infos = reader.tensors()
    assert set(infos) == {"w", "b", "h"}
    assert (infos["w"].dtype, infos["w"].shape, infos["w"].size_bytes, infos["w"].file) == ("float32", (3, 4), 48, "m.safetensors")
    assert infos["h"].dtype == "bfloat16" and reader.metadata["who"] == "me"
    for name, t in state.items():
        assert torch.equal(reader.load_tensor(name), t)
    with pytest.raises(KeyError, match="nope"):
        reader.load_tensor("nope")


def test_torch_file_needs_allow_pickle(tmp_path):
    state = {"model": _state(), "step": 3}
    path = tmp_path / "ckpt.pt"
    torch.save(state, path)
    assert detect_format(str(path)) == "torch"
    with pytest.raises(PickleNotAllowedError, match="ckpt.pt"):
        open_checkpoint(str(path))
    reader = open_checkpoint(str(path), allow_pickle=True)
    assert set(reader.tensors()) == {"model.w", "model.b", "model.h"}
    assert torch.equal(reader.load_tensor("model.w"), state["model"]["w"])
    assert reader.tensors()["model.b"].size_bytes == 40


def test_dcp_directory_needs_allow_pickle(tmp_path):
    model = torch.nn.Linear(4, 3)
    state = {"model": model.state_dict(), "extra": {"t": torch.arange(6).reshape(2, 3)}, "step": 7}
    _dcp_save(state, tmp_path / "dcp")
    assert sorted(os.listdir(tmp_path / "dcp"))[0] == ".metadata"
    assert detect_format(str(tmp_path / "dcp")) == "dcp"
    with pytest.raises(PickleNotAllowedError, match=r"dcp/\.metadata"):
        open_checkpoint(str(tmp_path / "dcp"))
    reader = open_checkpoint(str(tmp_path / "dcp"), allow_pickle=True)
    infos = reader.tensors()
    assert set(infos) == {"model.weight", "model.bias", "extra.t"}
    assert infos["model.weight"].shape == (3, 4) and infos["extra.t"].dtype == "int64"
    assert infos["model.weight"].file.endswith(".distcp") and reader.metadata["objects"] == ["step"]
    assert torch.equal(reader.load_tensor("model.weight"), model.weight.detach())
    assert torch.equal(reader.load_tensor("extra.t"), state["extra"]["t"])


def test_accelerate_directory(tmp_path):
    from accelerate_helpers import build, train_steps

    run = build(seed=0)
    train_steps(run, 3)
    accelerator, model, optimizer = run[0], run[1], run[2]
    accelerator.save_state(str(tmp_path / "acc"))
    names = set(os.listdir(tmp_path / "acc"))
    assert {"model.safetensors", "optimizer.bin"} <= names, names
    assert detect_format(str(tmp_path / "acc")) == "accelerate"
    reader = open_checkpoint(str(tmp_path / "acc"))
    assert "optimizer.bin" in reader.skipped
    assert set(reader.tensors()) == {f"model.safetensors:{k}" for k in model.state_dict()}
    assert torch.equal(reader.load_tensor("model.safetensors:fc1.weight"), model.fc1.weight.detach())
    full = open_checkpoint(str(tmp_path / "acc"), allow_pickle=True)
    assert not full.skipped
    exp_avg = optimizer.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(full.load_tensor("optimizer.bin:state.0.exp_avg"), exp_avg)


def test_accelerate_directory_of_compiled_model_lists_names_without_wrapper_prefixes(tmp_path):
    """Accelerate keeps torch.compile's ``_orig_mod.`` prefix in its model files; inspect and diff strip it."""
    from accelerate_helpers import fresh_accelerator

    accelerator = fresh_accelerator()
    torch.manual_seed(0)
    compiled = accelerator.prepare(torch.compile(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))))
    plain = compiled._orig_mod
    accelerator.save_state(str(tmp_path / "c"))
    accelerator.save_state(str(tmp_path / "bin"), safe_serialization=False)
    assert all(k.startswith("_orig_mod.") for k in safetensors.torch.load_file(str(tmp_path / "c" / "model.safetensors")))
    reader = open_checkpoint(str(tmp_path / "c"))
    assert set(reader.tensors()) == {f"model.safetensors:{k}" for k in plain.state_dict()}
    assert torch.equal(reader.load_tensor("model.safetensors:0.weight"), plain[0].weight.detach())
    pickled = open_checkpoint(str(tmp_path / "bin"), allow_pickle=True)
    assert {k for k in pickled.tensors() if k.startswith("pytorch_model.bin:")} == {
        f"pytorch_model.bin:{k}" for k in plain.state_dict()
    }
    assert torch.equal(pickled.load_tensor("pytorch_model.bin:1.bias"), plain[1].bias.detach())
    statekit.save(str(tmp_path / "s"), {"model": plain})
    report = diff(reader, open_checkpoint(str(tmp_path / "s")))
    model_keys = {f"model.safetensors:{k}" for k in plain.state_dict()}
    assert not model_keys & set(report["added"]) and not report["removed"] and not report["changed"]
    assert {t["key"] for t in report["tensors"]} == model_keys and all(t["equal"] for t in report["tensors"])


def test_statekit_checkpoint_keys_by_file(tmp_path):
    model = torch.nn.Linear(4, 2)
    statekit.save(str(tmp_path / "ck"), {"model": model}, step=1)
    assert detect_format(str(tmp_path / "ck")) == "statekit"
    reader = open_checkpoint(str(tmp_path / "ck"))
    assert reader.metadata["step"] == 1
    assert torch.equal(reader.load_tensor("model.safetensors:weight"), model.weight.detach())
    assert torch.equal(reader.load_tensor("weight"), model.weight.detach())  # a unique bare name


def test_remote_memory_urls():
    fs = fsspec.filesystem("memory")
    state = _state()
    with fs.open("/foreign/m.safetensors", "wb") as f:
        f.write(safetensors.torch.save(state))
    reader = open_checkpoint("memory://foreign/m.safetensors")
    assert reader.format == "safetensors" and torch.equal(reader.load_tensor("w"), state["w"])
    model = torch.nn.Linear(3, 3)
    statekit.save("memory://foreign/ck", {"model": model})
    assert torch.equal(open_checkpoint("memory://foreign/ck").load_tensor("model.safetensors:bias"), model.bias.detach())
    buf = __import__("io").BytesIO()
    torch.save(state, buf)
    fs.pipe("/foreign/t.pt", buf.getvalue())
    assert torch.equal(open_checkpoint("memory://foreign/t.pt", allow_pickle=True).load_tensor("b"), state["b"])
    fs.rm("/foreign", recursive=True)


def test_remote_dcp(tmp_path):
    _dcp_save({"x": torch.arange(4.0)}, tmp_path / "dcp")
    fs = fsspec.filesystem("memory")
    for name in os.listdir(tmp_path / "dcp"):
        fs.pipe(f"/rdcp/{name}", (tmp_path / "dcp" / name).read_bytes())
    with pytest.raises(PickleNotAllowedError):
        open_checkpoint("memory://rdcp")
    assert torch.equal(open_checkpoint("memory://rdcp", allow_pickle=True).load_tensor("x"), torch.arange(4.0))
    fs.rm("/rdcp", recursive=True)


def test_detection_errors(tmp_path):
    with pytest.raises(CheckpointNotFoundError):
        detect_format(str(tmp_path / "missing"))
    (tmp_path / "half").mkdir()
    with pytest.raises(IncompleteCheckpointError, match="empty directory"):
        detect_format(str(tmp_path / "half"))
    (tmp_path / "half" / "model.safetensors").write_bytes(safetensors.torch.save(_state()))
    assert detect_format(str(tmp_path / "half")) == "accelerate"  # save_state of a lone model
    (tmp_path / "half" / "optim.json").write_text("{}")
    with pytest.raises(IncompleteCheckpointError, match="statekit.json"):
        detect_format(str(tmp_path / "half"))
    (tmp_path / "junk.txt").write_text("hello world, not a checkpoint")
    with pytest.raises(StatekitError, match="not a safetensors or torch file"):
        detect_format(str(tmp_path / "junk.txt"))


def test_a_save_that_failed_mid_file_is_not_read_as_an_accelerate_checkpoint(tmp_path, monkeypatch):
    """statekit.save(url, {"model": m}) writes model.safetensors, Accelerate's name; a
    write failing in the middle leaves it preallocated to full size, with a hole of zeros,
    and no manifest. A load of that directory must say it is an incomplete statekit save,
    not load the zeros as an Accelerate checkpoint (statekit's files carry a writer mark in
    their header); a model.safetensors another tool wrote still reads as Accelerate's."""
    import errno

    from statekit.storage import direct_write

    real_pwrite = os.pwrite

    def disk_full_in_the_middle(fd, data, offset):
        if offset == direct_write.DIRECT_BUFFER_BYTES:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)

    model = torch.nn.Linear(1024, 4096)  # 16 MiB: several buffers
    url = str(tmp_path / "c")
    monkeypatch.setattr(direct_write.os, "pwrite", disk_full_in_the_middle)
    with pytest.raises(statekit.StorageError, match="No space left"):
        statekit.save(url, {"model": model})
    monkeypatch.setattr(direct_write.os, "pwrite", real_pwrite)
    assert "model.safetensors" in os.listdir(url)
    with pytest.raises(IncompleteCheckpointError, match="statekit's save lock .* an incomplete statekit save"):
        detect_format(url)  # the failed save left its lock, marked failed
    os.remove(os.path.join(url, ".statekit-lock"))  # without it (a save of an older statekit): the header's mark says so
    with pytest.raises(IncompleteCheckpointError, match="model.safetensors written by statekit"):
        detect_format(url)
    fresh = torch.nn.Linear(1024, 4096)
    before = fresh.weight.detach().clone()
    with pytest.raises(IncompleteCheckpointError, match="never committed"):
        statekit.load(url, {"model": fresh})
    assert torch.equal(fresh.weight, before)  # untouched
    other = tmp_path / "acc"
    other.mkdir()
    safetensors.torch.save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(other / "model.safetensors"))
    assert detect_format(str(other)) == "accelerate"
    statekit.load(str(other), {"model": fresh})
    assert torch.equal(fresh.weight, model.weight)


def test_diff_reports_added_removed_changed_and_values(tmp_path):
    a = {"same": torch.ones(3), "moved": torch.zeros(2, 2), "gone": torch.ones(1), "reshaped": torch.ones(4), "cast": torch.ones(2)}
    b = {"same": torch.ones(3), "moved": torch.tensor([[0.0, 0.25], [-1.5, 0.0]]), "new": torch.ones(1),
         "reshaped": torch.ones(2, 2), "cast": torch.ones(2, dtype=torch.float64)}
    safetensors.torch.save_file(a, str(tmp_path / "a.safetensors"))
    safetensors.torch.save_file(b, str(tmp_path / "b.safetensors"))
    report = diff(open_checkpoint(str(tmp_path / "a.safetensors")), open_checkpoint(str(tmp_path / "b.safetensors")))
    assert report["added"] == ["new"] and report["removed"] == ["gone"]
    assert {c["key"] for c in report["changed"]} == {"reshaped", "cast"}
    values = {t["key"]: (t["max_abs_diff"], t["equal"]) for t in report["tensors"]}
    assert values == {"same": (0.0, True), "moved": (1.5, False), "cast": (0.0, False)}
    assert report["size_delta_bytes"] == (tmp_path / "b.safetensors").stat().st_size - (tmp_path / "a.safetensors").stat().st_size
    assert report["identical"] is False
    same = diff(open_checkpoint(str(tmp_path / "a.safetensors")), open_checkpoint(str(tmp_path / "a.safetensors")))
    assert same["identical"] is True and not same["added"] and not same["files"]


def test_safetensors_header_length_starting_with_pickle_magic(tmp_path):
    """A header of 640 bytes starts with 0x80 0x02, pickle protocol 2's marker: still safetensors."""
    for pad in range(500, 700):
        data = safetensors.torch.save({"w" * pad: torch.ones(2)})
        if data[:2] == b"\x80\x02":
            break
    else:  # pragma: no cover
        pytest.skip("no header of length 0x80 found")
    (tmp_path / "x.safetensors").write_bytes(data)
    (tmp_path / "x.bin").write_bytes(data)
    assert detect_format(str(tmp_path / "x.safetensors")) == "safetensors"
    assert detect_format(str(tmp_path / "x.bin")) == "safetensors"


def test_diff_across_formats_matches_tensor_names(tmp_path):
    model = torch.nn.Linear(8, 4)
    safetensors.torch.save_file(model.state_dict(), str(tmp_path / "m.safetensors"))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["bias"][1] += 2.0
    torch.save(state, tmp_path / "m.pt")
    report = diff(open_checkpoint(str(tmp_path / "m.safetensors")), open_checkpoint(str(tmp_path / "m.pt"), allow_pickle=True))
    assert report["a"]["format"] == "safetensors" and report["b"]["format"] == "torch"
    expected = (state["bias"].double() - model.bias.detach().double()).abs().max().item()
    assert {t["key"]: t["max_abs_diff"] for t in report["tensors"]} == {"weight": 0.0, "bias": expected}
    assert report["files"] == [] and not report["identical"]


def test_diff_nan_inf_and_byte_views(tmp_path):
    nan, inf = float("nan"), float("inf")
    a = {"x": torch.tensor([nan, inf, 1.0]), "y": torch.tensor([1.0, 2.0]), "c": torch.tensor([1 + 2j], dtype=torch.complex128)}
    b = {"x": torch.tensor([nan, inf, 1.0]), "y": torch.tensor([nan, 2.0]), "c": torch.tensor([1 + 1j], dtype=torch.complex128)}
    statekit.save(str(tmp_path / "a"), {"s": a})
    statekit.save(str(tmp_path / "b"), {"s": b})
    ra, rb = open_checkpoint(str(tmp_path / "a")), open_checkpoint(str(tmp_path / "b"))
    ckey = next(k for k in ra.tensors() if k.endswith(":c"))
    assert ra.tensors()[ckey].dtype == "complex128" and ra.tensors()[ckey].shape == (1,)  # stored as a U8 byte view
    assert torch.equal(ra.load_tensor(ckey), a["c"])
    values = {t["key"].rsplit(":", 1)[1]: (t["max_abs_diff"], t["equal"]) for t in diff(ra, rb)["tensors"]}
    assert values["x"] == (0.0, True) and values["c"] == (1.0, False)
    assert math.isnan(values["y"][0]) and values["y"][1] is False


def test_dcp_tensor_assembled_from_chunks(tmp_path):
    """A sharded tensor (two row chunks in two .distcp files, as two ranks write it) reads whole."""
    import io
    import pickle

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    full = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    root = tmp_path / "sharded"
    root.mkdir()
    chunks, storage_data = [], {}
    for rank, rows in enumerate((slice(0, 2), slice(2, 6))):
        buf = io.BytesIO()
        torch.save(full[rows].clone(), buf)
        (root / f"__{rank}_0.distcp").write_bytes(b"pad" + buf.getvalue())
        offsets = torch.Size([rows.start, 0])
        chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=torch.Size([rows.stop - rows.start, 4])))
        storage_data[MetadataIndex("w", offsets, rank)] = _StorageInfo(f"__{rank}_0.distcp", 3, len(buf.getvalue()))
    meta = Metadata(
        state_dict_metadata={"w": TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([6, 4]), chunks)},
        storage_data=storage_data,
    )
    (root / ".metadata").write_bytes(pickle.dumps(meta))
    reader = open_checkpoint(str(root), allow_pickle=True)
    assert reader.tensors()["w"].file == "__0_0.distcp,__1_0.distcp" and reader.tensors()["w"].size_bytes == 96
    assert torch.equal(reader.load_tensor("w"), full)


def test_diff_of_int64_values_beyond_float64_precision(tmp_path):
    """2**60 and 2**60 + 1 are equal in float64: the diff must not call them identical."""
    safetensors.torch.save_file({"seed": torch.tensor([2**60])}, str(tmp_path / "a.safetensors"))
    safetensors.torch.save_file({"seed": torch.tensor([2**60 + 1])}, str(tmp_path / "b.safetensors"))
    report = diff(open_checkpoint(str(tmp_path / "a.safetensors")), open_checkpoint(str(tmp_path / "b.safetensors")))
    assert report["tensors"] == [{"key": "seed", "dtype": "int64", "shape": [1], "max_abs_diff": 1.0, "equal": False}]
    assert not report["identical"]


def test_diff_pairs_an_accelerate_directory_with_statekit_save_state_of_the_same_run(tmp_path):
    """Accelerate names model.safetensors / optimizer.bin what statekit names model_0 / optimizer_0."""
    from accelerate_helpers import build, train_steps

    run = build(seed=0)
    train_steps(run, 3)
    accelerator, model, optimizer = run[0], run[1], run[2]
    accelerator.save_state(str(tmp_path / "acc"))
    statekit.save_state(accelerator, str(tmp_path / "sk"))
    report = diff(open_checkpoint(str(tmp_path / "acc"), allow_pickle=True), open_checkpoint(str(tmp_path / "sk")))
    pairs = {t["key"]: t.get("b_key") for t in report["tensors"]}
    model_keys = {f"model.safetensors:{k}" for k in model.state_dict()}
    assert model_keys <= set(pairs) and pairs["model.safetensors:fc1.weight"] == "model_0.safetensors:fc1.weight"
    assert pairs["optimizer.bin:state.0.exp_avg"] == "optimizer_0.safetensors:state.0.exp_avg"
    assert all(t["equal"] for t in report["tensors"]), [t for t in report["tensors"] if not t["equal"]]
    assert not model_keys & set(report["removed"]) and not report["changed"]


@pytest.mark.parametrize("kind", ["cuda", "xpu"])
@pytest.mark.parametrize("saved_devices, visible, restored, warned", [(2, 1, 1, ":1-1 not restored"), (1, 2, 1, "the others keep their state"), (2, 2, 2, None)])
def test_accelerate_device_random_states_of_another_device_count(monkeypatch, kind, saved_devices, visible, restored, warned):
    """Accelerate saves the generators of every device its process sees (CUDA, XPU, HPU...);
    a resume that sees another number restores the common ones and says so (torch's
    set_rng_state_all raises for more states than devices); XPU states were ignored."""
    import random
    import warnings

    import statekit
    from statekit import devices
    from statekit.foreign import accelerate as accelerate_rng

    calls = []
    module = getattr(torch, kind)
    monkeypatch.setattr(devices, "current_accelerator_type", lambda: kind)
    monkeypatch.setattr(module, "device_count", lambda: visible)
    monkeypatch.setattr(module, "set_rng_state_all", lambda states: calls.append(list(states)))
    device_states = [torch.full((16,), i, dtype=torch.uint8) for i in range(saved_devices)]
    states = {"random_state": random.getstate(), "torch_manual_seed": torch.get_rng_state(), f"torch_{kind}_manual_seed": device_states}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accelerate_rng.restore_rng(states, "ckpt-dir")
    assert len(calls) == 1 and [int(s[0]) for s in calls[0]] == list(range(restored))
    messages = [str(w.message) for w in caught if issubclass(w.category, statekit.StatekitWarning)]
    if warned is None:
        assert messages == []
    else:
        assert len(messages) == 1 and messages[0].startswith(f"ckpt-dir: random states of {saved_devices} {kind.upper()} device(s) saved, this process sees {visible}")
        assert warned in messages[0]
