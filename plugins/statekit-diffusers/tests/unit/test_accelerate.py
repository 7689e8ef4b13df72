"""With Accelerate: several models in one accelerator, and the train_text_to_image.py hooks replaced."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import assert_same_weights, hand_written_hooks, tiny_cond_unet, tiny_unet, tiny_vae, train_step

import statekit
import statekit.hooks.registry

import statekit_diffusers

accelerate = pytest.importorskip("accelerate")
pytestmark = pytest.mark.skipif(not hasattr(statekit, "save_state"), reason="statekit's Accelerate bridge is not there yet")


def build(seed: int, ema: bool = False, scheduler: bool = False):
    """An accelerator with a UNet, a VAE and a plain module (in that order), one optimizer."""
    from diffusers import DDPMScheduler
    from diffusers.training_utils import EMAModel

    accelerator = accelerate.Accelerator(cpu=True)
    unet, vae = tiny_unet(seed), tiny_vae(seed)
    torch.manual_seed(seed)
    head = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW([*unet.parameters(), *vae.parameters(), *head.parameters()], lr=1e-2)
    unet, vae, head, opt = accelerator.prepare(unet, vae, head, opt)
    extra = {}
    if ema:
        extra["ema"] = EMAModel(unet.parameters(), decay=0.9)
        accelerator.register_for_checkpointing(extra["ema"])
    if scheduler:
        extra["noise"] = statekit_diffusers.NoiseScheduler(DDPMScheduler(num_train_timesteps=25))
        accelerator.register_for_checkpointing(extra["noise"])
    return accelerator, unet, vae, head, opt, extra


def test_two_diffusers_models_and_a_plain_module_each_restored(pm, storage_url):
    accelerator, unet, vae, head, opt, extra = build(0, ema=True, scheduler=True)
    train_step(unet, opt, extra["ema"])
    train_step(vae, opt)
    manifest = statekit.save_state(accelerator, storage_url)
    objects = manifest.objects
    assert [objects[k].owner for k in ("model_0", "model_1", "model_2")] == ["diffusers", "diffusers", "statekit"]
    assert objects["custom_0"].owner == objects["custom_1"].owner == "diffusers"
    records = manifest.records["diffusers"]
    assert {k: records[k]["folder"] for k in ("model_0", "model_1", "custom_0", "custom_1")} == {
        "model_0": "unet", "model_1": "vae", "custom_0": "unet_ema", "custom_1": "scheduler",
    }
    assert "model_2.safetensors" in manifest.files  # the plain module keeps its own stable name

    accelerator2, unet2, vae2, head2, opt2, extra2 = build(1, ema=True, scheduler=True)
    statekit.load_state(accelerator2, storage_url)
    assert_same_weights(unet, unet2)
    assert_same_weights(vae, vae2)
    assert_same_weights(head, head2)
    assert all(torch.equal(a, b) for a, b in zip(extra["ema"].shadow_params, extra2["ema"].shadow_params))
    assert extra2["ema"].optimization_step == 1
    for a, b in zip(opt.state.values(), opt2.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in a)


# --------------------------------------------------------------------------- train_text_to_image.py


def text_to_image_run(seed: int):
    from diffusers import UNet2DConditionModel
    from diffusers.training_utils import EMAModel

    accelerator = accelerate.Accelerator(cpu=True)
    unet = tiny_cond_unet(seed)
    # as the script builds it: EMAModel(ema_unet.parameters(), model_cls=..., model_config=ema_unet.config)
    ema_unet = EMAModel(unet.parameters(), decay=0.9, model_cls=UNet2DConditionModel, model_config=unet.config)
    opt = torch.optim.AdamW(unet.parameters(), lr=1e-2)
    unet, opt = accelerator.prepare(unet, opt)
    return accelerator, unet, opt, ema_unet


def folder_contents(root):
    """``{relative path: parsed JSON or tensors}`` of the unet/ and unet_ema/ folders."""
    from safetensors.torch import load_file

    out = {}
    for folder in ("unet", "unet_ema"):
        for name in sorted(os.listdir(os.path.join(root, folder))):
            path = os.path.join(root, folder, name)
            out[f"{folder}/{name}"] = json.load(open(path)) if name.endswith(".json") else load_file(path)
    return out


def test_attach_replaces_the_train_text_to_image_hooks(pm, tmp_path):
    # 1. the hand-written hooks
    accelerator, unet, opt, ema_unet = text_to_image_run(0)
    hand_written_hooks(accelerator, ema_unet)
    train_step(unet, opt, ema_unet)
    accelerator.save_state(str(tmp_path / "hooks"))

    # 2. no user hooks: the EMA registered for checkpointing, statekit attached
    accelerator, unet, opt, ema_unet = text_to_image_run(0)
    accelerator.register_for_checkpointing(ema_unet)
    statekit.attach(accelerator)
    train_step(unet, opt, ema_unet)
    accelerator.save_state(str(tmp_path / "plugin"))

    ours, theirs = folder_contents(tmp_path / "plugin"), folder_contents(tmp_path / "hooks")
    assert list(ours) == list(theirs) == [
        "unet/config.json", "unet/diffusion_pytorch_model.safetensors",
        "unet_ema/config.json", "unet_ema/diffusion_pytorch_model.safetensors",
    ]
    for rel in ours:
        if rel.endswith(".json"):
            assert ours[rel] == theirs[rel], rel
        else:
            assert list(ours[rel]) == list(theirs[rel]) or sorted(ours[rel]) == sorted(theirs[rel])
            assert all(torch.equal(ours[rel][k], theirs[rel][k]) for k in theirs[rel]), rel
    for d in ("hooks", "plugin"):  # neither wrote the UNet a second time
        assert not any(n.startswith(("model.", "pytorch_model")) for n in os.listdir(tmp_path / d))
    manifest = json.loads((tmp_path / "plugin" / "statekit.json").read_text())
    assert manifest["records"]["diffusers"]["model_0"]["folder"] == "unet"  # the file's JSON

    # 3. resume with the plugin: weights and EMA restored into the live objects
    accelerator2, unet2, opt2, ema2 = text_to_image_run(1)
    accelerator2.register_for_checkpointing(ema2)
    statekit.attach(accelerator2)
    accelerator2.load_state(str(tmp_path / "plugin"))
    assert_same_weights(unet, unet2)
    assert all(torch.equal(a, b) for a, b in zip(ema_unet.shadow_params, ema2.shadow_params))
    assert ema2.optimization_step == ema_unet.optimization_step == 1

    # 4. the plugin's folders also load through the hand-written hooks (same layout); the EMA is
    #    registered because Accelerate itself pickled it as custom_checkpoint_0.pkl in attach mode
    accelerator3, unet3, opt3, ema3 = text_to_image_run(2)
    accelerator3.register_for_checkpointing(ema3)
    hand_written_hooks(accelerator3, ema3)
    accelerator3.load_state(str(tmp_path / "plugin"))
    assert_same_weights(unet, unet3)
    assert all(torch.equal(a, b) for a, b in zip(ema_unet.shadow_params, ema3.shadow_params))


def test_manager_resume_with_diffusers_models(pm, storage_url):
    accelerator, unet, vae, head, opt, extra = build(0, ema=True)
    manager = statekit.CheckpointManager(accelerator, storage_url, keep_last=2)
    for step in (1, 2, 3):
        train_step(unet, opt, extra["ema"])
        manager.save(step)
    manager.wait()
    accelerator2, unet2, vae2, head2, opt2, extra2 = build(1, ema=True)
    assert statekit.CheckpointManager(accelerator2, storage_url, keep_last=2).resume() == 3
    assert_same_weights(unet, unet2)
    assert extra2["ema"].optimization_step == 3


def test_an_incremental_manager_save_reuses_the_frozen_vae(pm, tmp_path):
    accelerator, unet, vae, head, opt, extra = build(0, ema=True)
    vae.requires_grad_(False)  # a fine-tune of the UNet: the VAE stays as it is
    root = str(tmp_path / "run")
    manager = statekit.CheckpointManager(accelerator, root)
    train_step(unet, opt, extra["ema"])
    manager.save(1)
    train_step(unet, opt, extra["ema"])
    manifest = manager.save(2)
    vae_file = "vae/diffusion_pytorch_model.safetensors"
    assert manifest.files[vae_file].reused_from == "checkpoint-00000001"  # hard-linked, not written again
    assert manifest.files["unet/diffusion_pytorch_model.safetensors"].reused_from is None
    assert os.path.samefile(f"{root}/checkpoint-00000001/{vae_file}", f"{root}/checkpoint-00000002/{vae_file}")
    accelerator2, unet2, vae2, head2, opt2, extra2 = build(1, ema=True)
    assert statekit.CheckpointManager(accelerator2, root).resume() == 2
    assert_same_weights(unet, unet2)
    assert_same_weights(vae, vae2)


def test_cli_convert_exports_a_pipeline(pm, tmp_path):
    accelerator, unet, vae, head, opt, extra = build(0, ema=True, scheduler=True)
    src = str(tmp_path / "ckpt")
    statekit.save_state(accelerator, src, diffusers_pipeline="DDPMPipeline")
    out = tmp_path / "pipeline"
    command = os.path.join(os.path.dirname(sys.executable), "statekit")
    if not os.path.exists(command):
        pytest.skip("the statekit command is not installed")
    result = subprocess.run([command, "convert", src, str(out), "--to", "diffusers"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    index = json.loads((out / "model_index.json").read_text())
    assert index["_class_name"] == "DDPMPipeline" and index["vae"] == ["diffusers", "AutoencoderKL"]


def test_async_save_stages_the_diffusers_folders(pm, tmp_path):
    import inspect

    if "async_save" not in inspect.signature(statekit.CheckpointManager).parameters:
        pytest.skip("CheckpointManager has no async_save yet")
    accelerator, unet, vae, head, opt, extra = build(0, ema=True)
    train_step(unet, opt, extra["ema"])
    expected = {k: v.clone() for k, v in unet.state_dict().items()}
    expected_ema = [t.clone() for t in extra["ema"].shadow_params]
    manager = statekit.CheckpointManager(accelerator, str(tmp_path / "run"), async_save=True)
    manager.save(1)
    train_step(unet, opt, extra["ema"])  # change everything while the background write runs
    manager.wait()
    accelerator2, unet2, vae2, head2, opt2, extra2 = build(1, ema=True)
    assert statekit.CheckpointManager(accelerator2, str(tmp_path / "run")).resume() == 1
    assert all(torch.equal(v, expected[k]) for k, v in unet2.state_dict().items())
    assert all(torch.equal(a, b) for a, b in zip(extra2["ema"].shadow_params, expected_ema))


def test_attach_directory_reads_back_through_statekit_and_names_a_missing_plugin(pm, tmp_path):
    """A directory of attach + accelerator.save_state whose UNet the plugin took (no
    Accelerate model file): statekit.load_state and a manager resume route it back to the
    plugin; without the plugin, accelerator.load_state names it before loading anything."""
    accelerator, unet, vae, head, opt, _ = build(0)
    statekit.attach(accelerator)
    train_step(unet, opt)
    accelerator.save_state(str(tmp_path / "ckpt"))

    accelerator2, unet2, vae2, head2, opt2, _ = build(1)
    statekit.load_state(accelerator2, str(tmp_path / "ckpt"), allow_pickle=True)
    for a, b in ((unet, unet2), (vae, vae2), (head, head2)):
        assert_same_weights(a, b)

    blocked = statekit.hooks.registry.build_plugin_manager(autoload=False)
    accelerator3, unet3, *_ = build(2)
    statekit.attach(accelerator3)
    with statekit.hooks.registry.use_plugin_manager(blocked):
        with pytest.raises(statekit.PluginMissingError, match="statekit-diffusers"):
            accelerator3.load_state(str(tmp_path / "ckpt"))
        with pytest.raises(statekit.PluginMissingError, match="statekit-diffusers"):
            statekit.load_state(accelerator3, str(tmp_path / "ckpt"), allow_pickle=True)
