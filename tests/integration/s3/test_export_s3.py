"""``statekit.export_pretrained`` between S3 buckets (moto server over HTTP, docs/export.md):
a checkpoint on S3 exported to an S3 folder, every file streamed through statekit's
Storage; the folder downloaded loads with ``from_pretrained`` equal to the live model."""

from __future__ import annotations

import json

import pytest
import torch

import statekit
from statekit.storage import Storage

pytestmark = pytest.mark.s3
transformers = pytest.importorskip("transformers")


def test_an_s3_checkpoint_exports_to_an_s3_folder_that_loads_bit_exactly(tmp_path, s3_bucket):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=64, n_positions=8, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    statekit.save(f"{s3_bucket}/run/ckpt", {"model": model})
    result = statekit.export_pretrained(f"{s3_bucket}/run/ckpt", f"{s3_bucket}/hf", config=config, max_shard_size="8KB")
    remote = Storage(f"{s3_bucket}/hf")
    assert sorted(remote.find()) == sorted(result.files)
    index = json.loads(remote.read_bytes("model.safetensors.index.json"))
    assert len(set(index["weight_map"].values())) > 1
    local = tmp_path / "hf"
    local.mkdir()
    for name in result.files:
        (local / name).write_bytes(remote.read_bytes(name))
    loaded = GPT2LMHeadModel.from_pretrained(str(local))
    live = model.state_dict()
    assert loaded.state_dict().keys() == live.keys()
    assert all(torch.equal(v, live[k]) for k, v in loaded.state_dict().items())
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
