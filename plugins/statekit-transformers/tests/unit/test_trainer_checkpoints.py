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


def test_a_model_loaded_with_from_pretrained_is_saved_and_resumed(tmp_path):
    """run_clm.py builds its model with AutoModelForCausalLM.from_pretrained, which attaches a
    weight-conversion list (empty for GPT-2): transformers' revert_weight_conversion then returns
    the same tensors in sorted order, and statekit-transformers took the new order for renamed
    tensors and refused the model ("has a weight-conversion mapping") at the first save."""
    from transformers import AutoModelForCausalLM

    tr.gpt2().save_pretrained(str(tmp_path / "base"))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"))
    assert getattr(model, "_weight_conversions", None) is not None  # the case: a list is attached
    result = tr.run(str(tmp_path / "out"), model=model, max_steps=3, save_steps=3)
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out" / "checkpoint-3"))
    live = result.trainer.model.state_dict()
    assert all(torch.equal(v, live[k]) for k, v in loaded.state_dict().items())


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


def _scripted_score(scores):
    """A callback that gives every evaluation the score ``scores[global_step]`` as
    ``eval_score`` (added to the metrics before Trainer picks the best checkpoint): which
    checkpoint is the best is the test's choice, not the eval loss's."""
    from transformers import TrainerCallback

    class Score(TrainerCallback):
        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            metrics["eval_score"] = scores[state.global_step]

    return Score()


def _folders(path):
    return sorted(n for n in files_of(path) if n.startswith("checkpoint-"))


def _folders_at_each_save(path, seen):
    """A callback that records the checkpoint folders under ``path`` after every save."""
    from transformers import TrainerCallback

    class Folders(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            seen.append((state.global_step, _folders(path)))

    return Folders()


# scores by step (greater is better): the best is an old checkpoint (4) when the run ends, or the
# newest (8); on the way the best moves (2, then 4; or at every save)
BEST_OLD = {2: 3.0, 4: 5.0, 6: 1.0, 8: 2.0}
BEST_NEWEST = {2: 1.0, 4: 2.0, 6: 3.0, 8: 4.0}


@pytest.mark.parametrize(("limit", "best", "asynchronous"), [
    (1, None, False), (2, None, False), (3, None, False),
    (1, BEST_OLD, False), (2, BEST_OLD, False), (3, BEST_OLD, False),
    (1, BEST_NEWEST, False), (2, "metric only", False), (1, BEST_OLD, True), (None, BEST_OLD, False),
], ids=["1", "2", "3", "1-best-old", "2-best-old", "3-best-old", "1-best-newest", "2-metric-without-load-best",
        "1-best-old-async", "no-limit-best-old"])
def test_save_total_limit_keeps_the_folders_trainer_keeps(tmp_path, limit, best, asynchronous):
    """save_total_limit (with or without load_best_model_at_end, or with metric_for_best_model
    alone, which makes Trainer protect the best too) leaves the checkpoint folders that plain
    transformers.Trainer leaves in the same run, after every save and at the end: the newest
    and the best never deleted, older ones down to the limit, and with save_total_limit=1 and a
    best, only the best at the end (also with async saves: the last one commits before
    Trainer's end of training). Without save_total_limit every checkpoint stays, best or not."""
    seen = {"plain": [], "sk": []}

    def overrides(name):
        kw = dict(max_steps=8, save_steps=2, save_total_limit=limit)
        callbacks = [_folders_at_each_save(tmp_path / name, seen[name])]
        if best is not None:
            scores = BEST_OLD if best == "metric only" else best
            callbacks.append(_scripted_score(scores))
            kw.update(eval_dataset=tr.Sentences(n=4, seed=5), eval_strategy="steps", eval_steps=2,
                      metric_for_best_model="score", greater_is_better=True,
                      load_best_model_at_end=best != "metric only")
        return dict(kw, callbacks=callbacks)

    plain = tr.run(str(tmp_path / "plain"), plain=True, **overrides("plain"))
    ours = tr.run(str(tmp_path / "sk"), statekit_options={"async_save": True} if asynchronous else None,
                  **overrides("sk"))
    expected = _folders(tmp_path / "plain")
    assert _folders(tmp_path / "sk") == expected
    if not asynchronous:  # an async save commits (and rotates) at the next save
        assert seen["sk"] == seen["plain"] and len(seen["plain"]) == 4
    if best is not None:  # the case the parameters name, in Trainer's own run
        best_name = os.path.basename(plain.trainer.state.best_model_checkpoint)
        assert best_name == ("checkpoint-8" if best is BEST_NEWEST else "checkpoint-4")
        assert os.path.basename(ours.trainer.state.best_model_checkpoint) == best_name
        assert best_name in expected
    for name in expected:
        statekit.verify(str(tmp_path / "sk" / name))  # committed statekit checkpoints


def test_save_total_limit_after_a_resume_deletes_the_resumed_checkpoint_as_trainer_does(tmp_path):
    """A run killed after its step-2 save and resumed to step 10 with save_total_limit=2: Trainer
    rotates the checkpoint it resumed from like any old one ({8, 10} left); statekit kept it
    too ({2, 8, 10}) while the resumed process ran."""
    kw = dict(max_steps=10, save_steps=2, save_total_limit=2)
    for name, plain in (("plain", True), ("sk", False)):
        tr.run(str(tmp_path / name), plain=plain, stop_at=3, **kw)  # killed after the step-2 save
        assert _folders(tmp_path / name) == ["checkpoint-2"]
        tr.run(str(tmp_path / name), plain=plain, resume=True, **kw)
    assert _folders(tmp_path / "sk") == _folders(tmp_path / "plain") == ["checkpoint-10", "checkpoint-8"]


@pytest.mark.parametrize("count", range(1, 7))
def test_the_rotation_rule_is_transformers_own(tmp_path, count):
    """trainer_keeps == transformers.trainer_utils.rotate_checkpoints on real folders: every
    limit, every best (none, each folder, one not on disk), 1 to 6 folders."""
    from transformers.trainer_utils import rotate_checkpoints

    from statekit_transformers.retention import trainer_keeps

    names = [f"checkpoint-{step}" for step in range(2, 2 * count + 1, 2)]
    for limit in range(1, 5):
        for best in [None, *names, "checkpoint-99"]:
            out = tmp_path / f"{limit}-{best}"
            for name in names:
                (out / name).mkdir(parents=True)
            rotate_checkpoints(str(out), save_total_limit=limit,
                               best_model_checkpoint=str(out / best) if best else None)
            assert trainer_keeps(names, limit, best) == set(_folders(out)), (limit, best)


def test_retention_keywords_in_statekit_options_keep_more_than_trainers_rule(tmp_path):
    """keep_every_n_steps=4 in statekit_options keeps checkpoint-4 on top of what
    save_total_limit=1 keeps (the newest); a retention= of its own replaces Trainer's rule;
    without a limit the fields given are the manager's retention."""
    tr.run(str(tmp_path / "more"), max_steps=8, save_steps=2, save_total_limit=1,
           statekit_options={"keep_every_n_steps": 4})
    assert _folders(tmp_path / "more") == ["checkpoint-4", "checkpoint-8"]
    tr.run(str(tmp_path / "own"), max_steps=8, save_steps=2, save_total_limit=1,
           statekit_options={"retention": statekit.RetentionPolicy(keep_last=3)})
    assert _folders(tmp_path / "own") == ["checkpoint-4", "checkpoint-6", "checkpoint-8"]
    tr.run(str(tmp_path / "alone"), max_steps=8, save_steps=2,  # no save_total_limit: the only retention
           statekit_options={"keep_last": 1, "keep_every_n_steps": 4})
    assert _folders(tmp_path / "alone") == ["checkpoint-4", "checkpoint-8"]


def test_a_trainer_checkpoint_exports_as_a_sharded_from_pretrained_folder(tmp_path):
    """``statekit.export_pretrained`` of ``checkpoint-<step>/`` (this plugin's
    ``STATEKIT_EXPORT_SOURCE``): the weights resharded, config, generation config and the
    tokenizer's files as Trainer wrote them; ``from_pretrained`` loads the trained model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    result = tr.run(str(tmp_path), max_steps=3, save_steps=3)
    path = str(tmp_path / "checkpoint-3")
    out = tmp_path / "hf"
    exported = statekit.export_pretrained(path, str(out), max_shard_size="20KB")
    names = files_of(out)
    assert "model.safetensors.index.json" in names and "config.json" in names and "tokenizer.json" in names
    assert "generation_config.json" in names and not any(n.endswith((".pt", ".bin")) for n in names)
    assert exported.digests_compared == exported.tensors  # the weights Trainer's folder holds, by their state-dict paths
    for name in ("config.json", "tokenizer.json"):
        assert (out / name).read_bytes() == (tmp_path / "checkpoint-3" / name).read_bytes()
    model = AutoModelForCausalLM.from_pretrained(str(out))
    live = result.trainer.model.state_dict()
    assert model.state_dict().keys() == live.keys()
    for name, value in model.state_dict().items():
        assert torch.equal(value, live[name]), name
    assert model.lm_head.weight is model.transformer.wte.weight
    assert AutoTokenizer.from_pretrained(str(out)).mask_token == "[MASK]"


def test_a_trainer_checkpoint_of_a_peft_model_exports_as_its_adapter_folder(tmp_path):
    """A peft model's Trainer folder: ``adapter_config.json`` as Trainer wrote it and the
    adapter's tensors in one ``adapter_model.safetensors`` (peft reads no shards), whatever
    ``max_shard_size``; ``PeftModel.from_pretrained`` loads the trained adapter."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tr.gpt2(), peft.LoraConfig(r=4, target_modules=["c_attn"]))
    result = tr.run(str(tmp_path), model=model, max_steps=3, save_steps=3)
    out = tmp_path / "adapter"
    statekit.export_pretrained(str(tmp_path / "checkpoint-3"), str(out), max_shard_size=1000)
    assert "adapter_model.safetensors" in files_of(out) and "adapter_config.json" in files_of(out)
    assert not any(n.startswith("model") for n in files_of(out))
    assert (out / "adapter_config.json").read_bytes() == (tmp_path / "checkpoint-3" / "adapter_config.json").read_bytes()
    loaded = peft.PeftModel.from_pretrained(tr.gpt2(), str(out))
    live = peft.get_peft_model_state_dict(result.trainer.model)
    exported = peft.get_peft_model_state_dict(loaded)
    assert exported.keys() == live.keys()
    assert all(torch.equal(v, live[k]) for k, v in exported.items())
    with pytest.raises(statekit.InvalidOptionError, match="holds a LoRA adapter only .* not its base"):
        statekit.export_pretrained(str(tmp_path / "checkpoint-3"), str(tmp_path / "merged"), merge_adapter=True)
