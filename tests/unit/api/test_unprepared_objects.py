"""Objects a save or a resume leaves out end in a named warning, never a silent fresh or
half-restored run: nothing prepared, a saved model, optimizer or scheduler the resuming run
did not prepare (attach mode, ``load_state``, ``CheckpointManager.resume``, mapping loads)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import statekit

pytest.importorskip("accelerate")

from accelerate_helpers import fresh_accelerator, prepared_linear  # noqa: E402


def test_save_and_resume_with_nothing_prepared_warn_naming_prepare(tmp_path, installed_plugin_manager):
    accelerator = fresh_accelerator()
    manager = statekit.CheckpointManager(accelerator, str(tmp_path / "run"))
    with pytest.warns(statekit.StatekitWarning, match=r"holds no model.*only its step counters are saved.*accelerator\.prepare\(") as caught:
        manager.save(100)
    assert caught[0].filename == __file__  # points at the user's line, not statekit's

    resumed = statekit.CheckpointManager(fresh_accelerator(), str(tmp_path / "run"))
    with pytest.warns(statekit.StatekitWarning, match=r"only its step counters are loaded.*accelerator\.prepare\(") as caught:
        assert resumed.resume() == 100
    assert caught[0].filename == __file__


def test_a_prepared_run_saves_without_that_warning(tmp_path, installed_plugin_manager):
    accelerator, _ = prepared_linear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", statekit.StatekitWarning)
        statekit.save_state(accelerator, str(tmp_path / "ckpt"))
        statekit.load_state(accelerator, str(tmp_path / "ckpt"))


def test_resume_names_a_saved_scheduler_the_run_did_not_prepare(tmp_path, installed_plugin_manager):
    accelerator, _ = prepared_linear(True)
    statekit.CheckpointManager(accelerator, str(tmp_path / "run")).save(5)

    accelerator, (model, optimizer) = prepared_linear(False)  # forgot the scheduler
    manager = statekit.CheckpointManager(accelerator, str(tmp_path / "run"))
    with pytest.warns(statekit.ResumeFingerprintWarning, match=r"scheduler_0 \(scheduler\) is not restored.*accelerator\.prepare\(\)") as caught:
        assert manager.resume() == 5
    assert caught[0].filename == __file__

    accelerator, _ = prepared_linear(False)
    manager = statekit.CheckpointManager(accelerator, str(tmp_path / "run"))
    with pytest.raises(statekit.ResumeMismatchError, match=r"scheduler_0 \(scheduler\) is not restored"):
        manager.resume(strict_resume=True)


def test_load_state_names_a_saved_model_and_optimizer_left_behind(tmp_path, installed_plugin_manager):
    accelerator, _ = prepared_linear(True)
    statekit.save_state(accelerator, str(tmp_path / "ckpt"))

    accelerator = fresh_accelerator()
    loader = accelerator.prepare(torch.utils.data.DataLoader(list(range(8)), batch_size=2))
    assert loader is not None
    with pytest.warns(statekit.ResumeFingerprintWarning, match=r"model_0 \(model\), optimizer_0 \(optimizer\), scheduler_0 \(scheduler\) are not restored"):
        statekit.load_state(accelerator, str(tmp_path / "ckpt"), strict=False)


def test_attached_save_state_names_an_optimizer_not_prepared_at_load(tmp_path, installed_plugin_manager):
    accelerator, _ = prepared_linear(False)
    statekit.attach(accelerator)
    accelerator.save_state(str(tmp_path / "ckpt"))
    assert "objects" in json.loads((tmp_path / "ckpt" / "statekit.json").read_text())["fingerprint"]

    accelerator = fresh_accelerator()
    accelerator.prepare(torch.nn.Linear(4, 2))
    statekit.attach(accelerator)
    with pytest.warns(statekit.ResumeFingerprintWarning, match=r"optimizer_0 \(optimizer\) is not restored"):
        accelerator.load_state(str(tmp_path / "ckpt"))


def test_mapping_load_names_a_saved_object_left_out(tmp_path, installed_plugin_manager):
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    statekit.save(str(tmp_path / "ckpt"), {"model": model, "optim": optimizer, "sched": scheduler})
    with pytest.warns(statekit.ResumeFingerprintWarning, match=r"sched \(scheduler\) is not restored"):
        statekit.load(str(tmp_path / "ckpt"), {"model": model, "optim": optimizer})
    with warnings.catch_warnings():  # weights alone are not a resume: nothing to say
        warnings.simplefilter("error", statekit.StatekitWarning)
        statekit.load(str(tmp_path / "ckpt"), {"model": model})
