"""Models saved in the diffusers layout and loaded back in place, on memory://, local disk and S3."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import fsspec
import pytest
import torch
from conftest import assert_same_weights, tiny_cond_unet, tiny_unet, tiny_vae, train_step

import statekit
from statekit import PluginError, StatekitError, StateMismatchError
from statekit.hooks.registry import build_plugin_manager, use_plugin_manager

import statekit_diffusers


def local_copy(url: str, dest) -> str:
    """Download a checkpoint folder to a local directory (for ``from_pretrained``)."""
    fs, path = fsspec.core.url_to_fs(url)
    if fs.protocol in ("file", ("file", "local")):
        return url
    fs.invalidate_cache()
    for remote in fs.find(path):
        rel = remote[len(fs._strip_protocol(path)) :].lstrip("/")
        os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
        fs.get_file(remote, os.path.join(dest, rel))
    return str(dest)


def mismatch_of(excinfo) -> StateMismatchError:
    """The StateMismatchError raised by the plugin (the host may wrap it in a PluginError)."""
    err = excinfo.value
    if isinstance(err, PluginError) and not isinstance(err, StateMismatchError):
        assert err.plugin_name == "diffusers"
        err = err.__cause__
    assert isinstance(err, StateMismatchError), repr(err)
    return err


@pytest.mark.parametrize("make", [tiny_unet, tiny_cond_unet], ids=["UNet2DModel", "UNet2DConditionModel"])
def test_round_trip_is_bit_exact_and_in_place(pm, storage_url, tmp_path, make):
    model = make(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, opt)
    manifest = statekit.save(storage_url, {"unet": model, "optim": opt}, step=7)

    assert manifest.objects["unet"].owner == "diffusers"
    assert manifest.objects["unet"].owner_distribution == "statekit-diffusers"
    assert manifest.records["diffusers"]["unet"] == {
        "kind": "model",
        "folder": "unet",
        "class": type(model).__name__,
        "library": "diffusers",
        "weights": ["unet/diffusion_pytorch_model.safetensors"],
    }
    assert {"unet/config.json", "unet/diffusion_pytorch_model.safetensors"} <= set(manifest.files)
    assert "unet.safetensors" not in manifest.files
    # the state check covers the model the plugin took (the load below would warn on a difference)
    assert set(manifest.state_digest.objects["unet"]) == set(model.state_dict())

    fresh = make(seed=1)
    params_before = [id(p) for p in fresh.parameters()]
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    statekit.load(storage_url, {"unet": fresh, "optim": fresh_opt})
    assert_same_weights(model, fresh)
    assert [id(p) for p in fresh.parameters()] == params_before  # loaded into the same tensors
    assert fresh_opt.param_groups[0]["params"][0] is next(fresh.parameters())
    for a, b in zip(opt.state.values(), fresh_opt.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in a)

    # the saved folder is a plain diffusers folder
    loaded = type(model).from_pretrained(local_copy(storage_url, tmp_path / "copy"), subfolder="unet")
    assert_same_weights(model, loaded)
    assert dict(loaded.config)["block_out_channels"] == list(model.config.block_out_channels)


def test_config_json_matches_diffusers_writer(pm, tmp_path):
    model = tiny_unet()
    url = str(tmp_path / "ckpt")
    statekit.save(url, {"unet": model})
    model.save_pretrained(tmp_path / "reference")  # diffusers' own writer, for comparison
    ours = json.loads((tmp_path / "ckpt" / "unet" / "config.json").read_text())
    theirs = json.loads((tmp_path / "reference" / "config.json").read_text())
    assert ours == theirs
    assert ours["_class_name"] == "UNet2DModel" and ours["_diffusers_version"]


def test_load_registers_saved_config(pm, tmp_path):
    model = tiny_unet()
    model.register_to_config(sample_size=16)  # the run changed a config entry
    url = str(tmp_path / "ckpt")
    statekit.save(url, {"unet": model})
    fresh = tiny_unet(seed=3)
    assert fresh.config.sample_size == 8
    statekit.load(url, {"unet": fresh})
    assert fresh.config.sample_size == 16
    assert fresh.config.block_out_channels == (8, 16)  # unchanged entries keep their type


def test_shape_mismatch_is_state_mismatch_and_leaves_model_untouched(pm, tmp_path):
    url = str(tmp_path / "ckpt")
    statekit.save(url, {"unet": tiny_unet()})
    from diffusers import UNet2DModel

    other = UNet2DModel(
        sample_size=8, in_channels=1, out_channels=1, layers_per_block=1, block_out_channels=(8, 24),
        down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"), norm_num_groups=4,
    )
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(StatekitError) as excinfo:
        statekit.load(url, {"unet": other})
    err = mismatch_of(excinfo)
    assert err.mismatched and any("down_blocks.1" in k for k in err.mismatched)
    assert "nothing was loaded" in str(err)
    for k, v in other.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_key_mismatch_lists_keys(pm, tmp_path):
    url = str(tmp_path / "ckpt")
    statekit.save(url, {"unet": tiny_unet()})
    cond = tiny_cond_unet()
    with pytest.raises(StatekitError) as excinfo:
        statekit.load(url, {"unet": cond})
    err = mismatch_of(excinfo)
    assert err.missing and err.unexpected


def test_sharded_save_writes_index_and_loads(pm, tmp_path):
    model = tiny_unet()
    url = str(tmp_path / "ckpt")
    manifest = statekit.save(url, {"unet": model}, max_shard_size="40KB")
    folder = tmp_path / "ckpt" / "unet"
    shards = sorted(p.name for p in folder.glob("diffusion_pytorch_model-*.safetensors"))
    assert len(shards) >= 3 and shards[0] == f"diffusion_pytorch_model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((folder / "diffusion_pytorch_model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(model.state_dict())
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in model.state_dict().values())
    for shard in shards:
        assert (folder / shard).stat().st_size <= 40_000 + 4_096  # data <= limit, plus the header
    assert manifest.records["diffusers"]["unet"]["weights"] == [f"unet/{s}" for s in shards]

    fresh = tiny_unet(seed=5)
    statekit.load(url, {"unet": fresh})
    assert_same_weights(model, fresh)
    from diffusers import UNet2DModel

    assert_same_weights(model, UNet2DModel.from_pretrained(str(tmp_path / "ckpt"), subfolder="unet"))


def test_folder_names_from_class_and_deduplicated(pm, tmp_path):
    state = {"a": tiny_unet(), "b": tiny_unet(seed=1), "c": tiny_vae(), "d": tiny_cond_unet()}
    manifest = statekit.save(str(tmp_path / "ckpt"), state)
    folders = {k: r["folder"] for k, r in manifest.records["diffusers"].items()}
    assert folders == {"a": "unet", "b": "unet_1", "c": "vae", "d": "unet_2"}
    loaded = {"a": tiny_unet(seed=9), "b": tiny_unet(seed=9), "c": tiny_vae(seed=9), "d": tiny_cond_unet(seed=9)}
    statekit.load(str(tmp_path / "ckpt"), loaded)
    for k in state:
        assert_same_weights(state[k], loaded[k])


def test_folder_names_given_in_code(pm, tmp_path):
    first, second = tiny_unet(), tiny_unet(seed=1)
    manifest = statekit.save(str(tmp_path / "a"), {"m0": first, "m1": second}, diffusers_names={"m1": "unet", second: "x"})
    assert {k: r["folder"] for k, r in manifest.records["diffusers"].items()} == {"m0": "unet_1", "m1": "unet"}

    statekit_diffusers.configure(names={first: "student", "m1": "teacher"})
    manifest = statekit.save(str(tmp_path / "b"), {"m0": first, "m1": second})
    assert {k: r["folder"] for k, r in manifest.records["diffusers"].items()} == {"m0": "student", "m1": "teacher"}

    with pytest.raises(PluginError, match="used twice"):
        statekit.save(str(tmp_path / "c"), {"m0": first, "m1": second}, diffusers_names={"m0": "unet", "m1": "unet"})
    with pytest.raises(StatekitError, match="file-name-safe"):
        statekit_diffusers.configure(names={"m0": "../evil"})


def test_wrapped_model_is_unwrapped(pm, tmp_path):
    model = tiny_unet()
    compiled = torch.compile(model)  # an OptimizedModule wrapper; nothing is compiled until called
    url = str(tmp_path / "ckpt")
    manifest = statekit.save(url, {"unet": compiled})
    assert manifest.objects["unet"].owner == "diffusers"
    fresh = tiny_unet(seed=2)
    statekit.load(url, {"unet": torch.compile(fresh)})
    assert_same_weights(model, fresh)


def test_plain_modules_stay_on_the_core_path(pm, tmp_path):
    manifest = statekit.save(str(tmp_path / "ckpt"), {"unet": tiny_unet(), "head": torch.nn.Linear(3, 2)})
    assert manifest.objects["head"].owner == "statekit"
    assert "head.safetensors" in manifest.files


def test_discovered_from_entry_point(pm):
    source = pm.sources["diffusers"]
    assert source.origin == "entry point"
    assert source.distribution == "statekit-diffusers"
    assert source.entry_point == "statekit_diffusers.plugin"
    assert hasattr(pm.get_plugin("diffusers"), "STATEKIT_CONVERTERS")


def test_blocking_the_plugin_falls_back_to_the_core(monkeypatch, tmp_path):
    monkeypatch.setenv("STATEKIT_DISABLE_PLUGINS", "diffusers")
    pm = build_plugin_manager()
    assert pm.get_plugin("diffusers") is None and pm.is_blocked("diffusers")
    model = tiny_unet()
    url = str(tmp_path / "ckpt")
    with use_plugin_manager(pm):
        manifest = statekit.save(url, {"unet": model})
        assert manifest.objects["unet"].owner == "statekit"
        assert "unet.safetensors" in manifest.files and "unet/config.json" not in manifest.files
        fresh = tiny_unet(seed=4)
        statekit.load(url, {"unet": fresh})
    assert_same_weights(model, fresh)


def test_plugin_import_does_not_import_diffusers():
    code = (
        "import sys, time\n"
        "import statekit\n"
        "t = time.perf_counter()\n"
        "import statekit_diffusers.plugin\n"
        "dt = time.perf_counter() - t\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('diffusers', 'transformers', 'accelerate'))\n"
        "assert not bad, bad\n"
        "print(dt)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert float(out.stdout) < 0.5  # measured: about 0.02 s on top of statekit


@pytest.mark.s3
def test_s3_save_stages_nothing_locally(pm, s3_bucket, tmp_path, monkeypatch):
    empty = tmp_path / "tmpdir"
    empty.mkdir()
    monkeypatch.setenv("TMPDIR", str(empty))
    monkeypatch.setattr(tempfile, "tempdir", str(empty))
    model = tiny_cond_unet()
    url = f"{s3_bucket}/run/checkpoint-1"
    manifest = statekit.save(url, {"unet": model}, max_shard_size="100KB")
    assert os.listdir(empty) == []
    assert "unet/diffusion_pytorch_model.safetensors.index.json" in manifest.files
    assert len(manifest.records["diffusers"]["unet"]["weights"]) >= 2
    fresh = tiny_cond_unet(seed=1)
    statekit.load(url, {"unet": fresh})
    assert_same_weights(model, fresh)
    assert os.listdir(empty) == []


def test_dtensor_model_is_left_to_the_fsdp_plugin(tmp_path, plugin_manager):
    """A diffusers model whose parameters are DTensors stays in ``models`` for the plugin after it."""
    import statekit_diffusers.plugin as diffusers_plugin
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_module, init_device_mesh

    seen: dict[str, list[str]] = {}

    class FakeFsdp:  # runs after statekit-diffusers and takes what is left (as statekit-fsdp would)
        @statekit.hookimpl(trylast=True)
        def statekit_save_state_pre(self, models, weights, output_dir, checkpoint):
            seen["left"] = [checkpoint.key_of(m) for m in models]
            for m in list(models):
                i = next(i for i, x in enumerate(models) if x is m)
                models.pop(i)
                weights.pop(i)
            checkpoint.save_json("fake_fsdp.json", {"taken": seen["left"]})

    plugin_manager.register(diffusers_plugin, name="diffusers")
    plugin_manager.register(FakeFsdp(), name="fsdp")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        sharded = distribute_module(tiny_unet(), init_device_mesh("cpu", (1,)))
        assert type(next(sharded.parameters())).__name__ == "DTensor"
        manifest = statekit.save(str(tmp_path / "ckpt"), {"sharded": sharded, "plain": tiny_unet(seed=1)})
    finally:
        dist.destroy_process_group()
    assert seen["left"] == ["sharded"]
    assert manifest.objects["sharded"].owner == "fsdp"
    assert manifest.objects["plain"].owner == "diffusers"


def test_fsdp2_model_goes_to_statekit_fsdp_and_folder_names_avoid_its_key(pm, tmp_path):
    """With the real statekit-fsdp plugin: a fully_shard UNet is saved by it under its stable
    key ("unet/"), the plain UNet by statekit-diffusers under another folder."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if pm.get_plugin("fsdp") is None:
        pytest.skip("statekit-fsdp is not installed")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        sharded, plain = tiny_unet(), tiny_unet(seed=1)
        fully_shard(sharded, mesh=init_device_mesh("cpu", (1,)))
        url = str(tmp_path / "ckpt")
        manifest = statekit.save(url, {"unet": sharded, "plain": plain})
        assert manifest.objects["unet"].owner == "fsdp"
        assert manifest.objects["plain"].owner == "diffusers"
        assert manifest.records["diffusers"]["plain"]["folder"] == "unet_1"
        fresh_sharded, fresh_plain = tiny_unet(seed=2), tiny_unet(seed=2)
        fully_shard(fresh_sharded, mesh=init_device_mesh("cpu", (1,)))
        statekit.load(url, {"unet": fresh_sharded, "plain": fresh_plain})
    finally:
        dist.destroy_process_group()
    assert_same_weights(plain, fresh_plain)
    for a, b in zip(sharded.state_dict().values(), fresh_sharded.state_dict().values()):
        assert torch.equal(a.full_tensor(), b.full_tensor())


def test_a_models_load_hooks_run(pm, tmp_path):
    """A model with load code of its own (a load_state_dict post-hook) has it run by the
    plugin's load, as by from_pretrained; the weights still round-trip exactly."""
    model = tiny_unet(seed=0)
    url = str(tmp_path / "ckpt")
    statekit.save(url, {"unet": model})
    fresh = tiny_unet(seed=1)
    calls = []
    fresh.register_load_state_dict_post_hook(lambda module, keys: calls.append(module))
    statekit.load(url, {"unet": fresh})
    assert calls == [fresh]
    assert_same_weights(model, fresh)
