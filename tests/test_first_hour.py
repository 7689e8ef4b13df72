"""A newcomer's first-hour mistakes end in a named warning or error, never a silent fresh
or half-restored run (issue 27, section 4): nothing prepared, objects the resuming run
did not prepare, a missing bucket, a manager root that is a checkpoint."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import statekit

pytest.importorskip("accelerate")

from accelerate_helpers import fresh_accelerator  # noqa: E402


def _prepared(with_scheduler: bool = False):
    accelerator = fresh_accelerator()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    objects = [model, optimizer]
    if with_scheduler:
        objects.append(torch.optim.lr_scheduler.StepLR(optimizer, step_size=1))
    return accelerator, accelerator.prepare(*objects)


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
    accelerator, _ = _prepared()
    with warnings.catch_warnings():
        warnings.simplefilter("error", statekit.StatekitWarning)
        statekit.save_state(accelerator, str(tmp_path / "ckpt"))
        statekit.load_state(accelerator, str(tmp_path / "ckpt"))


def test_resume_names_a_saved_scheduler_the_run_did_not_prepare(tmp_path, installed_plugin_manager):
    accelerator, _ = _prepared(True)
    statekit.CheckpointManager(accelerator, str(tmp_path / "run")).save(5)

    accelerator, (model, optimizer) = _prepared(False)  # forgot the scheduler
    manager = statekit.CheckpointManager(accelerator, str(tmp_path / "run"))
    with pytest.warns(statekit.ResumeFingerprintWarning, match=r"scheduler_0 \(scheduler\) is not restored.*accelerator\.prepare\(\)") as caught:
        assert manager.resume() == 5
    assert caught[0].filename == __file__

    accelerator, _ = _prepared(False)
    manager = statekit.CheckpointManager(accelerator, str(tmp_path / "run"))
    with pytest.raises(statekit.ResumeMismatchError, match=r"scheduler_0 \(scheduler\) is not restored"):
        manager.resume(strict_resume=True)


def test_load_state_names_a_saved_model_and_optimizer_left_behind(tmp_path, installed_plugin_manager):
    accelerator, _ = _prepared(True)
    statekit.save_state(accelerator, str(tmp_path / "ckpt"))

    accelerator = fresh_accelerator()
    loader = accelerator.prepare(torch.utils.data.DataLoader(list(range(8)), batch_size=2))
    assert loader is not None
    with pytest.warns(statekit.ResumeFingerprintWarning, match=r"model_0 \(model\), optimizer_0 \(optimizer\), scheduler_0 \(scheduler\) are not restored"):
        statekit.load_state(accelerator, str(tmp_path / "ckpt"), strict=False)


def test_attached_save_state_names_an_optimizer_not_prepared_at_load(tmp_path, installed_plugin_manager):
    accelerator, _ = _prepared(False)
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


def test_resume_on_a_missing_bucket_raises_naming_it(s3_server, installed_plugin_manager):
    pytest.importorskip("s3fs")
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = statekit.CheckpointManager({"model": model, "optim": optimizer}, "s3://statekit-no-such-bucket/run")
    with pytest.raises(statekit.StorageError, match=r"bucket 'statekit-no-such-bucket' does not exist") as caught:
        manager.resume()
    assert caught.value.url == "s3://statekit-no-such-bucket/run"


def test_resume_on_an_empty_existing_bucket_is_a_fresh_run(s3_bucket, installed_plugin_manager):
    model = torch.nn.Linear(4, 2)
    manager = statekit.CheckpointManager({"model": model}, f"{s3_bucket}/run")
    assert manager.resume() is None


def test_a_checkpoint_as_manager_root_is_refused(tmp_path, installed_plugin_manager):
    accelerator, _ = _prepared()
    statekit.save_state(accelerator, str(tmp_path / "ckpt"))
    with pytest.raises(statekit.InvalidOptionError, match=r"ckpt' is a statekit checkpoint \(it holds statekit.json\).*statekit.load_state"):
        statekit.CheckpointManager(accelerator, str(tmp_path / "ckpt"))
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("checkpoint")) == []


def test_an_accelerate_checkpoint_as_manager_root_is_refused(tmp_path, installed_plugin_manager):
    accelerator, _ = _prepared()
    accelerator.save_state(str(tmp_path / "acc"), safe_serialization=True)
    with pytest.raises(statekit.InvalidOptionError, match=r"acc' is a checkpoint written by Accelerator.save_state"):
        statekit.CheckpointManager(accelerator, str(tmp_path / "acc"))


def test_an_accelerate_checkpoints_folder_is_still_a_root(tmp_path, installed_plugin_manager):
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    fresh_accelerator()
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
    accelerator = Accelerator(cpu=True, project_config=config)
    model = torch.nn.Linear(4, 2)
    model = accelerator.prepare(model)
    accelerator.save_state()  # <project_dir>/checkpoints/checkpoint_0
    manager = statekit.CheckpointManager(accelerator, str(tmp_path / "checkpoints"), allow_pickle=True)
    assert manager.resume() == 0


# --------------------------------------------------------------------------- a plugin that fails to import

SOMETIMES_BROKEN = """
import os
from statekit import hookimpl

if os.environ.get("STATEKIT_TEST_BREAK_PLUGIN"):
    raise ImportError("needs torch 9")

@hookimpl
def statekit_save_state_pre(checkpoint):
    checkpoint.save_json("extra/mine.json", {"saved": True})
"""


@pytest.fixture
def plugin_site(tmp_path, monkeypatch):
    from test_plugins import PluginSite

    return PluginSite(tmp_path / "site", monkeypatch)


def _rebuilt(plugin_site, monkeypatch, module, broken):
    import sys

    from statekit.hooks import registry

    if broken:
        monkeypatch.setenv("STATEKIT_TEST_BREAK_PLUGIN", "1")
    else:
        monkeypatch.delenv("STATEKIT_TEST_BREAK_PLUGIN", raising=False)
    monkeypatch.delitem(sys.modules, module, raising=False)
    registry.reset_plugin_manager()


def test_a_broken_plugin_warns_at_save_and_its_checkpoints_refuse_to_load(plugin_site, monkeypatch, tmp_path):
    from statekit.hooks import registry

    module = plugin_site.add("mine", SOMETIMES_BROKEN)
    monkeypatch.setattr(registry, "_manager", None)  # restored after the test
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "optim": optimizer}
    statekit.save(str(tmp_path / "written-by-mine"), state)

    _rebuilt(plugin_site, monkeypatch, module, broken=True)
    with pytest.warns(statekit.StatekitWarning, match=r"plugin 'mine' .*failed to import: ImportError: needs torch 9.*do NOT hold its state.*STATEKIT_DISABLE_PLUGINS=mine") as caught:
        statekit.save(str(tmp_path / "without-mine"), state)  # saves, loudly without its state
    assert caught[0].filename == __file__
    statekit.load(str(tmp_path / "without-mine"), state)  # nothing of it there: loads
    before = model.weight.detach().clone()
    with pytest.raises(statekit.PluginError, match=r"written-by-mine holds state written by plugin 'mine' \(extra/mine.json\).*failed to import: ImportError: needs torch 9.*nothing was loaded") as info:
        statekit.load(str(tmp_path / "written-by-mine"), state)
    assert info.value.plugin_name == "mine"
    assert torch.equal(model.weight, before)


def test_an_attached_load_of_a_folder_a_broken_plugin_wrote_fails_naming_it(plugin_site, monkeypatch, tmp_path):
    from statekit.hooks import registry

    module = plugin_site.add("mine", SOMETIMES_BROKEN)
    monkeypatch.setattr(registry, "_manager", None)
    accelerator, (model, optimizer) = _prepared()
    statekit.attach(accelerator)
    accelerator.save_state(str(tmp_path / "ckpt"))

    _rebuilt(plugin_site, monkeypatch, module, broken=True)
    accelerator, (model, optimizer) = _prepared()
    with pytest.warns(statekit.StatekitWarning, match=r"plugin 'mine'.*failed to import"):
        statekit.attach(accelerator)
    before = model.weight.detach().clone()
    with pytest.raises(statekit.PluginError, match=r"holds state written by plugin 'mine' \(extra/mine.json\)"):
        accelerator.load_state(str(tmp_path / "ckpt"))
    assert torch.equal(model.weight, before)


def test_statekit_plugins_lists_a_broken_plugin_and_exits_0(plugin_site, monkeypatch):
    from click.testing import CliRunner

    from statekit.cli import main
    from statekit.hooks import registry

    plugin_site.add("broken", "raise ImportError('needs torch 9')\n", version="0.0.1")
    plugin_site.add("good", "from statekit import hookimpl\n\n@hookimpl\ndef statekit_save_state_pre(checkpoint):\n    pass\n")
    monkeypatch.setattr(registry, "_manager", None)
    result = CliRunner().invoke(main, ["plugins"])
    assert result.exit_code == 0, result.output
    assert "broken (broken)" in result.output
    assert "good" in result.output
    assert "broken: broken failed to import: ImportError: needs torch 9" in result.output
    assert "STATEKIT_DISABLE_PLUGINS=broken" in result.output

    registry.reset_plugin_manager()
    result = CliRunner().invoke(main, ["plugins", "--json"])
    assert result.exit_code == 0
    rows = {r["name"]: r for r in json.loads(result.output)}
    assert rows["broken"]["broken"] == "ImportError: needs torch 9"
    assert rows["good"]["broken"] is None


# --------------------------------------------------------------------------- messages that say what is wrong


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
