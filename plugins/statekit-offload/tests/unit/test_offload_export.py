"""Accelerate offload-folder compatibility both ways, and ``statekit convert --to offload``."""

from __future__ import annotations

import json
import os

import pytest
import torch
from accelerate import dispatch_model
from accelerate.utils import OffloadedWeightsLoader, load_offloaded_weights
from click.testing import CliRunner
from conftest import ALL_DISK, IDS, SPLIT_MAP, build_net

import statekit
from statekit.cli import main as cli
from statekit_offload import export
from statekit_offload.offload_format import read_index

pytestmark = pytest.mark.filterwarnings("ignore:The following device_map keys do not match any submodules")


def _forward(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS)


@pytest.mark.parametrize("copy", [False, True], ids=["in-place", "copy"])
def test_our_offload_folder_loads_with_accelerate(saved, tmp_path, copy):
    url, net, ref = saved
    model = build_net(meta=True)
    folder = tmp_path / "off"
    statekit.load(url, {"model": model}, device_map=ALL_DISK, offload_folder=folder, offload_copy=copy)
    index = read_index(str(folder))
    loader = OffloadedWeightsLoader(save_folder=str(folder))
    want = net.state_dict()
    assert sorted(loader) == sorted(k for k in want if k != "block.scale")
    assert all(torch.equal(loader[k], want[k]) for k in loader)
    # accelerate.utils.load_offloaded_weights reads .dat entries into a model
    if copy:
        fresh = build_net(meta=True)
        load_offloaded_weights(fresh, index, str(folder))
        assert all(torch.equal(fresh.state_dict()[k], want[k]) for k in index)
    # and dispatch_model accepts the folder unchanged for another meta model
    other = build_net(meta=True)
    other.block.scale.fill_(2.5)  # buffers of offloaded modules are not in the folder (offload_buffers=False)
    dispatch_model(other, device_map=ALL_DISK, offload_dir=str(folder))
    assert torch.equal(_forward(other), ref)


def test_export_folder_is_accepted_by_dispatch_model(saved, tmp_path):
    url, net, ref = saved
    out = tmp_path / "exported"
    assert export(url, str(out)) == {"model": str(out)}
    index = read_index(str(out))
    assert sorted(index) == sorted(net.state_dict())  # every tensor, tied names and buffers included
    assert index["head.weight"] == {"dtype": "float32", "shape": [11, 16]}
    fresh = build_net(meta=True)
    load_offloaded_weights(fresh, index, str(out))
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in net.state_dict().items())
    # a meta model, every module on disk (its buffers too): dispatch_model reads only the folder
    full = build_net(meta=True)
    dispatch_model(full, device_map=ALL_DISK, offload_dir=str(out), offload_buffers=True)
    assert torch.equal(_forward(full), ref)
    # cpu modules come from a state dict, disk modules from the folder
    split = build_net(meta=True)
    cpu_state = {k: v for k, v in net.state_dict().items() if k.startswith(("embed.", "block.norm.", "block.scale"))}
    split.load_state_dict(cpu_state, strict=False, assign=True)
    dispatch_model(split, device_map=SPLIT_MAP, offload_dir=str(out))
    assert torch.equal(_forward(split), ref)


def test_cli_convert_to_offload(saved, tmp_path):
    url, net, ref = saved
    out = tmp_path / "cli-out"
    result = CliRunner().invoke(cli, ["convert", url, str(out), "--to", "offload"])
    assert result.exit_code == 0, result.output
    model = build_net(meta=True)
    dispatch_model(model, device_map=ALL_DISK, offload_dir=str(out), offload_buffers=True)
    assert torch.equal(_forward(model), ref)


def test_export_several_models_and_refuse_existing_index(pm, tmp_path):
    url = str(tmp_path / "two")
    a, b = build_net(), build_net(1)
    statekit.save(url, {"a": a, "b": b, "step": {"n": 3}})
    out = tmp_path / "out"
    folders = export(url, str(out))
    assert folders == {"a": str(out / "a"), "b": str(out / "b")}
    for key, model in (("a", a), ("b", b)):
        loader = OffloadedWeightsLoader(save_folder=folders[key])
        assert all(torch.equal(loader[k], v) for k, v in model.state_dict().items())
    with pytest.raises(statekit.StorageError, match="already holds an offload index"):
        export(url, str(out))


def test_export_verifies_checksums(saved, tmp_path):
    url, _, _ = saved
    path = os.path.join(url, "model.safetensors")
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 1
    open(path, "wb").write(bytes(data))
    with pytest.raises(statekit.CorruptCheckpointError, match="checksum"):
        export(url, str(tmp_path / "out"))


def test_export_needs_a_model(pm, tmp_path):
    url = str(tmp_path / "nomodel")
    statekit.save(url, {"t": torch.ones(2)})
    with pytest.raises(statekit.StatekitError, match="no model"):
        export(url, str(tmp_path / "out"))
    with pytest.raises(statekit.StorageError, match="local filesystem"):
        statekit.save(str(tmp_path / "m"), {"model": build_net()})
        export(str(tmp_path / "m"), "memory://x/out")


def test_index_json_schema_matches_accelerate(saved, tmp_path):
    from accelerate.utils import offload_state_dict

    url, net, _ = saved
    ours = tmp_path / "ours"
    export(url, str(ours))
    theirs = tmp_path / "theirs"
    offload_state_dict(str(theirs), {k: v.clone() for k, v in net.state_dict().items()})
    with open(ours / "index.json") as f1, open(theirs / "index.json") as f2:
        assert json.load(f1) == json.load(f2)
    for name in os.listdir(theirs):
        assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name


def test_an_offloaded_model_exports_as_a_from_pretrained_folder(tmp_path):
    """``statekit.export_pretrained`` of a model this plugin saved from disk offload: the
    core's tensor files (``<key>.safetensors``), every tensor equal to the model's."""
    from accelerate import disk_offload
    from safetensors.torch import load_file

    net = build_net()
    want = {k: v.clone() for k, v in net.state_dict().items()}
    disk_offload(net, str(tmp_path / "offload"))
    statekit.save(str(tmp_path / "ckpt"), {"model": net})
    assert statekit.verify(str(tmp_path / "ckpt")).objects["model"].owner == "offload"
    result = statekit.export_pretrained(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    assert result.files == ("model.safetensors",)
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    stored = {k for k in want if k not in result.dropped_ties}
    assert set(exported) == stored
    assert all(torch.equal(exported[k], want[k]) for k in stored)
