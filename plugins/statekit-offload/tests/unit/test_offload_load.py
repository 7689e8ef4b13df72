"""Loading a statekit checkpoint under a device map: in place, copied, auto, errors."""

from __future__ import annotations

import json
import os
import uuid

import pytest
import torch
from accelerate.utils import find_tied_parameters
from conftest import ALL_DISK, IDS, SPLIT_MAP, build_net, raised

import statekit
from statekit_offload import offload_info
from statekit_offload.offload_format import INDEX_NAME

pytestmark = pytest.mark.filterwarnings("ignore:The following device_map keys do not match any submodules")


def _index(folder) -> dict:
    with open(os.path.join(folder, INDEX_NAME), encoding="utf-8") as f:
        return json.load(f)


def _forward(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS)


def test_split_module_in_place_matches_full_model(saved, tmp_path):
    url, net, ref = saved
    model = build_net(meta=True)
    statekit.load(url, {"model": model}, device_map=SPLIT_MAP, offload_folder=tmp_path / "off")
    assert torch.equal(_forward(model), ref)
    info = offload_info(model)
    assert sorted(info.in_place) == ["block.lin.bias", "block.lin.weight", "head.weight", "out.bias", "out.weight"]
    assert info.copied == []
    index = _index(tmp_path / "off")
    file = os.path.abspath(os.path.join(url, "model.safetensors"))
    assert index["block.lin.weight"] == {"safetensors_file": file, "weight_name": "block.lin.weight", "dtype": "float32"}
    # The tied head is stored once (as embed.weight) and read from there.
    assert index["head.weight"]["weight_name"] == "embed.weight"
    assert not [n for n in os.listdir(tmp_path / "off") if n.endswith(".dat")]
    # cpu-mapped weights are real tensors; the module split across cpu and disk has both
    assert model.block.norm.weight.device.type == "cpu" and torch.equal(model.block.norm.weight, net.block.norm.weight)
    assert model.block.lin.weight.device.type == "meta"
    assert torch.equal(model.block.scale, torch.tensor(2.5))
    assert model.hf_device_map == SPLIT_MAP
    assert torch.equal(_forward(model), ref)  # again: the hooks put the weights back on disk


def test_copy_option_writes_dat_files(saved, tmp_path):
    url, _, ref = saved
    model = build_net(meta=True)
    statekit.load(url, {"model": model}, device_map=ALL_DISK, offload_folder=tmp_path / "off", offload_copy=True)
    assert torch.equal(_forward(model), ref)
    info = offload_info(model)
    assert info.in_place == [] and info.marker is None
    index = _index(tmp_path / "off")
    assert index["out.weight"] == {"dtype": "float32", "shape": [16, 16]}
    assert "block.scale" not in index  # buffers stay in memory by default
    assert os.path.getsize(tmp_path / "off" / "out.weight.dat") == 16 * 16 * 4
    # tied names each get a file, as accelerate.utils.offload_state_dict writes them
    assert (tmp_path / "off" / "head.weight.dat").read_bytes() == (tmp_path / "off" / "embed.weight.dat").read_bytes()
    assert not [n for n in os.listdir(url) if n.startswith(".in-use-")]


def test_offload_buffers_puts_buffers_on_disk(saved, tmp_path):
    url, _, ref = saved
    model = build_net(meta=True)
    statekit.load(url, {"model": model}, device_map=ALL_DISK, offload_folder=tmp_path / "off", offload_buffers=True)
    assert "block.scale" in _index(tmp_path / "off")
    assert model.block.scale.device.type == "meta"
    assert torch.equal(_forward(model), ref)


def test_memory_checkpoint_is_copied(pm, tmp_path):
    net = build_net()
    url = f"memory://statekit-offload-tests/{uuid.uuid4().hex}/ckpt"
    statekit.save(url, {"model": net})
    model = build_net(meta=True)
    statekit.load(url, {"model": model}, device_map=SPLIT_MAP, offload_folder=tmp_path / "off")
    assert torch.equal(_forward(model), _forward(net))
    assert offload_info(model).in_place == [] and len(offload_info(model).copied) == 5
    with pytest.raises(statekit.StatekitError) as excinfo:
        statekit.load(url, {"model": build_net(meta=True)}, device_map=SPLIT_MAP, offload_folder=tmp_path / "o2",
                      offload_copy=False)
    assert "offload_copy=False" in str(raised(excinfo.value, statekit.StorageError))


def test_offload_folder_with_copies_of_a_live_model_is_refused(pm, tmp_path):
    """Two checkpoints copied into one offload_folder: the second load would rewrite the
    .dat files the first model reads at every forward (its output would silently change)."""
    import gc

    first, second = build_net(), build_net()
    with torch.no_grad():
        for p in second.parameters():
            p.add_(1.0)
    base = f"memory://statekit-offload-tests/{uuid.uuid4().hex}"
    statekit.save(f"{base}/a", {"model": first})
    statekit.save(f"{base}/b", {"model": second})
    model_a = build_net(meta=True)
    statekit.load(f"{base}/a", {"model": model_a}, device_map=ALL_DISK, offload_folder=tmp_path / "off")
    with pytest.raises(statekit.StatekitError, match="another model"):
        statekit.load(f"{base}/b", {"model": build_net(meta=True)}, device_map=ALL_DISK, offload_folder=tmp_path / "off")
    assert torch.equal(_forward(model_a), _forward(first))
    del model_a
    gc.collect()
    model_b = build_net(meta=True)  # the folder is free once the model that used it is gone
    statekit.load(f"{base}/b", {"model": model_b}, device_map=ALL_DISK, offload_folder=tmp_path / "off")
    assert torch.equal(_forward(model_b), _forward(second))


def test_auto_device_map_from_max_memory(saved, tmp_path):
    url, _, ref = saved
    model = build_net(meta=True)
    statekit.load(url, {"model": model}, device_map="auto", max_memory={"cpu": 2000}, offload_folder=tmp_path / "off")
    assert "disk" in model.hf_device_map.values() and "cpu" in model.hf_device_map.values()
    assert torch.equal(_forward(model), ref)
    # max_memory alone means device_map="auto"
    other = build_net(meta=True)
    statekit.load(url, {"model": other}, max_memory={"cpu": 2000}, offload_folder=tmp_path / "off2")
    assert other.hf_device_map == model.hf_device_map


def test_tied_weights_stay_tied_on_cpu(saved, tmp_path):
    url, net, ref = saved
    model = build_net(meta=True)
    statekit.load(url, {"model": model}, device_map={"embed": "cpu", "block": "disk", "out": "disk", "head": "cpu"},
                  offload_folder=tmp_path / "off")
    assert find_tied_parameters(model) == find_tied_parameters(net) == [["embed.weight", "head.weight"]]
    assert model.head.weight is model.embed.weight
    assert torch.equal(_forward(model), ref)


def test_tied_weights_on_disk_share_one_stored_tensor(saved, tmp_path):
    url, _, ref = saved
    model = build_net(meta=True)
    statekit.load(url, {"model": model}, device_map=ALL_DISK, offload_folder=tmp_path / "off")
    index = _index(tmp_path / "off")
    assert index["embed.weight"]["weight_name"] == index["head.weight"]["weight_name"] == "embed.weight"
    assert offload_info(model).tied_parameters == [["embed.weight", "head.weight"]]
    assert torch.equal(_forward(model), ref)


def test_meta_model_without_device_map_is_filled_on_cpu(saved):
    url, net, ref = saved
    model = build_net(meta=True)
    statekit.load(url, {"model": model})
    assert not hasattr(model, "hf_device_map") and not hasattr(model, "_hf_hook")
    assert all(t.device.type == "cpu" for t in model.state_dict().values())
    assert model.head.weight is model.embed.weight
    assert torch.equal(_forward(model), ref)


def test_real_model_without_options_is_left_to_the_core(saved):
    url, _, ref = saved
    model = build_net(seed=1)
    statekit.load(url, {"model": model})
    assert offload_info(model) is None
    assert torch.equal(_forward(model), ref)


def test_missing_offload_folder_names_the_option(saved):
    url, _, _ = saved
    with pytest.raises(statekit.StatekitError) as excinfo:
        statekit.load(url, {"model": build_net(meta=True)}, device_map=ALL_DISK)
    cause = raised(excinfo.value, statekit.StorageError)
    assert "offload_folder" in str(cause) and "model.safetensors" in str(cause)


def test_unwritable_offload_folder_names_option_and_path(saved, tmp_path):
    url, _, _ = saved
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    for folder in (blocker, blocker / "sub"):
        with pytest.raises(statekit.StatekitError) as excinfo:
            statekit.load(url, {"model": build_net(meta=True)}, device_map=ALL_DISK, offload_folder=folder)
        cause = raised(excinfo.value, statekit.StorageError)
        assert f"offload_folder={str(folder)!r}" in str(cause) and cause.url == str(folder)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_offload_folder(saved, tmp_path):
    url, _, _ = saved
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        with pytest.raises(statekit.StatekitError) as excinfo:
            statekit.load(url, {"model": build_net(meta=True)}, device_map=ALL_DISK, offload_folder=folder)
        assert str(folder) in str(raised(excinfo.value, statekit.StorageError))
    finally:
        folder.chmod(0o700)


def test_no_offload_folder_needed_without_disk(saved):
    url, _, ref = saved
    model = build_net(meta=True)
    statekit.load(url, {"model": model}, device_map={"": "cpu"})
    assert offload_info(model).offload_folder is None
    assert torch.equal(_forward(model), ref)


def test_corrupt_offloaded_tensor_is_detected(saved, tmp_path):
    url, _, ref = saved
    path = os.path.join(url, "model.safetensors")
    data = bytearray(open(path, "rb").read())
    data[-5] ^= 0xFF  # inside the last tensor's bytes
    open(path, "wb").write(bytes(data))
    with pytest.raises(statekit.StatekitError) as excinfo:
        statekit.load(url, {"model": build_net(meta=True)}, device_map=ALL_DISK, offload_folder=tmp_path / "off")
    cause = raised(excinfo.value, statekit.CorruptCheckpointError)
    assert "model.safetensors" in str(cause) and "checksum" in str(cause)
    model = build_net(meta=True)  # verify=False skips the check (and the bytes of in-place tensors)
    statekit.load(url, {"model": model}, device_map=ALL_DISK, offload_folder=tmp_path / "off2", verify=False)
    assert not torch.equal(_forward(model), ref)


def test_shape_mismatch_is_listed(saved, tmp_path):
    url, _, _ = saved
    from accelerate import init_empty_weights
    from conftest import Net

    with init_empty_weights():
        wrong = Net(d=8)
    with pytest.raises(statekit.StatekitError) as excinfo:
        statekit.load(url, {"model": wrong}, device_map=ALL_DISK, offload_folder=tmp_path / "off")
    cause = raised(excinfo.value, statekit.StateMismatchError)
    assert "block.lin.weight" in str(cause) and "untouched" in str(cause)


def test_device_map_for_several_models_is_refused(pm, tmp_path):
    url = str(tmp_path / "two")
    statekit.save(url, {"a": build_net(), "b": build_net(1)})
    with pytest.raises(statekit.PluginError, match="apply to one model"):
        statekit.load(url, {"a": build_net(meta=True), "b": build_net(meta=True)}, device_map=ALL_DISK,
                      offload_folder=tmp_path / "off")
    # with one meta model among real ones, the options go to the meta one
    a, b = build_net(meta=True), build_net(5)
    statekit.load(url, {"a": a, "b": b}, device_map=ALL_DISK, offload_folder=tmp_path / "off")
    assert offload_info(a) is not None and offload_info(b) is None
    assert torch.equal(_forward(a), _forward(build_net(0)))
    assert torch.equal(_forward(b), _forward(build_net(1)))


def test_bad_device_map_string(saved, tmp_path):
    url, _, _ = saved
    with pytest.raises(statekit.PluginError, match="device_map='everywhere'"):
        statekit.load(url, {"model": build_net(meta=True)}, device_map="everywhere", offload_folder=tmp_path)

