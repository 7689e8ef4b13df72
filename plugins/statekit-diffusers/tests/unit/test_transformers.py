"""transformers models: a pipeline component (a text encoder beside a UNet, as in
DreamBooth-style training) in the transformers layout; a transformers model alone (a GPT-2
under key "model") left to the core, which names its files by its key and reuses its
frozen tensors across incremental saves."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import assert_same_weights, tiny_unet

import statekit
import statekit.engine.incremental
from statekit.hooks.registry import build_plugin_manager, use_plugin_manager

import statekit_diffusers

transformers = pytest.importorskip("transformers")


def tiny_text_encoder(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.CLIPTextConfig(
        vocab_size=50, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=10, bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )
    return transformers.CLIPTextModel(config)


def test_text_encoder_round_trip_and_from_pretrained(pm, storage_url, tmp_path):
    from test_save_load import local_copy

    encoder, unet = tiny_text_encoder(), tiny_unet()
    opt = torch.optim.AdamW(encoder.parameters(), lr=1e-2)
    encoder(torch.tensor([[0, 5, 7, 1]])).last_hidden_state.square().mean().backward()
    opt.step()
    manifest = statekit.save(storage_url, {"text_encoder": encoder, "unet": unet, "optim": opt})
    rec = manifest.records["diffusers"]["text_encoder"]
    assert rec == {"kind": "model", "folder": "text_encoder", "class": "CLIPTextModel", "library": "transformers",
                   "weights": ["text_encoder/model.safetensors"]}
    assert "text_encoder/config.json" in manifest.files

    fresh = tiny_text_encoder(seed=1)
    statekit.load(storage_url, {"text_encoder": fresh, "unet": tiny_unet(seed=1), "optim": torch.optim.AdamW(fresh.parameters())})
    assert_same_weights(encoder, fresh)

    local = local_copy(storage_url, tmp_path / "copy")
    config = json.loads(open(f"{local}/text_encoder/config.json").read())
    assert config["architectures"] == ["CLIPTextModel"] and config["hidden_size"] == 8
    loaded = transformers.CLIPTextModel.from_pretrained(local, subfolder="text_encoder")
    assert_same_weights(encoder, loaded)


def test_text_encoder_in_an_export(pm, tmp_path):
    src = str(tmp_path / "ckpt")
    statekit.save(src, {"text_encoder": tiny_text_encoder(), "unet": tiny_unet()}, diffusers_pipeline="MyPipeline")
    index = statekit_diffusers.convert(src, str(tmp_path / "out"))
    assert index["text_encoder"] == ["transformers", "CLIPTextModel"] and index["unet"] == ["diffusers", "UNet2DModel"]
    assert (tmp_path / "out" / "text_encoder" / "model.safetensors").exists()


def tiny_gpt2(seed: int = 0):
    """A ``GPT2LMHeadModel`` whose ``lm_head.weight`` is tied to ``transformer.wte.weight``,
    the tied embedding frozen (12.8 kB)."""
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32)
    model = transformers.GPT2LMHeadModel(config)
    model.transformer.wte.weight.requires_grad_(False)
    assert model.lm_head.weight is model.transformer.wte.weight
    return model


def gpt2_step(model, opt) -> None:
    ids = torch.randint(0, 100, (2, 8))
    model(ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def trainable(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


@pytest.fixture(params=["plugin", "core"])
def plugins(request, monkeypatch):
    """The installed plugins, with statekit-diffusers (``plugin``) or with it blocked (``core``)."""
    if request.param == "core":
        monkeypatch.setenv("STATEKIT_DISABLE_PLUGINS", "diffusers")
    pm = build_plugin_manager(autoload=True)
    assert (pm.get_plugin("diffusers") is None) == (request.param == "core")
    with use_plugin_manager(pm):
        yield request.param


def test_a_transformers_model_alone_keeps_its_key(plugins, tmp_path):
    model = tiny_gpt2()
    opt = torch.optim.AdamW(trainable(model), lr=1e-2)
    gpt2_step(model, opt)
    url = str(tmp_path / "ckpt")
    manifest = statekit.save(url, {"model": model, "optimizer": opt})
    assert manifest.objects["model"].owner == "statekit"
    assert "model.safetensors" in manifest.files
    assert not any(rel.startswith("text_encoder") for rel in manifest.files)
    assert "diffusers" not in manifest.records

    fresh = tiny_gpt2(seed=1)
    statekit.load(url, {"model": fresh, "optimizer": torch.optim.AdamW(trainable(fresh))})
    assert_same_weights(model, fresh)
    assert fresh.lm_head.weight is fresh.transformer.wte.weight


def test_a_frozen_tied_embedding_is_reused_and_resumed_exactly(plugins, tmp_path, monkeypatch):
    # The tiny embedding is under the core's 1 MiB threshold for a frozen file of its own.
    monkeypatch.setattr(statekit.engine.incremental, "SPLIT_MIN_BYTES", 0)
    model = tiny_gpt2()
    opt = torch.optim.AdamW(trainable(model), lr=1e-2)
    root = str(tmp_path / "run")
    manager = statekit.CheckpointManager({"model": model, "optimizer": opt}, root)
    gpt2_step(model, opt)
    first = manager.save(1)
    gpt2_step(model, opt)
    second = manager.save(2)

    frozen = "model.frozen-00000.safetensors"
    assert set(second.objects["model"].files) == {"model.safetensors", frozen}
    assert first.files[frozen].reused_from is None
    assert second.files[frozen].reused_from == "checkpoint-00000001"
    assert second.files["model.safetensors"].reused_from is None  # the trained layers changed
    embedding = model.transformer.wte.weight
    assert second.reused_bytes >= embedding.numel() * embedding.element_size()
    assert second.written_bytes == first.written_bytes - second.reused_bytes  # same files, same sizes

    fresh = tiny_gpt2(seed=1)
    fresh_opt = torch.optim.AdamW(trainable(fresh), lr=1e-2)
    statekit.load(os.path.join(root, "checkpoint-00000002"), {"model": fresh, "optimizer": fresh_opt})
    assert_same_weights(model, fresh)
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
    assert fresh.lm_head.weight.data_ptr() == fresh.transformer.wte.weight.data_ptr()
    gpt2_step(fresh, fresh_opt)  # the tie holds through a step: the head is the embedding
    assert torch.equal(fresh.lm_head.weight, fresh.transformer.wte.weight)


def test_a_transformers_model_named_in_code_is_a_pipeline_component(pm, tmp_path):
    encoder = tiny_text_encoder()
    manifest = statekit.save(str(tmp_path / "a"), {"model": encoder}, diffusers_names={"model": "text_encoder"})
    assert manifest.records["diffusers"]["model"]["folder"] == "text_encoder"
    assert "text_encoder/model.safetensors" in manifest.files and "model.safetensors" not in manifest.files

    statekit_diffusers.configure(names={encoder: "text_encoder_2"})
    manifest = statekit.save(str(tmp_path / "b"), {"model": encoder})
    assert manifest.records["diffusers"]["model"]["folder"] == "text_encoder_2"


def test_a_transformers_model_beside_a_noise_scheduler_is_a_pipeline_component(pm, tmp_path):
    from diffusers import DDPMScheduler

    scheduler = statekit_diffusers.NoiseScheduler(DDPMScheduler())
    manifest = statekit.save(str(tmp_path / "ckpt"), {"model": tiny_text_encoder(), "noise_scheduler": scheduler})
    assert manifest.records["diffusers"]["model"]["folder"] == "text_encoder"


def test_an_ema_of_a_transformers_model_alone_stays_with_the_core(pm, tmp_path):
    from diffusers.training_utils import EMAModel

    model = tiny_gpt2()
    ema = EMAModel(trainable(model), model_cls=transformers.GPT2LMHeadModel, model_config=model.config)
    manifest = statekit.save(str(tmp_path / "ckpt"), {"model": model, "ema": ema})
    assert "diffusers" not in manifest.records
    assert manifest.objects["ema"].owner == "statekit"
