"""A load given the wrong targets says what is wrong: a wrong key names the keys the
checkpoint holds, an object of another kind is a kind mismatch (not corruption), and a
manager root or a folder of (Accelerate) checkpoints is named for what it is."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import statekit

pytest.importorskip("accelerate")

from accelerate_helpers import fresh_accelerator  # noqa: E402





def _saved(tmp_path):
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    url = str(tmp_path / "ckpt")
    statekit.save(url, {"model": model, "optim": optimizer})
    return url, model, optimizer


def test_a_wrong_key_names_the_keys_the_checkpoint_holds(tmp_path, installed_plugin_manager):
    url, model, _ = _saved(tmp_path)
    with pytest.raises(statekit.StateMismatchError, match=r"missing keys: wrong; the checkpoint holds no object under that key \(it holds: model, optim\): pass each object under the key it was saved with") as info:
        statekit.load(url, {"wrong": model})
    assert info.value.missing == ["wrong"]
    assert "state of checkpoint" not in str(info.value)


def test_an_optimizer_given_for_a_model_key_is_a_kind_mismatch_not_corruption(tmp_path, installed_plugin_manager):
    url, model, optimizer = _saved(tmp_path)
    fresh = torch.nn.Linear(4, 2)
    before = fresh.weight.detach().clone()
    with pytest.raises(statekit.StateMismatchError, match=r"'model' .*nothing was loaded.*saved a model under 'model', and an optimizer \(SGD\) was given for it: pass the model under 'model'"):
        statekit.load(url, {"model": optimizer})
    with pytest.raises(statekit.StateMismatchError, match=r"saved an optimizer under 'optim', and a model \(Linear\) was given for it"):
        statekit.load(url, {"model": fresh, "optim": fresh})
    assert torch.equal(fresh.weight, before)


def test_loading_a_manager_root_or_a_folder_of_checkpoints_says_what_it_is(tmp_path, installed_plugin_manager):
    model = torch.nn.Linear(4, 2)
    manager = statekit.CheckpointManager({"model": model}, str(tmp_path / "runs" / "exp1"))
    manager.save(100)
    manager.save(200)
    with pytest.raises(statekit.IncompleteCheckpointError, match=r"exp1 is a checkpoint root, not a checkpoint.*'checkpoint-00000200'.*CheckpointManager\(\.\.\.\)\.resume\(\)"):
        statekit.load(str(tmp_path / "runs" / "exp1"), {"model": model})
    with pytest.raises(statekit.IncompleteCheckpointError, match=r"runs is a folder of checkpoint roots, not a checkpoint: it holds 'exp1'") as info:
        statekit.load(str(tmp_path / "runs"), {"model": model})
    assert "never committed" not in str(info.value)

    statekit.save(str(tmp_path / "saves" / "step-1"), {"model": model})
    with pytest.raises(statekit.IncompleteCheckpointError, match=r"saves is a folder of checkpoints, not a checkpoint: it holds 'step-1'; load one of them"):
        statekit.load(str(tmp_path / "saves"), {"model": model})

    (tmp_path / "other" / "notes").mkdir(parents=True)
    with pytest.raises(statekit.IncompleteCheckpointError, match=r"other is not a checkpoint: it has no statekit.json and none of the files a save writes"):
        statekit.load(str(tmp_path / "other"), {"model": model})


def test_loading_a_folder_of_accelerate_checkpoints_names_them(tmp_path, installed_plugin_manager):
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    fresh_accelerator()
    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True))
    model = accelerator.prepare(torch.nn.Linear(4, 2))
    accelerator.save_state()
    accelerator.save_state()
    with pytest.raises(statekit.IncompleteCheckpointError, match=r"checkpoints is a folder of Accelerate checkpoints, not a checkpoint: it holds 2 \(the last 'checkpoint_1'\)"):
        statekit.load_state(accelerator, str(tmp_path / "checkpoints"))
    assert model is not None
