"""The ``diffusers`` converter: a checkpoint exported as a folder a diffusers pipeline loads."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_same_weights, tiny_unet, tiny_vae, train_step

import statekit
from statekit import CheckpointExistsError, CorruptCheckpointError, StatekitError, StatekitWarning

import statekit_diffusers
from statekit_diffusers.plugin import STATEKIT_CONVERTERS


def ddpm_checkpoint(url, ema=True):
    from diffusers import DDPMScheduler
    from diffusers.training_utils import EMAModel

    model = tiny_unet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"unet": model, "optim": opt, "noise": statekit_diffusers.NoiseScheduler(DDPMScheduler(num_train_timesteps=30))}
    if ema:
        state["ema"] = EMAModel(model.parameters(), decay=0.5)
    for _ in range(2):
        train_step(model, opt, state.get("ema"))
    statekit.save(url, state)
    return state


def test_converter_is_registered():
    assert STATEKIT_CONVERTERS["diffusers"] is statekit_diffusers.convert


@pytest.mark.parametrize("ema", [True, False], ids=["ema-weights", "trained-weights"])
def test_export_loads_as_ddpm_pipeline(pm, tmp_path, ema):
    from diffusers import DDPMPipeline, DDPMScheduler

    src = str(tmp_path / "ckpt")
    state = ddpm_checkpoint(src)
    out = tmp_path / "pipeline"
    index = statekit_diffusers.convert(src, str(out), ema=ema)
    assert index == {
        "_class_name": "DDPMPipeline",
        "_diffusers_version": index["_diffusers_version"],
        "scheduler": ["diffusers", "DDPMScheduler"],
        "unet": ["diffusers", "UNet2DModel"],
    }
    assert json.loads((out / "model_index.json").read_text()) == index
    pipe = DDPMPipeline.from_pretrained(str(out))
    assert isinstance(pipe.scheduler, DDPMScheduler) and pipe.scheduler.config.num_train_timesteps == 30
    if ema:
        for p, shadow in zip(pipe.unet.parameters(), state["ema"].shadow_params):
            assert torch.equal(p, shadow)
        assert "decay" not in json.loads((out / "unet" / "config.json").read_text())  # the model's own config
    else:
        assert_same_weights(state["unet"], pipe.unet)
    images = pipe(batch_size=1, num_inference_steps=2, output_type="np", generator=torch.Generator().manual_seed(0)).images
    assert images.shape == (1, 8, 8, 1)


def test_export_from_memory_to_memory(pm):
    from diffusers import UNet2DModel

    import fsspec

    src, out = "memory://convert-test/ckpt", "memory://convert-test/out"
    try:
        state = ddpm_checkpoint(src, ema=False)
        statekit_diffusers.convert(src, out, ema=False)
        fs = fsspec.filesystem("memory")
        assert sorted(p.split("/out/", 1)[1] for p in fs.find("/convert-test/out")) == [
            "model_index.json", "scheduler/scheduler_config.json", "unet/config.json", "unet/diffusion_pytorch_model.safetensors",
        ]
        from safetensors.torch import load

        weights = load(fs.cat("/convert-test/out/unet/diffusion_pytorch_model.safetensors"))
        fresh = UNet2DModel.from_config(json.loads(fs.cat("/convert-test/out/unet/config.json")))
        fresh.load_state_dict(weights)
        assert_same_weights(state["unet"], fresh)
    finally:
        fsspec.filesystem("memory").rm("/convert-test", recursive=True)


def test_export_without_a_known_pipeline_writes_folders_and_warns(pm, tmp_path):
    src = str(tmp_path / "ckpt")
    statekit.save(src, {"unet": tiny_unet(), "vae": tiny_vae()})
    with pytest.warns(StatekitWarning, match="no model_index.json"):
        assert statekit_diffusers.convert(src, str(tmp_path / "out")) == {}
    assert (tmp_path / "out" / "vae" / "config.json").exists()
    assert not (tmp_path / "out" / "model_index.json").exists()
    index = statekit_diffusers.convert(src, str(tmp_path / "out2"), pipeline_class="MyPipeline")
    assert index["_class_name"] == "MyPipeline" and index["vae"] == ["diffusers", "AutoencoderKL"]


def test_pipeline_class_recorded_at_save_time(pm, tmp_path):
    src = str(tmp_path / "ckpt")
    statekit.save(src, {"unet": tiny_unet(), "vae": tiny_vae()}, diffusers_pipeline="LDMPipeline")
    assert statekit_diffusers.convert(src, str(tmp_path / "out"))["_class_name"] == "LDMPipeline"


def test_sharded_folders_are_exported_with_their_index(pm, tmp_path):
    from diffusers import UNet2DModel

    src = str(tmp_path / "ckpt")
    model = tiny_unet()
    statekit.save(src, {"unet": model}, max_shard_size="40KB")
    statekit_diffusers.convert(src, str(tmp_path / "out"), pipeline_class="DDPMPipeline")
    assert (tmp_path / "out" / "unet" / "diffusion_pytorch_model.safetensors.index.json").exists()
    assert_same_weights(model, UNet2DModel.from_pretrained(str(tmp_path / "out"), subfolder="unet"))


def test_export_refuses_non_empty_output_and_checkpoints_without_models(pm, tmp_path):
    src = str(tmp_path / "ckpt")
    ddpm_checkpoint(src)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    with pytest.raises(CheckpointExistsError, match="not empty"):
        statekit_diffusers.convert(src, str(tmp_path / "busy"))
    plain = str(tmp_path / "plain")
    statekit.save(plain, {"net": torch.nn.Linear(2, 2)})
    with pytest.raises(StatekitError, match="no diffusers or transformers model"):
        statekit_diffusers.convert(plain, str(tmp_path / "out"))


def test_export_detects_a_corrupted_weights_file(pm, tmp_path):
    src = tmp_path / "ckpt"
    ddpm_checkpoint(str(src))
    weights = src / "unet_ema" / "diffusion_pytorch_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="unet_ema/diffusion_pytorch_model.safetensors"):
        statekit_diffusers.convert(str(src), str(tmp_path / "out"))
