"""Device maps that put part of a model on a CUDA device, the rest on cpu and disk
(only where torch sees a GPU; CI has none)."""

from __future__ import annotations

import pytest
import torch
from accelerate import dispatch_model
from conftest import IDS, build_net

import statekit
from statekit_offload import is_offloaded

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.filterwarnings("ignore:The following device_map keys do not match any submodules"),
]

GPU_MAP = {"embed": 0, "block.lin": 0, "block.norm": "cpu", "block.scale": "cpu", "out": "disk", "head": 0}
"""``embed`` and the tied ``head`` on the GPU, ``block`` split across GPU and cpu, ``out`` on disk."""


def test_gpu_cpu_and_disk(saved, tmp_path):
    url, net, _ = saved
    model = build_net(meta=True)
    device_map = {"embed": 0, "block": "cpu", "out": "disk", "head": 0}
    statekit.load(url, {"model": model}, device_map=device_map, offload_folder=tmp_path / "off")
    assert model.embed.weight.device.type == "cuda" and model.head.weight is model.embed.weight
    with torch.no_grad():
        got = model(IDS.cuda())
        want = net.cuda()(IDS.cuda())  # the fully loaded model, same kernels
    assert got.device.type == "cuda" and torch.equal(got, want)


def test_a_module_split_across_gpu_and_cpu_loads_exactly(saved, tmp_path):
    url, net, _ = saved
    model = build_net(meta=True)
    statekit.load(url, {"model": model}, device_map=GPU_MAP, offload_folder=tmp_path / "off")
    assert model.embed.weight.device == torch.device("cuda", 0) and model.block.lin.weight.device.type == "cuda"
    # with a GPU to run on, Accelerate keeps cpu-mapped weights in host memory behind
    # hooks (meta parameters), as it does disk-mapped ones
    assert model.block.norm.weight.device.type == "meta" and model.out.weight.device.type == "meta"
    assert model.head.weight is model.embed.weight  # still tied, on the GPU
    for name in ("embed.weight", "block.lin.weight", "block.lin.bias"):
        assert torch.equal(model.get_parameter(name).cpu(), net.get_parameter(name)), name
    statekit.save(str(tmp_path / "again"), {"model": model})  # every weight, wherever it lives
    plain = build_net(seed=1)
    statekit.load(str(tmp_path / "again"), {"model": plain})
    for k, v in net.state_dict().items():
        assert torch.equal(plain.state_dict()[k], v.cpu()), k
    # no forward here: this map leaves block.scale (a buffer of block itself) on the cpu
    # while block's submodules run on the GPU, which Accelerate's hooks do not reconcile


def test_model_dispatched_to_gpu_cpu_and_disk_saves_and_loads_back_equal(pm, tmp_path):
    net = build_net()
    want = {k: v.clone() for k, v in net.state_dict().items()}
    dispatch_model(net, device_map=GPU_MAP, offload_dir=str(tmp_path / "acc"))
    assert is_offloaded(net) and net.embed.weight.device.type == "cuda"
    statekit.save(str(tmp_path / "ckpt"), {"model": net})
    plain = build_net(seed=1)
    statekit.load(str(tmp_path / "ckpt"), {"model": plain})
    for k, v in want.items():
        assert torch.equal(plain.state_dict()[k], v), k
