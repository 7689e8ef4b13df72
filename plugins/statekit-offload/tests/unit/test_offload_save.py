"""Saving models whose weights Accelerate keeps offloaded, tensor by tensor."""

from __future__ import annotations

import json
import os

import pytest
import torch
from accelerate import cpu_offload, dispatch_model, load_checkpoint_and_dispatch
from accelerate.utils import find_tied_parameters
from conftest import ALL_DISK, IDS, SPLIT_MAP, build_net, raised

import statekit
from statekit import format as fmt
from statekit_offload import is_offloaded

pytestmark = pytest.mark.filterwarnings("ignore:The following device_map keys do not match any submodules")


def _forward(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS)


def _header(path) -> fmt.TensorHeader:
    with open(path, "rb") as f:
        header, _ = fmt.parse_header(f.read(8), f.read, os.path.getsize(path), str(path))
    return header


def _record(url: str, key: str = "model") -> dict:
    with open(os.path.join(url, "statekit.json"), encoding="utf-8") as f:
        return json.load(f)["records"]["offload"]["models"][key]


def test_model_dispatched_by_accelerate_saves_and_loads_back_equal(pm, tmp_path):
    net = build_net()
    ref = _forward(net)
    want = {k: v.clone() for k, v in net.state_dict().items()}
    dispatch_model(net, device_map=SPLIT_MAP, offload_dir=str(tmp_path / "acc"))  # Accelerate writes its .dat files
    assert is_offloaded(net) and net.out.weight.device.type == "meta"
    url = str(tmp_path / "ckpt")
    manifest = statekit.save(url, {"model": net})
    assert manifest.objects["model"].owner == "offload"
    record = _record(url)
    assert record["file"] == "model.safetensors"
    assert record["from_files"] == 4  # block.lin.weight/bias, out.weight/bias: copied from Accelerate's .dat files
    # head.weight is tied to the cpu embed.weight (dispatch_model re-ties it): stored once
    assert _header(os.path.join(url, "model.safetensors")).aliases == {"head.weight": "embed.weight"}
    assert torch.equal(_forward(net), ref)  # the dispatched model still works

    fresh = build_net(seed=3)
    statekit.load(url, {"model": fresh})
    got = fresh.state_dict()
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert torch.equal(_forward(fresh), ref)
    statekit.verify(url)


def test_saved_file_is_the_core_layout(pm, tmp_path):
    net = build_net()
    core_url = str(tmp_path / "core")
    statekit.save(core_url, {"model": net})
    dispatch_model(net, device_map=ALL_DISK, offload_dir=str(tmp_path / "acc"))
    url = str(tmp_path / "offloaded")
    # Accelerate's dispatch lost the tie of the meta parameters: say it, as one would for Accelerate
    statekit.save(url, {"model": net}, tied_parameters=[["embed.weight", "head.weight"]])
    a = open(os.path.join(core_url, "model.safetensors"), "rb").read()
    b = open(os.path.join(url, "model.safetensors"), "rb").read()
    assert a == b  # same header (aliases included) and bytes as the core writes


def test_tied_weights_stay_tied_through_offloaded_load_and_save(saved, tmp_path):
    url, net, ref = saved
    model = build_net(meta=True)
    statekit.load(url, {"model": model}, device_map=ALL_DISK, offload_folder=tmp_path / "off")
    url2 = str(tmp_path / "resaved")
    statekit.save(url2, {"model": model})
    header = _header(os.path.join(url2, "model.safetensors"))
    assert header.aliases == {"head.weight": "embed.weight"}
    assert _record(url2)["tied"] == [["embed.weight", "head.weight"]]
    fresh = build_net(meta=True)
    statekit.load(url2, {"model": fresh})
    assert find_tied_parameters(fresh) == find_tied_parameters(net)
    assert torch.equal(_forward(fresh), ref)


def test_cpu_offload_weights_map_in_memory(pm, tmp_path):
    net = build_net()
    ref = _forward(net)
    cpu_offload(net, execution_device="cpu")
    assert is_offloaded(net)
    url = str(tmp_path / "ckpt")
    statekit.save(url, {"model": net})
    assert _record(url)["from_files"] == 0  # fetched through the weights map
    fresh = build_net(seed=4)
    statekit.load(url, {"model": fresh})
    assert torch.equal(_forward(fresh), ref)


def test_load_checkpoint_and_dispatch_model_saves(pm, tmp_path):
    from safetensors.torch import save_file

    net = build_net()
    ref = _forward(net)
    state = {k: v.clone() for k, v in net.state_dict().items()}
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model = build_net(meta=True)
    model.head.weight = model.embed.weight  # tie_weights(), as transformers does after init_empty_weights
    device_map = {**SPLIT_MAP, "embed": "disk"}  # Accelerate wants tied weights on one device
    load_checkpoint_and_dispatch(model, str(tmp_path / "model.safetensors"), device_map=device_map,
                                 offload_folder=str(tmp_path / "acc"))
    assert torch.equal(_forward(model), ref)
    url = str(tmp_path / "ckpt")
    statekit.save(url, {"model": model})
    fresh = build_net(seed=5)
    statekit.load(url, {"model": fresh})
    assert torch.equal(_forward(fresh), ref)


def test_unreachable_offloaded_tensor_is_an_error(pm, tmp_path):
    net = build_net()
    dispatch_model(net, device_map=ALL_DISK, offload_dir=str(tmp_path / "acc"))
    os.remove(tmp_path / "acc" / "out.bias.dat")
    with pytest.raises(statekit.StatekitError) as excinfo:
        statekit.save(str(tmp_path / "ckpt"), {"model": net})
    assert "out.bias.dat" in str(raised(excinfo.value, statekit.StorageError))
    assert not os.path.exists(tmp_path / "ckpt" / "statekit.json")


def test_models_without_offload_hooks_are_left_to_the_core(pm, tmp_path):
    net = build_net()
    manifest = statekit.save(str(tmp_path / "ckpt"), {"model": net})
    assert manifest.objects["model"].owner == "statekit"
    assert "offload" not in manifest.records


def test_tie_group_stored_under_the_first_name_in_state_order(pm, tmp_path):
    class ZA(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.z = torch.nn.Linear(4, 4, bias=False)
            self.a = torch.nn.Linear(4, 4, bias=False)
            self.a.weight = self.z.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(self.z(x))

    torch.manual_seed(0)
    model = ZA()
    x = torch.randn(2, 4)
    ref = model(x).detach()
    groups = find_tied_parameters(model)
    dispatch_model(model, device_map={"z": "disk", "a": "disk"}, offload_dir=str(tmp_path / "acc"))
    url = str(tmp_path / "ckpt")
    statekit.save(url, {"model": model}, tied_parameters=groups)
    assert _header(os.path.join(url, "model.safetensors")).aliases == {"a.weight": "z.weight"}
    fresh = ZA()
    statekit.load(url, {"model": fresh})
    assert fresh.a.weight is fresh.z.weight and torch.equal(fresh(x), ref)
