"""transformers models (a text encoder, as in DreamBooth-style training) in the transformers layout."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_same_weights, tiny_unet

import statekit

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
    rec = manifest["records"]["diffusers"]["text_encoder"]
    assert rec == {"kind": "model", "folder": "text_encoder", "class": "CLIPTextModel", "library": "transformers",
                   "weights": ["text_encoder/model.safetensors"]}
    assert "text_encoder/config.json" in manifest["files"]

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
