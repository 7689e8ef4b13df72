"""Incremental saves of an offloaded model (issue 29): the offloaded weights, already on
disk, are written once per run; every checkpoint still resumes exactly.

The model is dispatched by Accelerate across the CPU and disk (``SPLIT_MAP``: Accelerate
writes the disk-mapped weights to ``.dat`` files) and saved by a
``statekit.CheckpointManager`` (incremental by default) as a training script would.
"""

from __future__ import annotations

import os

import pytest
import torch
from accelerate import dispatch_model
from accelerate.utils.offload import offload_weight
from conftest import IDS, SPLIT_MAP, build_net

import statekit

pytestmark = pytest.mark.filterwarnings("ignore:The following device_map keys do not match any submodules")

OFFLOADED = "model.offloaded-00000.safetensors"
IN_MEMORY = "model.safetensors"


def _inode(root: str, step: int, rel: str) -> int:
    return os.stat(os.path.join(root, f"checkpoint-{step:08d}", rel)).st_ino


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def run(pm, tmp_path, request):
    """Three saves of a CPU/disk-dispatched model (``async_save`` off and on): a CPU
    weight changes before the second; an offloaded weight is rewritten in its offload
    file before the third. Returns ``(root, [manifest per save], [expected state per
    save], net)``."""
    net = build_net()
    state = {k: v.clone() for k, v in net.state_dict().items()}
    offload_dir = str(tmp_path / "acc")
    dispatch_model(net, device_map=SPLIT_MAP, offload_dir=offload_dir)  # Accelerate writes the .dat files
    root = str(tmp_path / "run")
    manager = statekit.CheckpointManager({"model": net}, root, async_save=request.param)

    def save(step: int) -> statekit.Manifest:
        manifest = manager.save(step)
        return manager.wait() if request.param else manifest

    manifests, expected = [save(1)], [dict(state)]

    with torch.no_grad():  # a training step on the CPU part
        net.block.norm.weight.add_(0.25)
    state["block.norm.weight"] = state["block.norm.weight"] + 0.25
    manifests.append(save(2))
    expected.append(dict(state))

    # an offloaded weight changed where it lives: its .dat file, rewritten in place
    state["out.weight"] = state["out.weight"] * -1.0
    offload_weight(state["out.weight"], "out.weight", offload_dir)
    manifests.append(save(3))
    expected.append(dict(state))
    return root, manifests, expected, net


def test_unchanged_offloaded_weights_are_reused_not_written(run):
    root, (first, second, _), _, _ = run
    assert set(first.files) >= {IN_MEMORY, OFFLOADED}
    assert first.files[OFFLOADED].reused_from is None  # the run's first save writes everything
    assert second.files[OFFLOADED].reused_from == "checkpoint-00000001"
    assert second.files[OFFLOADED].checksum == first.files[OFFLOADED].checksum
    assert _inode(root, 2, OFFLOADED) == _inode(root, 1, OFFLOADED)  # a hard link, no bytes written
    assert os.stat(os.path.join(root, "checkpoint-00000002", OFFLOADED)).st_nlink > 1
    assert second.files[IN_MEMORY].reused_from is None  # the CPU weight changed
    assert _inode(root, 2, IN_MEMORY) != _inode(root, 1, IN_MEMORY)
    assert second.reused_bytes == second.files[OFFLOADED].size_bytes
    assert second.records["offload"]["models"]["model"]["reused"] == [OFFLOADED]


def test_the_offloaded_and_in_memory_tensors_are_in_separate_files(run):
    root, _, _, _ = run
    from safetensors import safe_open

    path = os.path.join(root, "checkpoint-00000001")
    with safe_open(os.path.join(path, OFFLOADED), framework="pt") as f:
        assert sorted(f.keys()) == ["block.lin.bias", "block.lin.weight", "out.bias", "out.weight"]
    with safe_open(os.path.join(path, IN_MEMORY), framework="pt") as f:
        # head.weight is tied to the CPU embed.weight: stored once, with it
        assert "embed.weight" in f.keys() and "block.norm.weight" in f.keys() and "out.weight" not in f.keys()


def test_an_offloaded_weight_edited_in_place_is_written_again(run):
    root, (_, second, third), _, _ = run
    assert third.files[OFFLOADED].reused_from is None
    assert third.files[OFFLOADED].checksum != second.files[OFFLOADED].checksum
    assert _inode(root, 3, OFFLOADED) != _inode(root, 2, OFFLOADED)
    assert third.files[IN_MEMORY].reused_from == "checkpoint-00000002"  # nothing in memory changed
    assert _inode(root, 3, IN_MEMORY) == _inode(root, 2, IN_MEMORY)


@pytest.mark.parametrize("step", [1, 2, 3])
def test_each_checkpoint_loads_exactly(run, step):
    root, _, expected, _ = run
    fresh = build_net(seed=3)
    statekit.load(os.path.join(root, f"checkpoint-{step:08d}"), {"model": fresh})
    got = fresh.state_dict()
    assert sorted(got) == sorted(expected[step - 1])
    different = [k for k, v in expected[step - 1].items() if not torch.equal(got[k], v)]
    assert not different, different


def test_manager_resume_fills_a_fresh_model_exactly(run):
    root, _, expected, _ = run
    fresh = build_net(meta=True)  # built under init_empty_weights(), as for a large model
    assert statekit.CheckpointManager({"model": fresh}, root).resume() == 3
    got = fresh.state_dict()
    different = [k for k, v in expected[2].items() if not torch.equal(got[k], v)]
    assert not different, different


def test_a_load_that_offloads_again_reads_every_file(run, tmp_path):
    root, _, expected, net = run
    fresh = build_net(meta=True)
    statekit.load(
        os.path.join(root, "checkpoint-00000003"), {"model": fresh}, device_map=SPLIT_MAP, offload_folder=str(tmp_path / "again")
    )
    reference = build_net(seed=3)
    reference.load_state_dict(expected[2])
    with torch.no_grad():
        assert torch.equal(fresh(IDS), reference(IDS))
        assert torch.equal(net(IDS), reference(IDS))  # the saved (dispatched) model computes the same


def test_a_core_model_of_an_incremental_save_loads_under_a_device_map(pm, tmp_path):
    """The core writes a model with a frozen base as <key>.safetensors + <key>.frozen-*:
    a load that offloads it reads both."""
    from accelerate import init_empty_weights

    def build() -> torch.nn.Sequential:
        model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 4))  # 1 MiB frozen base + a head
        model[0].requires_grad_(False)
        return model

    torch.manual_seed(0)
    model = build()
    manifest = statekit.CheckpointManager({"model": model}, str(tmp_path / "run")).save(1)
    assert "model.frozen-00000.safetensors" in manifest.files
    with init_empty_weights():
        fresh = build()
    statekit.load(
        str(tmp_path / "run" / "checkpoint-00000001"), {"model": fresh},
        device_map={"0": "disk", "1": "cpu"}, offload_folder=str(tmp_path / "off"),
    )  # fmt: skip
    x = torch.randn(3, 512)
    with torch.no_grad():
        assert torch.equal(fresh(x), model(x))
