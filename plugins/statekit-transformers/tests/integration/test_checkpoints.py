"""What a Trainer user relies on in ``checkpoint-<step>/`` keeps working, and the folder is a
statekit checkpoint: manifest, checksums, no pickle (the behaviours of transformers'
tests/trainer checkpoint tests, which its published sdist does not ship: written here as
Trainer users write them)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

import statekit
import trainer_runs as tr

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl")


def files_of(path):
    return sorted(os.listdir(path))


def test_a_checkpoint_is_a_statekit_checkpoint_in_trainers_layout(tmp_path):
    tr.run(str(tmp_path), max_steps=3)
    path = tmp_path / "checkpoint-3"
    names = files_of(path)
    assert "statekit.json" in names
    assert not [n for n in names if n.endswith(PICKLE_SUFFIXES)], names
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "trainer_state.json",
                 "training_args.json"):
        assert name in names, name
    manifest = statekit.verify(str(path))  # every file: size and checksum
    assert manifest.step == 3
    listed = set(manifest.files)
    for name in ("config.json", "model.safetensors", "trainer_state.json", "training_args.json", "tokenizer.json"):
        assert name in listed, name
    assert json.loads((path / "training_args.json").read_text())["save_steps"] == 3


def test_load_best_model_at_end(tmp_path):
    """The best checkpoint by eval loss is kept past save_total_limit and loaded at the end;
    as Trainer, the best counts in the limit: the best and the newest are the two kept
    (every save_total_limit, best old or newest: unit/test_trainer_checkpoints.py)."""
    result = tr.run(
        str(tmp_path), eval_dataset=tr.Sentences(n=8, seed=5), eval_strategy="steps", eval_steps=3,
        load_best_model_at_end=True, metric_for_best_model="loss", save_total_limit=2,
    )
    state = result.trainer.state
    best = state.best_model_checkpoint
    assert best is not None and os.path.isdir(best)
    evals = {e["step"]: e["eval_loss"] for e in state.log_history if "eval_loss" in e}
    assert os.path.basename(best) == f"checkpoint-{min(evals, key=evals.get)}"
    saved = statekit.load(best, {"model": tr.gpt2()}, transformers_trainer=result.trainer)
    assert saved.step == int(best.rsplit("-", 1)[1])
    from transformers import AutoModelForCausalLM

    best_weights = AutoModelForCausalLM.from_pretrained(best).state_dict()
    for name, value in result.trainer.model.state_dict().items():
        assert torch.equal(value, best_weights[name]), name
    kept = sorted(n for n in files_of(tmp_path) if n.startswith("checkpoint-"))
    newest_two = {"checkpoint-12", "checkpoint-15"}
    assert kept == sorted(newest_two if os.path.basename(best) in newest_two else {os.path.basename(best), "checkpoint-15"})


def test_a_trainer_checkpoint_from_before_the_plugin_resumes_and_is_not_rewritten(tmp_path):
    """Trainer's own pickled checkpoint-6 resumes through Trainer's code; it is read, never
    rewritten, and the checkpoints after it are statekit's."""
    tr.run(str(tmp_path), stop_at=8, plain=True)
    legacy = tmp_path / "checkpoint-6"
    before = {n: (legacy / n).read_bytes() for n in files_of(legacy)}
    assert "optimizer.pt" in before and "statekit.json" not in before
    resumed = tr.run(str(tmp_path), resume=True)
    assert resumed.losses[0][0] == 6
    assert {n: (legacy / n).read_bytes() for n in files_of(legacy)} == before
    assert "statekit.json" in files_of(tmp_path / "checkpoint-9")


def test_an_interrupted_save_is_not_resumed(tmp_path):
    """A checkpoint-<n> statekit never committed (its save lock, no manifest) is passed over by
    resume_from_checkpoint=True and refused when named."""
    tr.run(str(tmp_path), stop_at=8)
    broken = tmp_path / "checkpoint-8"
    shutil.copytree(tmp_path / "checkpoint-6", broken)
    (broken / "statekit.json").unlink()
    (broken / ".statekit-lock").write_text("{}")
    resumed = tr.run(str(tmp_path), resume=True, max_steps=7)
    assert resumed.losses[0][0] == 6
    with pytest.raises(statekit.IncompleteCheckpointError, match="checkpoint-8"):
        tr.run(str(tmp_path), resume=str(broken))


def test_resume_from_checkpoint_false_and_a_pathlib_path(tmp_path, reference):
    """``False`` trains from scratch (as Trainer); a ``pathlib.Path`` resumes like a ``str``."""
    fresh = tr.run(str(tmp_path / "a"), resume=False, max_steps=3)
    assert fresh.losses == [entry for entry in reference.losses if entry[0] < 3]
    tr.run(str(tmp_path / "b"), stop_at=5)
    resumed = tr.run(str(tmp_path / "b"), resume=tmp_path / "b" / "checkpoint-3")
    assert resumed.losses == [entry for entry in reference.losses if entry[0] >= 3]


@pytest.mark.parametrize("change", [{"per_device_train_batch_size": 3}, {"gradient_accumulation_steps": 1}])
def test_changed_batch_settings_warn_and_resume(tmp_path, change):
    """A changed batch size or accumulation: the warning names it; Trainer's own skip then runs."""
    tr.run(str(tmp_path), stop_at=8)
    (name, value), = change.items()
    with pytest.warns(statekit.StatekitWarning, match=f"{name} .* -> {value}.*not exact"):
        resumed = tr.run(str(tmp_path), resume=True, **change)
    assert resumed.losses and resumed.losses[0][0] == 6


def test_a_changed_dataset_length_restarts_the_epoch_and_warns(tmp_path):
    tr.run(str(tmp_path), stop_at=8)
    with pytest.warns(statekit.StatekitWarning, match="restarts .*dataset's length changed.*not exact"):
        resumed = tr.run(str(tmp_path), resume=True, dataset=tr.Sentences(n=36))
    assert resumed.losses[0][0] == 6
