"""A frozen base referenced, not written (docs/export.md, "A frozen base is referenced";
statekit/engine/references.py): the first checkpoint of a partly frozen or LoRA fine-tune
holds only what trains; a load reads the base from its pretrained folder, every tensor
checked; a moved or edited base is a named error, never a silent different base; a
checkpoint becomes self-contained with ``materialize``."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch
from click.testing import CliRunner

import statekit
from statekit import ChangedBaseError, CheckpointExistsError, InvalidOptionError, MissingBaseError

transformers = pytest.importorskip("transformers")
from transformers import GPT2LMHeadModel  # noqa: E402

from reference_helpers import assert_same, base_folder, config, fine_tune, step  # noqa: E402


def saved_fine_tune(tmp_path) -> tuple[str, torch.nn.Module, str]:
    """``(folder, model, ckpt)``: the base folder, the fine-tune of it, and its checkpoint
    saved with ``statekit.save`` (the model alone) at ``tmp_path / "ckpt"``."""
    folder = base_folder(tmp_path / "base")
    model, _ = fine_tune(folder)
    ckpt = str(tmp_path / "ckpt")
    statekit.save(ckpt, {"model": model})
    return folder, model, ckpt


def rewrite_base(folder: str, change) -> None:
    """Write the base's ``model.safetensors`` again with ``change(tensors)`` applied (an edit by hand)."""
    from safetensors.torch import load_file, save_file

    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    save_file(change(tensors), path, metadata={"format": "pt"})


def manifest(ckpt: str) -> dict:
    with open(os.path.join(ckpt, "statekit.json")) as f:
        return json.load(f)


def assert_loads_as(ckpt: str, model: torch.nn.Module) -> torch.nn.Module:
    """``ckpt`` loaded into a GPT-2 built from the config (random weights) equals ``model``; returns it."""
    fresh = GPT2LMHeadModel(config())
    statekit.load(ckpt, {"model": fresh})
    assert_same(model, fresh)
    return fresh


def test_a_from_pretrained_fine_tune_writes_only_what_trains_and_loads_bit_for_bit(tmp_path):
    folder = base_folder(tmp_path / "base")
    model, optim = fine_tune(folder)
    ckpt = str(tmp_path / "ckpt")
    statekit.save(ckpt, {"model": model, "optim": optim}, step=1)
    m = manifest(ckpt)
    assert m["format"] == "statekit/3"
    ref = m["references"]["model"]
    assert ref["source"] == os.path.abspath(folder) and list(ref["files"]) == ["model.safetensors"]
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen <= set(ref["tensors"])  # every frozen parameter; lm_head.weight (tied to wte) too
    assert ref["tensors"]["lm_head.weight"] == ref["tensors"]["transformer.wte.weight"]
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    assert m["files"]["model.safetensors"]["size_bytes"] < trainable + 64 * 1024  # none of the base's bytes
    fresh = assert_loads_as(ckpt, model)
    assert fresh.lm_head.weight.data_ptr() == fresh.transformer.wte.weight.data_ptr()
    statekit.verify(ckpt)


def test_the_manager_resumes_a_referencing_run_exactly_and_keeps_referencing(tmp_path):
    folder = base_folder(tmp_path / "base")
    model, optim = fine_tune(folder)
    manager = statekit.CheckpointManager({"model": model, "optim": optim}, str(tmp_path / "run"), keep_last=2)
    for s in range(1, 4):
        step(model, optim, 1)
        manager.save(s)
    manager.wait()
    names = sorted(os.listdir(tmp_path / "run"))
    assert [n for n in names if n.startswith("checkpoint-")] == ["checkpoint-00000002", "checkpoint-00000003"]
    assert all(manifest(str(tmp_path / "run" / n))["format"] == "statekit/3" for n in names if n.startswith("checkpoint-"))
    model2, optim2 = fine_tune(folder)
    resumed = statekit.CheckpointManager({"model": model2, "optim": optim2}, str(tmp_path / "run")).resume()
    assert resumed == 3
    assert_same(model, model2)
    step(model, optim, 9), step(model2, optim2, 9)
    assert_same(model, model2)


def test_a_peft_lora_model_references_its_base_under_the_base_layer_names(tmp_path):
    peft = pytest.importorskip("peft")
    folder = base_folder(tmp_path / "base")
    lora = peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True)
    model = peft.get_peft_model(GPT2LMHeadModel.from_pretrained(folder), lora)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    step(model, optim, 1)
    ckpt = str(tmp_path / "ckpt")
    statekit.save(ckpt, {"model": model, "optim": optim})
    tensors = manifest(ckpt)["references"]["model"]["tensors"]
    name = "base_model.model.transformer.h.0.attn.c_attn.base_layer.weight"
    assert tensors[name]["name"] == "transformer.h.0.attn.c_attn.weight"
    assert not any("lora_" in n for n in tensors)
    fresh = peft.get_peft_model(GPT2LMHeadModel(config()), lora)
    statekit.load(ckpt, {"model": fresh})
    assert_same(model, fresh)


def test_reference_pretrained_names_the_folder_of_a_model_built_from_a_config(tmp_path):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config())
    model.save_pretrained(str(tmp_path / "exported"))  # the same bytes, no from_pretrained
    for name, p in model.named_parameters():
        p.requires_grad_("h.1" in name)
    ckpt = str(tmp_path / "ckpt")
    statekit.save(ckpt, {"model": model})
    assert "references" not in manifest(ckpt)  # nothing learned: written whole
    statekit.reference_pretrained(model, tmp_path / "exported")
    statekit.save(ckpt, {"model": model}, overwrite=True)
    assert manifest(ckpt)["references"]["model"]["source"] == str(tmp_path / "exported")


def test_opting_out_writes_the_whole_model(tmp_path):
    folder = base_folder(tmp_path / "base")
    model, optim = fine_tune(folder)
    statekit.reference_pretrained(model, None)
    ckpt = str(tmp_path / "ckpt")
    statekit.save(ckpt, {"model": model})
    assert manifest(ckpt)["format"] != "statekit/3" and "references" not in manifest(ckpt)
    shutil.rmtree(folder)
    assert_loads_as(ckpt, model)
    with pytest.raises(InvalidOptionError, match="nn.Module"):
        statekit.reference_pretrained(torch.zeros(2), folder)


def test_a_frozen_tensor_that_no_longer_equals_the_folder_is_written(tmp_path):
    folder = base_folder(tmp_path / "base")
    model, optim = fine_tune(folder)
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.weight.add_(1.0)  # frozen, but changed since from_pretrained
    ckpt = str(tmp_path / "ckpt")
    statekit.save(ckpt, {"model": model})
    tensors = manifest(ckpt)["references"]["model"]["tensors"]
    assert "transformer.h.0.mlp.c_fc.weight" not in tensors and "transformer.h.0.attn.c_attn.weight" in tensors
    assert_loads_as(ckpt, model)


def test_a_sharded_folder_is_referenced_across_its_files(tmp_path):
    folder = base_folder(tmp_path / "base", max_shard_size="100KB")
    assert os.path.exists(os.path.join(folder, "model.safetensors.index.json"))
    model, optim = fine_tune(folder)
    ckpt = str(tmp_path / "ckpt")
    statekit.save(ckpt, {"model": model, "optim": optim})
    assert len(manifest(ckpt)["references"]["model"]["files"]) > 1
    assert_loads_as(ckpt, model)


# ---------------------------------------------------------------------- failure modes


def test_a_moved_base_is_a_missing_base_error_and_the_model_is_untouched(tmp_path):
    folder = base_folder(tmp_path / "base")
    model, optim = fine_tune(folder)
    ckpt = str(tmp_path / "ckpt")
    statekit.save(ckpt, {"model": model, "optim": optim})
    os.rename(folder, tmp_path / "moved")
    fresh = GPT2LMHeadModel(config())
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(MissingBaseError, match=r"references frozen tensors in .*base.*model.safetensors does not exist") as info:
        statekit.load(ckpt, {"model": fresh})
    assert "--materialize" in str(info.value)
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())
    with pytest.raises(MissingBaseError):
        statekit.verify(ckpt)


def test_an_edited_tensor_in_the_base_is_a_changed_base_error_naming_it(tmp_path):
    folder, model, ckpt = saved_fine_tune(tmp_path)

    def edit(tensors):
        tensors["transformer.h.0.attn.c_attn.weight"][0, 0] += 1  # same header, other bytes
        return tensors

    rewrite_base(folder, edit)
    with pytest.raises(ChangedBaseError, match=r"model.safetensors: tensor 'transformer.h.0.attn.c_attn.weight'.*differs"):
        statekit.verify(ckpt)
    with pytest.raises(ChangedBaseError, match="partly overwritten"):
        statekit.load(ckpt, {"model": GPT2LMHeadModel(config())})


def test_a_base_whose_header_changed_is_refused_before_anything_is_loaded(tmp_path):
    folder, model, ckpt = saved_fine_tune(tmp_path)
    rewrite_base(folder, lambda tensors: {k: v.to(torch.float16) for k, v in tensors.items()})  # retyped
    fresh = GPT2LMHeadModel(config())
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(ChangedBaseError, match=r"model.safetensors is \d+ bytes, \d+ when the checkpoint was saved"):
        statekit.load(ckpt, {"model": fresh})
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())


def test_a_remote_base_is_referenced_and_its_removal_named(tmp_path):
    import fsspec

    folder = base_folder(tmp_path / "base")
    fs = fsspec.filesystem("memory")
    for name in os.listdir(folder):
        fs.put(os.path.join(folder, name), f"/refbase/{name}")
    model, optim = fine_tune(folder)
    statekit.reference_pretrained(model, "memory://refbase")
    ckpt = "memory://refckpt/checkpoint"
    try:
        statekit.save(ckpt, {"model": model, "optim": optim})
        saved = statekit.verify(ckpt)
        assert saved.references["model"].source == "memory://refbase"
        fresh = GPT2LMHeadModel(config())
        statekit.load(ckpt, {"model": fresh})
        assert_same(model, fresh)
        fs.rm("/refbase/model.safetensors")
        with pytest.raises(MissingBaseError, match="memory://refbase"):
            statekit.load(ckpt, {"model": GPT2LMHeadModel(config())})
    finally:
        for path in ("/refbase", "/refckpt"):
            if fs.exists(path):
                fs.rm(path, recursive=True)


def test_a_copy_carried_beside_the_checkpoints_is_used_when_the_folder_is_gone(tmp_path):
    folder = base_folder(tmp_path / "base")
    model, optim = fine_tune(folder)
    ckpt = str(tmp_path / "root" / "checkpoint-00000001")
    statekit.save(ckpt, {"model": model})
    base_id = manifest(ckpt)["references"]["model"]["base_id"]
    shutil.copytree(folder, tmp_path / "root" / ".statekit-bases" / base_id)
    shutil.rmtree(folder)
    assert_loads_as(ckpt, model)


# ---------------------------------------------------------------------- self-contained again


def test_materialize_makes_a_checkpoint_that_loads_without_its_base(tmp_path):
    folder = base_folder(tmp_path / "base")
    model, optim = fine_tune(folder)
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "whole")
    statekit.save(ckpt, {"model": model, "optim": optim}, step=5)
    copy = statekit.materialize(ckpt, out)
    assert copy.format == "statekit/2" and copy.references is None and copy.step == 5
    assert "model.frozen-00000.safetensors" in copy.files
    shutil.rmtree(folder)
    statekit.verify(out)
    fresh = GPT2LMHeadModel(config())
    fresh_optim = torch.optim.AdamW([p for n, p in fresh.named_parameters() if "h.1" in n], lr=1e-2)
    statekit.load(out, {"model": fresh, "optim": fresh_optim})
    assert_same(model, fresh)
    with pytest.raises(CheckpointExistsError):
        statekit.materialize(ckpt, out)


def test_convert_to_statekit_with_materialize_on_the_command_line(tmp_path):
    from statekit.cli import main

    folder = base_folder(tmp_path / "base")
    model, _ = fine_tune(folder)
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "whole")
    statekit.save(ckpt, {"model": model})
    result = CliRunner().invoke(main, ["convert", ckpt, out, "--to", "statekit", "--materialize"])
    assert result.exit_code == 0, result.output
    assert "self-contained" in result.output
    shutil.rmtree(folder)
    fresh = GPT2LMHeadModel(config())
    statekit.load(out, {"model": fresh})
    assert_same(model, fresh)
    wrong = CliRunner().invoke(main, ["convert", ckpt, str(tmp_path / "x"), "--to", "hf", "--materialize"])
    assert wrong.exit_code != 0 and "--materialize goes with --to statekit" in wrong.output


def test_export_of_a_referencing_checkpoint_writes_the_base_too(tmp_path):
    folder, model, ckpt = saved_fine_tune(tmp_path)
    statekit.export_pretrained(ckpt, str(tmp_path / "hf"), config=model.config)
    assert_same(model, GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")))


def test_a_referencing_manifest_matches_the_schema_and_round_trips(tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    from importlib import resources

    from statekit.format.manifest_types import Manifest

    folder = base_folder(tmp_path / "base")
    model, optim = fine_tune(folder)
    ckpt = str(tmp_path / "ckpt")
    statekit.save(ckpt, {"model": model, "optim": optim})
    schema = json.loads(resources.files("statekit").joinpath("manifest.schema.json").read_text())
    data = manifest(ckpt)
    jsonschema.Draft202012Validator(schema).validate(data)
    parsed = Manifest.from_json(data, ckpt)
    assert parsed.to_json() == data
    broken = json.loads(json.dumps(data))
    broken["references"]["model"]["tensors"]["transformer.wte.weight"]["file"] = "other.safetensors"
    with pytest.raises(statekit.CorruptCheckpointError, match="'references' of model 'model' is malformed"):
        Manifest.from_json(broken, ckpt, check_checksum=False)


def test_a_pretrained_folder_given_as_a_checkpoint_is_named_as_one(tmp_path):
    folder = base_folder(tmp_path / "base")
    with pytest.raises(statekit.IncompleteCheckpointError, match="is a Hugging Face pretrained folder"):
        statekit.verify(folder)
    with pytest.raises(statekit.IncompleteCheckpointError, match="is a Hugging Face pretrained folder"):
        statekit.export_pretrained(folder, str(tmp_path / "out"))


@pytest.mark.parametrize("budget", [None, 0.25])
def test_an_async_save_references_the_base_too(tmp_path, budget):
    folder = base_folder(tmp_path / "base")
    model, optim = fine_tune(folder)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt = str(tmp_path / "ckpt")
    pending = statekit.save(ckpt, {"model": model, "optim": optim}, blocking=False, host_memory_budget=budget)
    step(model, optim, 2)  # training goes on while the save runs
    committed = pending.wait()
    assert committed.format == "statekit/3" and "transformer.wte.weight" in committed.references["model"].tensors
    fresh = GPT2LMHeadModel(config())
    statekit.load(ckpt, {"model": fresh})
    assert all(torch.equal(expected[k], v) for k, v in fresh.state_dict().items())


def test_resume_with_the_base_gone_raises_instead_of_resuming_an_older_checkpoint(tmp_path):
    folder = base_folder(tmp_path / "base")
    model, optim = fine_tune(folder)
    manager = statekit.CheckpointManager({"model": model, "optim": optim}, str(tmp_path / "run"))
    for s in (1, 2):
        manager.save(s)
    manager.wait()
    os.rename(folder, tmp_path / "moved")
    built = GPT2LMHeadModel(config())  # from a config: names no folder
    with pytest.raises(MissingBaseError, match="checkpoint-00000002 references frozen tensors"):
        statekit.CheckpointManager({"model": built}, str(tmp_path / "run")).resume()


def test_a_moved_base_loads_from_where_the_resuming_model_comes_from(tmp_path):
    folder = base_folder(tmp_path / "base")
    model, optim = fine_tune(folder)
    manager = statekit.CheckpointManager({"model": model, "optim": optim}, str(tmp_path / "run"))
    manager.save(1)
    manager.wait()
    os.rename(folder, tmp_path / "moved")
    model2, optim2 = fine_tune(str(tmp_path / "moved"))  # from_pretrained of the new place
    assert statekit.CheckpointManager({"model": model2, "optim": optim2}, str(tmp_path / "run")).resume() == 1
    assert_same(model, model2)
    built = GPT2LMHeadModel(config())
    statekit.reference_pretrained(built, tmp_path / "moved")  # or named
    statekit.load(str(tmp_path / "run" / "checkpoint-00000001"), {"model": built})
    assert_same(model, built)


def test_another_folder_the_loading_model_names_is_taken_only_when_every_tensor_matches(tmp_path):
    folder, model, ckpt = saved_fine_tune(tmp_path)
    shutil.rmtree(folder)
    torch.manual_seed(5)
    GPT2LMHeadModel(config()).save_pretrained(str(tmp_path / "other"))  # same architecture, other weights
    target = GPT2LMHeadModel.from_pretrained(str(tmp_path / "other"))
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(MissingBaseError, match=r"base/model.safetensors does not exist; also tried: .*other.*differs"):
        statekit.load(ckpt, {"model": target})
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())  # nothing was loaded


def test_a_wholly_frozen_model_is_referenced_whole(tmp_path):
    folder = base_folder(tmp_path / "base")
    teacher = GPT2LMHeadModel.from_pretrained(folder).requires_grad_(False)
    ckpt = str(tmp_path / "ckpt")
    statekit.save(ckpt, {"teacher": teacher})
    m = manifest(ckpt)
    assert set(m["references"]["teacher"]["tensors"]) == set(teacher.state_dict())
    assert m["files"]["teacher.safetensors"]["size_bytes"] < 1024  # a header only
    fresh = GPT2LMHeadModel(config())
    statekit.load(ckpt, {"teacher": fresh})
    assert_same(teacher, fresh)


def test_a_relative_or_wrong_folder_given_to_reference_pretrained(tmp_path, monkeypatch):
    base_folder(tmp_path / "base")
    monkeypatch.chdir(tmp_path)
    model = GPT2LMHeadModel(config())
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(3.0).requires_grad_("h.1" in name)  # equal to no tensor of the base (not even a LayerNorm's ones)
    with pytest.raises(InvalidOptionError, match=r"reference_pretrained: .*base-typo is not a folder"):
        statekit.reference_pretrained(model, "base-typo")
    statekit.reference_pretrained(model, "base")  # recorded absolute
    with pytest.warns(statekit.StatekitWarning, match=r"none of its \d+ frozen tensors equals a tensor of .*base"):
        statekit.save(str(tmp_path / "ckpt"), {"model": model})  # a model of other weights: nothing matches
    assert "references" not in manifest(str(tmp_path / "ckpt"))
    torch.manual_seed(0)
    same = GPT2LMHeadModel(config())  # base_folder's weights
    for name, p in same.named_parameters():
        p.requires_grad_("h.1" in name)
    statekit.reference_pretrained(same, "base")
    statekit.save(str(tmp_path / "ckpt2"), {"model": same})
    assert manifest(str(tmp_path / "ckpt2"))["references"]["model"]["source"] == str(tmp_path / "base")


def test_a_pipeline_component_loaded_with_subfolder_is_referenced_in_that_subfolder(tmp_path):
    """``from_pretrained(root, subfolder="text_encoder")`` records ``root``: the component's
    folder is the subfolder whose config names the model's class."""
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    diffusers.UNet2DModel(sample_size=8, in_channels=1, out_channels=1, block_out_channels=(8, 16), layers_per_block=1,
                          down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"),
                          norm_num_groups=4).save_pretrained(str(tmp_path / "pipeline" / "unet"))  # another component
    base_folder(tmp_path / "pipeline" / "text_encoder")
    model = GPT2LMHeadModel.from_pretrained(str(tmp_path / "pipeline"), subfolder="text_encoder")
    assert model.config._name_or_path == str(tmp_path / "pipeline")
    model.requires_grad_(False)  # a frozen text encoder
    ckpt = str(tmp_path / "ckpt")
    statekit.save(ckpt, {"model": model})
    assert manifest(ckpt)["references"]["model"]["source"] == str(tmp_path / "pipeline" / "text_encoder")
    assert_loads_as(ckpt, model)


def test_inspect_names_the_referenced_folder(tmp_path):
    from statekit.cli import main

    folder, model, ckpt = saved_fine_tune(tmp_path)
    result = CliRunner().invoke(main, ["inspect", ckpt])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())  # (the console may wrap a long line)
    assert re.search(r"references model 'model': \d+ frozen tensors in \S*base \(model\.safetensors\), not in this "
                     r"checkpoint", text), text
