"""``statekit.export_pretrained`` / ``statekit convert --to hf`` (docs/export.md): every kind of
checkpoint the core writes becomes a folder that ``from_pretrained`` loads bit for bit; bad
input and damaged checkpoints are named errors. (statekit-fsdp's 2-rank export:
plugins/statekit-fsdp/tests/integration/test_fsdp.py; Trainer folders: the
statekit-transformers tests.)"""

from __future__ import annotations

import json
import os

import pytest
import torch
from click.testing import CliRunner

import statekit
from statekit import CheckpointExistsError, CorruptCheckpointError, InvalidOptionError, StatekitError
from statekit.storage import Storage
from statekit.storage.hashing import checksum_bytes
from statekit.testing.manifests import rewrite_manifest

transformers = pytest.importorskip("transformers")


def gpt2(seed: int = 0, n_embd: int = 16):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_layer=2, n_embd=n_embd, n_head=2, vocab_size=64, n_positions=8, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config), config


def assert_same_model(live: torch.nn.Module, loaded: torch.nn.Module) -> None:
    a, b = live.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
        assert a[name].dtype == b[name].dtype, name


def safetensors_metadata(path: str) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        return f.metadata()


def test_a_gpt2_saved_with_statekit_save_loads_with_from_pretrained(tmp_path):
    from transformers import GPT2LMHeadModel

    model, config = gpt2()
    statekit.save(str(tmp_path / "ckpt"), {"model": model, "optimizer": torch.optim.AdamW(model.parameters())}, step=3)
    result = statekit.export_pretrained(str(tmp_path / "ckpt"), str(tmp_path / "hf"), config=config)
    assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "model.safetensors"]
    assert result.dropped_ties == ("lm_head.weight",)  # transformers' _tied_weights_keys: written once, as wte
    assert result.digests_compared == result.tensors == len(model.state_dict()) - 1
    assert safetensors_metadata(str(tmp_path / "hf" / "model.safetensors")) == {"format": "pt"}
    loaded = GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf"))
    assert_same_model(model, loaded)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight


def test_a_small_max_shard_size_writes_shards_and_the_index(tmp_path):
    from transformers import GPT2LMHeadModel

    model, config = gpt2()
    statekit.save(str(tmp_path / "ckpt"), {"model": model})
    result = statekit.export_pretrained(str(tmp_path / "ckpt"), str(tmp_path / "hf"), config=config, max_shard_size="4KB")
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    n = len(shards)
    assert n > 2 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert list(result.files) == [*shards, "model.safetensors.index.json", "config.json"]
    assert "lm_head.weight" not in index["weight_map"] and len(index["weight_map"]) == result.tensors
    assert index["metadata"]["total_size"] == result.total_size == sum(
        t.numel() * t.element_size() for name, t in model.state_dict().items() if name != "lm_head.weight"
    )
    for shard in shards:  # bounded, except a tensor larger than the bound alone in its file
        path = tmp_path / "hf" / shard
        names = [k for k, v in index["weight_map"].items() if v == shard]
        assert safetensors_metadata(str(path)) == {"format": "pt"}
        assert os.path.getsize(path) <= 4000 + 1024 or len(names) == 1
    loaded = GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf"))
    assert_same_model(model, loaded)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight


def test_without_a_config_the_aliases_recorded_in_the_file_are_dropped(tmp_path):
    """The model class unknown: the tie the checkpoint's file records (one tensor stored,
    the other name an alias) is written once under the stored name; a config passed as a
    path is copied as it is."""
    from transformers import GPT2LMHeadModel

    model, config = gpt2()
    statekit.save(str(tmp_path / "ckpt"), {"model": model})
    from safetensors.torch import load_file

    statekit.export_pretrained(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    assert os.listdir(tmp_path / "hf") == ["model.safetensors"]
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    live = model.state_dict()
    assert list(exported) == [name for name in live if name != "lm_head.weight"]
    assert all(torch.equal(t, live[name]) for name, t in exported.items())
    config.save_pretrained(str(tmp_path / "config"))
    statekit.export_pretrained(str(tmp_path / "ckpt"), str(tmp_path / "hf2"), config=str(tmp_path / "config"))
    assert (tmp_path / "hf2" / "config.json").read_bytes() == (tmp_path / "config" / "config.json").read_bytes()
    assert_same_model(model, GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf2")))


def test_an_accelerate_bridge_checkpoint_exports(tmp_path):
    from accelerate_helpers import fresh_accelerator
    from transformers import GPT2LMHeadModel

    accelerator = fresh_accelerator()
    model, config = gpt2()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    statekit.save_state(accelerator, str(tmp_path / "ckpt"))
    statekit.export_pretrained(str(tmp_path / "ckpt"), str(tmp_path / "hf"), config=config)
    assert_same_model(accelerator.unwrap_model(model), GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")))


def test_an_incremental_checkpoint_with_frozen_files_exports_every_tensor(tmp_path):
    """CheckpointManager's incremental save puts frozen weights in files of their own: the
    export reads them all (``<key>.safetensors`` and ``<key>.frozen-*``)."""
    from transformers import GPT2LMHeadModel

    model, config = gpt2(n_embd=128)
    model.transformer.h.requires_grad_(False)  # 1.5 MiB of frozen weights: a file of their own
    manager = statekit.CheckpointManager({"model": model}, str(tmp_path / "run"))
    manifest = manager.save(1)
    files = manifest.objects["model"].files
    assert any(".frozen-" in f for f in files), files
    path = next(c.url for c in statekit.list_checkpoints(str(tmp_path / "run")))
    statekit.export_pretrained(path, str(tmp_path / "hf"), config=config)
    assert_same_model(model, GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")))


def test_a_diffusers_unet_exports_in_its_own_layout(tmp_path):
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    unet = diffusers.UNet2DModel(
        sample_size=8, in_channels=1, out_channels=1, block_out_channels=(8, 16), layers_per_block=1,
        down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"), norm_num_groups=4,
    )  # fmt: skip
    statekit.save(str(tmp_path / "ckpt"), {"unet": unet})
    result = statekit.export_pretrained(str(tmp_path / "ckpt"), str(tmp_path / "hf"), max_shard_size=50_000)
    assert "diffusion_pytorch_model.safetensors.index.json" in result.files and "config.json" in result.files
    assert result.digests_compared == result.tensors
    assert_same_model(unet, diffusers.UNet2DModel.from_pretrained(str(tmp_path / "hf")))


def test_a_peft_lora_model_exports_as_its_adapter_folder(tmp_path):
    peft = pytest.importorskip("peft")
    base, _ = gpt2()
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["c_attn"], init_lora_weights=False))
    statekit.save(str(tmp_path / "ckpt"), {"model": model})
    result = statekit.export_pretrained(str(tmp_path / "ckpt"), str(tmp_path / "adapter"), config=model.peft_config["default"])
    assert sorted(os.listdir(tmp_path / "adapter")) == ["adapter_config.json", "adapter_model.safetensors"]
    assert list(result.files) == ["adapter_model.safetensors", "adapter_config.json"]
    from safetensors.torch import load_file

    exported = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    expected = peft.get_peft_model_state_dict(model)
    assert exported.keys() == expected.keys()
    assert all(torch.equal(exported[k], expected[k]) for k in expected)
    fresh, _ = gpt2()  # the same base weights (same seed): the adapter on top
    loaded = peft.PeftModel.from_pretrained(fresh, str(tmp_path / "adapter"))
    assert_same_model(model, loaded)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rslora", [False, True])
def test_a_peft_lora_model_exports_merged_into_its_base_as_merge_and_unload_computes_it(tmp_path, dtype, rslora):
    import copy

    from transformers import GPT2LMHeadModel

    peft = pytest.importorskip("peft")
    base, config = gpt2()
    lora = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True,
                           init_lora_weights=False, use_rslora=rslora)
    model = peft.get_peft_model(base.to(dtype), lora)
    statekit.save(str(tmp_path / "ckpt"), {"model": model})
    result = statekit.export_pretrained(str(tmp_path / "ckpt"), str(tmp_path / "merged"), merge_adapter=True,
                                        config=[config, model.peft_config["default"]])
    assert sorted(os.listdir(tmp_path / "merged")) == ["config.json", "model.safetensors"]
    expected = copy.deepcopy(model).merge_and_unload()
    assert result.tensors == len(expected.state_dict()) - 1  # lm_head tied: once
    assert result.dropped_ties == ("lm_head.weight",)  # the base's name
    loaded = GPT2LMHeadModel.from_pretrained(str(tmp_path / "merged"), dtype=dtype)
    assert_same_model(expected, loaded)
    unmerged = model.base_model.model.transformer.h[0].attn.c_attn.base_layer.weight
    assert not torch.equal(loaded.transformer.h[0].attn.c_attn.weight, unmerged)  # the adapter is in it


def test_a_peft_model_exported_with_the_base_config_only_is_refused_naming_the_two_ways(tmp_path):
    """(found by a docs-only trial: the folder held peft's names under a GPT-2 config.json,
    and from_pretrained returned a randomly initialised model)"""
    peft = pytest.importorskip("peft")
    base, config = gpt2()
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True))
    statekit.save(str(tmp_path / "ckpt"), {"model": model})
    for given in (config, None):
        with pytest.raises(InvalidOptionError, match=r"is a peft LoRA model .* merge_adapter=True"):
            statekit.export_pretrained(str(tmp_path / "ckpt"), str(tmp_path / "hf"), config=given)
    assert not (tmp_path / "hf").exists() or not os.listdir(tmp_path / "hf")


def test_merge_adapter_without_an_adapter_config_or_with_dora_is_refused(tmp_path):
    peft = pytest.importorskip("peft")
    base, config = gpt2()
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["c_attn"], use_dora=True, fan_in_fan_out=True))
    statekit.save(str(tmp_path / "ckpt"), {"model": model})
    with pytest.raises(InvalidOptionError, match="merge_adapter=True: model 'model' .* needs a LoRA adapter config"):
        statekit.export_pretrained(str(tmp_path / "ckpt"), str(tmp_path / "a"), merge_adapter=True, config=config)
    with pytest.raises(InvalidOptionError, match="this adapter has use_dora=True"):
        statekit.export_pretrained(str(tmp_path / "ckpt"), str(tmp_path / "b"), merge_adapter=True,
                                   config=[config, model.peft_config["default"]])


def test_convert_merge_adapter_on_the_command_line(tmp_path):
    from transformers import GPT2LMHeadModel

    from statekit.cli import main

    peft = pytest.importorskip("peft")
    base, config = gpt2()
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["c_attn"], init_lora_weights=False,
                                                      fan_in_fan_out=True))
    statekit.save(str(tmp_path / "ckpt"), {"model": model})
    config.save_pretrained(str(tmp_path / "cfg"))
    model.peft_config["default"].save_pretrained(str(tmp_path / "cfg"))
    result = CliRunner().invoke(main, ["convert", str(tmp_path / "ckpt"), str(tmp_path / "merged"), "--to", "hf",
                                       "--config", str(tmp_path / "cfg"), "--merge-adapter"])
    assert result.exit_code == 0, result.output
    import copy

    assert_same_model(copy.deepcopy(model).merge_and_unload(), GPT2LMHeadModel.from_pretrained(str(tmp_path / "merged")))
    assert not (tmp_path / "merged" / "adapter_config.json").exists()


def test_a_damaged_tensor_file_is_named(tmp_path):
    model, config = gpt2()
    statekit.save(str(tmp_path / "ckpt"), {"model": model})
    path = tmp_path / "ckpt" / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"model\.safetensors.*checksum"):
        statekit.export_pretrained(str(tmp_path / "ckpt"), str(tmp_path / "hf"), config=config)
    assert not (tmp_path / "hf").exists() or os.listdir(tmp_path / "hf") == []


def test_a_tensor_that_differs_from_the_state_digest_is_named_and_nothing_is_left(tmp_path):
    """The file's bytes changed and its manifest checksum with them (as if the save had
    written other values than the live ones): the digest comparison names the tensor, and
    what the export wrote is removed."""
    from statekit.format import read_header

    model, config = gpt2()
    statekit.save(str(tmp_path / "ckpt"), {"model": model})
    path = tmp_path / "ckpt" / "model.safetensors"
    with open(path, "rb") as f:
        header = read_header(f, str(path))
    entry = next(e for e in header.entries if e.name == "transformer.h.1.mlp.c_fc.weight")
    data = bytearray(path.read_bytes())
    data[header.data_start + entry.begin] ^= 0x40  # the first element: sampled by every digest
    path.write_bytes(bytes(data))
    rewrite_manifest(tmp_path / "ckpt", lambda m: m["files"]["model.safetensors"].update(checksum=checksum_bytes(bytes(data))))
    with pytest.raises(CorruptCheckpointError, match=r"tensor 'transformer\.h\.1\.mlp\.c_fc\.weight' of model 'model'.*state digest"):
        statekit.export_pretrained(str(tmp_path / "ckpt"), str(tmp_path / "hf"), config=config, max_shard_size="8KB")
    assert os.listdir(tmp_path / "hf") == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_shard_size": "5XB"}, r"max_shard_size='5XB'"),
        ({"max_shard_size": 0}, r"max_shard_size=0"),
        ({"model_key": "nope"}, r"model_key='nope'.*models: \['model', 'other'\]"),
        ({}, r"model_key=None.*several models \(model, other\)"),
        ({"model_key": "model", "config": 3}, r"config=int"),
        ({"model_key": "model", "config": "no/such/config.json"}, r"config='no/such/config\.json': no such file"),
    ],
)
def test_bad_arguments_are_named(tmp_path, kwargs, message):
    model, _ = gpt2()
    statekit.save(str(tmp_path / "ckpt"), {"model": model, "other": torch.nn.Linear(2, 2)})
    with pytest.raises(InvalidOptionError, match=message):
        statekit.export_pretrained(str(tmp_path / "ckpt"), str(tmp_path / "hf"), **kwargs)
    assert not (tmp_path / "hf").exists()


def test_a_non_empty_output_is_refused_unless_overwrite(tmp_path):
    model, config = gpt2()
    statekit.save(str(tmp_path / "ckpt"), {"model": model})
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "README.md").write_text("mine")
    with pytest.raises(CheckpointExistsError, match=r"hf exists and is not empty"):
        statekit.export_pretrained(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    with pytest.warns(statekit.StatekitWarning, match=r"without a config.json: from_pretrained needs one"):
        statekit.export_pretrained(str(tmp_path / "ckpt"), str(tmp_path / "hf"), overwrite=True)
    assert sorted(os.listdir(tmp_path / "hf")) == ["README.md", "model.safetensors"]


def test_overwrite_removes_an_earlier_exports_weights_and_keeps_the_users_files(tmp_path):
    """A sharded export over a one-file one (and back): from_pretrained must read the new
    weights, not an earlier export's model.safetensors left beside them."""
    from transformers import GPT2LMHeadModel

    first, config = gpt2(seed=1)
    second, _ = gpt2(seed=2)
    statekit.save(str(tmp_path / "a"), {"model": first})
    statekit.save(str(tmp_path / "b"), {"model": second})
    out = tmp_path / "hf"
    statekit.export_pretrained(str(tmp_path / "a"), str(out), config=config)
    (out / "README.md").write_text("mine")
    (out / "pytorch_model.bin").write_bytes(b"not statekit's name")
    statekit.export_pretrained(str(tmp_path / "b"), str(out), config=config, max_shard_size="20KB", overwrite=True)
    names = sorted(os.listdir(out))
    assert "model.safetensors" not in names and "model.safetensors.index.json" in names
    assert {"README.md", "pytorch_model.bin", "config.json"} <= set(names)
    assert_same_model(second, GPT2LMHeadModel.from_pretrained(str(out)))
    statekit.export_pretrained(str(tmp_path / "a"), str(out), config=config, overwrite=True)
    assert not [n for n in os.listdir(out) if n.startswith("model-") or n.endswith(".index.json")]
    assert_same_model(first, GPT2LMHeadModel.from_pretrained(str(out)))


def test_a_checkpoint_without_a_model_is_refused(tmp_path):
    statekit.save(str(tmp_path / "ckpt"), {"epoch": {"n": 3}})
    with pytest.raises(StatekitError, match=r"holds no model to export"):
        statekit.export_pretrained(str(tmp_path / "ckpt"), str(tmp_path / "hf"))


def test_a_remote_output_is_written_through_the_storage(tmp_path):
    """memory://: every file streamed through statekit's Storage; the folder copied back
    loads equal."""
    from transformers import GPT2LMHeadModel

    model, config = gpt2()
    statekit.save(str(tmp_path / "ckpt"), {"model": model})
    url = "memory://statekit-export-test/hf"
    result = statekit.export_pretrained(str(tmp_path / "ckpt"), url, config=config, max_shard_size="8KB")
    remote = Storage(url)
    local = tmp_path / "copy"
    local.mkdir()
    for name in result.files:
        (local / name).write_bytes(remote.read_bytes(name))
    remote.remove_tree()
    assert_same_model(model, GPT2LMHeadModel.from_pretrained(str(local)))


def test_statekit_convert_to_hf(tmp_path):
    from transformers import GPT2LMHeadModel

    from statekit.cli import main

    model, config = gpt2()
    statekit.save(str(tmp_path / "ckpt"), {"model": model})
    config.save_pretrained(str(tmp_path / "config"))
    out = str(tmp_path / "hf")
    result = CliRunner().invoke(main, ["convert", str(tmp_path / "ckpt"), out, "--to", "hf", "--config", str(tmp_path / "config"),
                                       "--max-shard-size", "8000"])
    assert result.exit_code == 0, result.output
    assert "model.safetensors.index.json" in result.output and "matched the checkpoint's state digest" in result.output
    assert_same_model(model, GPT2LMHeadModel.from_pretrained(out))
    again = CliRunner().invoke(main, ["convert", str(tmp_path / "ckpt"), out, "--to", "hf"])
    assert again.exit_code != 0 and "exists and is not empty" in again.output and "--overwrite" in again.output


def test_a_model_of_a_missing_plugin_in_its_own_layout_names_what_to_install(tmp_path):
    from statekit import PluginMissingError

    statekit.save(str(tmp_path / "ckpt"), {"model": torch.nn.Linear(2, 2)})

    def owned_by_a_missing_plugin(manifest):
        manifest["objects"]["model"].update(owner="ghost", owner_distribution="statekit-ghost", files=["model/weights.bin"])
        manifest["files"]["model/weights.bin"] = manifest["files"].pop("model.safetensors")

    rewrite_manifest(tmp_path / "ckpt", owned_by_a_missing_plugin)
    with pytest.raises(PluginMissingError, match=r"model 'model' was saved by plugin 'ghost', which is not installed: pip install statekit-ghost"):
        statekit.export_pretrained(str(tmp_path / "ckpt"), str(tmp_path / "hf"))


def test_a_config_of_another_model_warns_naming_what_from_pretrained_would_miss(tmp_path):
    import warnings

    from transformers import GPT2Config

    model, config = gpt2()
    config.architectures = ["GPT2LMHeadModel"]  # as from_pretrained's configs say (one built in code names none)
    statekit.save(str(tmp_path / "ckpt"), {"model": model})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        statekit.export_pretrained(str(tmp_path / "ckpt"), str(tmp_path / "right"), config=config)
    assert not [w for w in caught if issubclass(w.category, statekit.StatekitWarning)]
    deeper = GPT2Config(**{**config.to_dict(), "n_layer": 3})
    with pytest.warns(statekit.StatekitWarning, match=r"tensors GPT2LMHeadModel expects are not in the weights "
                                                      r"\(first 'transformer\.h\.2\."):
        statekit.export_pretrained(str(tmp_path / "ckpt"), str(tmp_path / "deeper"), config=deeper)
    wider = GPT2Config(**{**config.to_dict(), "n_embd": 32})
    with pytest.warns(statekit.StatekitWarning, match=r"have other shapes than GPT2LMHeadModel expects"):
        statekit.export_pretrained(str(tmp_path / "ckpt"), str(tmp_path / "wider"), config=wider)
