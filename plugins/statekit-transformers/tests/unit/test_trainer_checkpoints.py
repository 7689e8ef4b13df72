"""What a Trainer user relies on in ``checkpoint-<step>/``, checked on short Trainer runs in the test
process: Trainer's own files, save_total_limit, save_only_model, a subclass with the mixin,
frozen weights reused, and loud refusals (a corrupt file, a lost manifest, a save-only-model
checkpoint for a resume, attach on a Trainer's accelerator, a transformers release without
the overridden methods). The resumed trainings are ``integration/test_checkpoints.py``."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

import statekit
import trainer_runs as tr


def files_of(path):
    return sorted(os.listdir(path))


def test_the_model_folder_loads_with_from_pretrained(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    result = tr.run(str(tmp_path), max_steps=3)
    path = str(tmp_path / "checkpoint-3")
    model = AutoModelForCausalLM.from_pretrained(path)
    live = result.trainer.model.state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(value, live[name]), name
    assert model.lm_head.weight is model.transformer.wte.weight
    assert AutoTokenizer.from_pretrained(path).mask_token == "[MASK]"
    # the state check covers the model the plugin writes as a model folder, and the optimizer
    digest = statekit.verify(path).state_digest
    assert set(digest.objects["model"]) == set(live)
    assert any(p.endswith(".exp_avg") for p in digest.objects["optimizer"])


def test_trainer_state_json_is_trainers_own(tmp_path):
    """trainer_state.json: the content transformers' Trainer writes at the same step."""
    tr.run(str(tmp_path / "sk"), max_steps=3)
    tr.run(str(tmp_path / "plain"), max_steps=3, plain=True)
    ours = tr.trainer_state(str(tmp_path / "sk" / "checkpoint-3"))
    theirs = tr.trainer_state(str(tmp_path / "plain" / "checkpoint-3"))
    ours.pop("best_model_checkpoint"), theirs.pop("best_model_checkpoint")
    assert ours == theirs


def test_save_total_limit_keeps_the_newest(tmp_path):
    tr.run(str(tmp_path), save_total_limit=2)
    kept = sorted(n for n in files_of(tmp_path) if n.startswith("checkpoint-"))
    assert kept == ["checkpoint-12", "checkpoint-15"]


def test_save_only_model(tmp_path):
    tr.run(str(tmp_path), max_steps=3, save_only_model=True)
    names = files_of(tmp_path / "checkpoint-3")
    assert "model.safetensors" in names and "trainer_state.json" in names
    assert not [n for n in names if n.startswith(("optimizer", "scheduler"))], names
    statekit.verify(str(tmp_path / "checkpoint-3"))


def test_a_corrupt_file_fails_the_resume_naming_it(tmp_path):
    tr.run(str(tmp_path), stop_at=8)
    weights = tmp_path / "checkpoint-6" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(statekit.CorruptCheckpointError, match="model.safetensors"):
        tr.run(str(tmp_path), resume=True)


def test_frozen_weights_are_reused_by_the_next_checkpoint(tmp_path):
    """A frozen embedding is its own shard (model-00001-of-00002), reused by every later
    checkpoint; the sharded folder loads with from_pretrained."""
    from transformers import AutoModelForCausalLM

    result = tr.run(str(tmp_path), model=tr.gpt2(frozen_embedding=True), max_steps=6)
    first, second = tmp_path / "checkpoint-3", tmp_path / "checkpoint-6"
    names = files_of(second)
    assert "model.safetensors.index.json" in names and "model-00001-of-00002.safetensors" in names
    index = json.loads((second / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["transformer.wte.weight"] == "model-00001-of-00002.safetensors"
    entry = statekit.verify(str(second)).files["model-00001-of-00002.safetensors"]
    assert entry.reused_from is not None
    assert os.path.samefile(first / "model-00001-of-00002.safetensors", second / "model-00001-of-00002.safetensors")
    model = AutoModelForCausalLM.from_pretrained(str(second))
    for name, value in result.trainer.model.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def test_a_trainer_subclass_with_the_mixin(tmp_path):
    """A user's Trainer subclass (as trl's SFTTrainer is) gets the mixin with statekit_trainer_class."""
    from transformers import Trainer

    from statekit_transformers import statekit_trainer_class

    class MyTrainer(Trainer):
        pass

    cls = statekit_trainer_class(MyTrainer)
    assert issubclass(cls, MyTrainer)
    tr.run(str(tmp_path), trainer_cls=cls, max_steps=3)
    assert "statekit.json" in files_of(tmp_path / "checkpoint-3")


def test_a_trainer_without_an_overridden_method_is_refused():
    """A transformers release that renamed a method the mixin overrides fails at construction."""
    from statekit_transformers.trainer import StatekitTrainerMixin, check_trainer_api

    class Trainer:  # a Trainer lacking _load_rng_state
        def train(self, resume_from_checkpoint=None, trial=None):
            pass

    with pytest.raises(statekit.PluginError, match="Trainer._save_checkpoint does not exist"):
        check_trainer_api(type("T", (StatekitTrainerMixin, Trainer), {}))


def test_attach_warns_for_a_trainers_accelerator_and_refuses_a_trainer(tmp_path):
    """statekit.attach(trainer.accelerator) would be a silent no-op: it warns at the user's line,
    naming StatekitTrainer; statekit.attach(trainer) is refused with the same pointer."""
    from transformers import Trainer

    trainer = Trainer(model=tr.gpt2(), args=tr.arguments(str(tmp_path)), train_dataset=tr.Sentences())
    with pytest.warns(statekit.StatekitWarning, match="never calls accelerator.save_state.*StatekitTrainer") as caught:
        statekit.attach(trainer.accelerator)
    assert caught[0].filename == __file__
    with pytest.raises(statekit.InvalidOptionError, match="not a Trainer.*StatekitTrainer"):
        statekit.attach(trainer)


def test_attach_of_a_plain_accelerator_does_not_warn():
    from accelerate import Accelerator

    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", statekit.StatekitWarning)
        statekit.attach(Accelerator(cpu=True))


def test_a_checkpoint_that_lost_its_manifest_is_not_resumed(tmp_path):
    """checkpoint-8 without statekit.json (a copy tool skipped it) is neither statekit's nor
    Trainer's: resume_from_checkpoint=True takes the committed checkpoint-6."""
    tr.run(str(tmp_path), stop_at=10, save_steps=2)
    (tmp_path / "checkpoint-8" / "statekit.json").unlink()
    infos = {os.path.basename(i.url): i.kind for i in statekit.list_checkpoints(str(tmp_path))}
    assert infos["checkpoint-8"] == "unknown" and infos["checkpoint-6"] == "statekit"
    resumed = tr.run(str(tmp_path), resume=True, max_steps=7, save_steps=2)
    assert resumed.losses[0][0] == 6


def test_a_save_only_model_checkpoint_is_refused_for_a_resume(tmp_path):
    tr.run(str(tmp_path), stop_at=5, save_only_model=True)
    with pytest.raises(statekit.ResumeMismatchError, match="save_only_model"):
        tr.run(str(tmp_path), resume=True)


@pytest.mark.parametrize("plain", [True, False], ids=["Trainer", "StatekitTrainer"])
def test_the_models_load_hooks_run_on_a_resume_as_in_trainer(tmp_path, plain):
    """A model with load code of its own (a load_state_dict post-hook here; a quantized or
    converting layer in practice) has it run on a resume, as Trainer's own load does."""
    tr.run(str(tmp_path), max_steps=3, plain=plain)
    model = tr.gpt2()
    calls = []
    model.register_load_state_dict_post_hook(lambda module, keys: calls.append(module))
    tr.run(str(tmp_path), max_steps=4, resume=True, plain=plain, model=model)
    assert calls, "the model's load hook did not run"
