"""The Accelerate bridge: save_state/load_state, attach, the Accelerate-format reader."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

import statekit
import statekit.foreign.accelerate_convert
from statekit.testing import assert_state_equal

from accelerate_helpers import build, train_steps

pytest.importorskip("accelerate")


def test_save_state_load_state_round_trip(storage_url, installed_plugin_manager):
    run = build(seed=1)
    accelerator, model, optimizer, loader, scheduler, counter = run
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    accelerator.scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
    train_steps(run, 5)
    accelerator.step = 7
    manifest = statekit.save_state(accelerator, storage_url, step=5)
    assert set(manifest.objects) == {
        "model_0", "optimizer_0", "scheduler_0", "dataloader_0", "custom_0", "scaler", "accelerator"}
    assert "model_0.safetensors" in manifest.files and manifest.plugins["rng"]

    other = build(seed=2)
    acc2, model2, opt2, loader2, sched2, counter2 = other
    acc2.scaler = torch.amp.GradScaler("cpu", init_scale=2.0)
    statekit.load_state(acc2, storage_url)
    assert_state_equal(model2.state_dict(), model.state_dict())
    assert_state_equal(opt2.state_dict(), optimizer.state_dict())
    assert sched2.state_dict() == scheduler.state_dict()
    assert counter2.state_dict() == counter.state_dict()
    assert acc2.scaler.state_dict() == accelerator.scaler.state_dict()
    assert acc2.step == 7


def test_plugin_taking_a_model_keeps_other_file_names(tmp_path, plugin_manager):
    class TakeFirst:
        @statekit.hookimpl
        def statekit_save_state_pre(self, models, weights, checkpoint):
            i = next(i for i, m in enumerate(models) if checkpoint.key_of(m) == "model_0")
            models.pop(i)
            weights.pop(i)
            checkpoint.save_tensors("mine/weights.safetensors", {"w": torch.zeros(1)})

        @statekit.hookimpl
        def statekit_load_state_pre(self, models, checkpoint):
            models[:] = [m for m in models if checkpoint.key_of(m) != "model_0"]

    plugin_manager.register(TakeFirst(), name="takefirst")
    run = build()
    accelerator = run[0]
    second = accelerator.prepare(torch.nn.Linear(2, 2))
    manifest = statekit.save_state(accelerator, str(tmp_path / "c"))
    assert "model_0.safetensors" not in manifest.files
    assert "model_1.safetensors" in manifest.files
    assert manifest.objects["model_0"].owner == "takefirst"
    assert manifest.files["mine/weights.safetensors"].writer == "takefirst"
    with torch.no_grad():
        second.weight.add_(1)
    saved = statekit.load_state(accelerator, str(tmp_path / "c"))
    assert saved.step is None
    assert len(accelerator._models) == 2  # the bridge never removes models from the Accelerator


def test_attach_runs_plugins_around_accelerator_save_state(tmp_path, plugin_manager):
    calls = []

    class Recorder:
        @statekit.hookimpl
        def statekit_attach(self, accelerator, objects):
            calls.append(("attach", sorted(objects)))

        @statekit.hookimpl
        def statekit_save_state_pre(self, models, weights, output_dir, checkpoint):
            calls.append(("save_pre", len(models), output_dir))
            models.pop(0)
            weights.pop(0)
            checkpoint.save_json("recorder.json", {"n": 1})
            checkpoint.records["seen"] = True

        @statekit.hookimpl
        def statekit_save_state_post(self, models, output_dir, checkpoint):
            calls.append(("save_post", os.path.exists(os.path.join(output_dir, "statekit.json"))))

        @statekit.hookimpl
        def statekit_load_state_pre(self, models, input_dir, checkpoint):
            calls.append(("load_pre", checkpoint.records.get("seen")))
            models.pop(0)

        @statekit.hookimpl
        def statekit_load_state_post(self, models, input_dir, checkpoint):
            calls.append(("load_post",))

    plugin_manager.register(Recorder(), name="recorder")
    run = build()
    accelerator = run[0]
    handle = statekit.attach(accelerator)
    assert statekit.attach(accelerator) is handle  # idempotent
    train_steps(run, 3)
    target = str(tmp_path / "acc")
    accelerator.save_state(target)
    assert len(accelerator._models) == 1
    names = set(os.listdir(target))
    assert "model.safetensors" not in names  # the plugin took the only model
    assert {"statekit.json", "recorder.json", "optimizer.bin"} <= names
    manifest = statekit.format.manifest.read_manifest(statekit.storage.Storage(target))
    assert manifest.files["recorder.json"].writer == "recorder"
    assert manifest.files["optimizer.bin"].writer == "accelerate"
    statekit.verify(target)
    accelerator.load_state(target)
    assert [c[0] for c in calls] == ["attach", "save_pre", "save_post", "load_pre", "load_post"]
    assert calls[1] == ("save_pre", 1, target) and calls[2] == ("save_post", True) and calls[3] == ("load_pre", True)
    handle.remove()
    assert "save_state" not in accelerator.__dict__


def _accelerate_dir(tmp_path):
    run = build(seed=3)
    train_steps(run, 4)
    target = str(tmp_path / "accelerate-format")
    run[0].save_state(target)
    return run, target


def test_accelerate_format_needs_allow_pickle(tmp_path, installed_plugin_manager):
    run, target = _accelerate_dir(tmp_path)
    other = build(seed=4)
    before = {k: v.clone() for k, v in other[1].state_dict().items()}
    with pytest.raises(statekit.PickleNotAllowedError, match=r"optimizer\.bin.*allow_pickle=True"):
        statekit.load_state(other[0], target)
    assert_state_equal(other[1].state_dict(), before)  # refused before anything was loaded


def test_accelerate_format_loads_with_allow_pickle(tmp_path, installed_plugin_manager):
    run, target = _accelerate_dir(tmp_path)
    other = build(seed=4)
    summary = statekit.load_state(other[0], target, allow_pickle=True)
    assert isinstance(summary, statekit.ForeignSummary) and summary.format == "accelerate"
    assert summary.objects["optimizer_0"] == statekit.ForeignObject("optimizer", "optimizer.bin")
    assert_state_equal(other[1].state_dict(), run[1].state_dict())
    assert_state_equal(other[2].state_dict(), run[2].state_dict())
    assert other[5].state_dict() == run[5].state_dict()


def test_malicious_pickle_never_runs(tmp_path, installed_plugin_manager):
    run, target = _accelerate_dir(tmp_path)
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    with open(os.path.join(target, "custom_checkpoint_0.pkl"), "wb") as f:
        pickle.dump(Payload(), f)
    other = build(seed=4)
    with pytest.raises(statekit.PickleNotAllowedError):
        statekit.load_state(other[0], target)
    with pytest.raises(statekit.PickleNotAllowedError):
        statekit.foreign.accelerate_convert.convert(target, str(tmp_path / "converted"))
    assert not marker.exists()


def test_convert_accelerate_directory(tmp_path, installed_plugin_manager):
    run, target = _accelerate_dir(tmp_path)
    out = str(tmp_path / "converted")
    manifest = statekit.foreign.accelerate_convert.convert(target, out, allow_pickle=True)
    assert {"model_0", "optimizer_0", "scheduler_0", "custom_0"} <= set(manifest.objects)
    statekit.verify(out)
    model = build(seed=5)[1]
    statekit.load(out, {"model_0": model})
    assert_state_equal(model.state_dict(), run[1].state_dict())
