"""Attach mode is transparent and the drop-in is faithful to Accelerate (issue 11's findings).

Each test is written the way a user of Accelerate would write the code, with the real
``accelerate.Accelerator``; the Accelerate conformance suite
(``test_accelerate_conformance.py``) runs Accelerate's own tests on top.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
import torch.nn.functional as F

import statekit
from statekit.testing import assert_state_equal

from accelerate_helpers import build, fresh_accelerator, train_steps

pytest.importorskip("accelerate")


def _project_accelerator(project_dir, total_limit=None):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import ProjectConfiguration

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    config = ProjectConfiguration(project_dir=str(project_dir), automatic_checkpoint_naming=True, total_limit=total_limit)
    return Accelerator(cpu=True, project_config=config)


def _prepared(accelerator, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(torch.arange(48.0).reshape(12, 4), batch_size=2, shuffle=True)
    return accelerator.prepare(model, optimizer, loader)


def test_automatic_naming_in_attach_mode_writes_inside_the_checkpoint(tmp_path, monkeypatch, installed_plugin_manager):
    monkeypatch.chdir(tmp_path)
    accelerator = _project_accelerator(tmp_path / "project")
    statekit.attach(accelerator)
    model, optimizer, loader = _prepared(accelerator)
    accelerator.save_state()
    accelerator.save_state()
    assert sorted(os.listdir(tmp_path)) == ["project"]  # nothing at ./None
    for n in (0, 1):
        folder = tmp_path / "project" / "checkpoints" / f"checkpoint_{n}"
        manifest = statekit.verify(str(folder))
        assert "dataloader_0/rank-00000.json" in manifest.files
        assert any(rel.startswith("rng/") for rel in manifest.files)
    assert accelerator.project_configuration.iteration == 2


def test_load_state_without_argument_reads_the_newest_checkpoint(tmp_path, monkeypatch, installed_plugin_manager):
    monkeypatch.chdir(tmp_path)
    accelerator = _project_accelerator(tmp_path / "project")
    statekit.attach(accelerator)
    model, optimizer, loader = _prepared(accelerator)
    accelerator.save_state()
    batches = iter(loader)
    next(batches), next(batches)
    accelerator.save_state()  # checkpoint_1: two batches in
    rest = [b.clone() for b in batches]

    other = _project_accelerator(tmp_path / "project")
    statekit.attach(other)
    _, _, loader2 = _prepared(other, seed=5)
    other.load_state()
    got = list(loader2)
    assert len(got) == len(rest) and all(torch.equal(a, b) for a, b in zip(got, rest))


def test_missing_statekit_file_refuses_before_accelerate_restores(tmp_path, installed_plugin_manager):
    accelerator = fresh_accelerator()
    statekit.attach(accelerator)
    model, optimizer, loader = _prepared(accelerator)
    accelerator.save_state(str(tmp_path / "c"))
    rng_file = next((tmp_path / "c" / "rng").iterdir())
    rng_file.unlink()

    other = fresh_accelerator()
    statekit.attach(other)
    model2, _, _ = _prepared(other, seed=3)
    before = {k: v.clone() for k, v in model2.state_dict().items()}
    with pytest.raises(statekit.CorruptCheckpointError, match=r"file is missing.*nothing was loaded"):
        other.load_state(str(tmp_path / "c"))
    assert_state_equal(model2.state_dict(), before)


@pytest.mark.parametrize("stateful", [False, True], ids=["default-loader", "stateful-loader"])
def test_attached_after_prepare_resumes_at_the_next_batch(tmp_path, stateful, installed_plugin_manager):
    run = build(seed=1, stateful=stateful, n=96, batch_size=8)
    accelerator, loader = run[0], run[3]
    statekit.attach(accelerator)
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    accelerator.save_state(str(tmp_path / "c"))
    rest = [y.tolist() for _, y in batches]
    assert len(rest) == 9

    run2 = build(seed=2, stateful=stateful, n=96, batch_size=8)
    statekit.attach(run2[0])
    run2[0].load_state(str(tmp_path / "c"))
    assert [y.tolist() for _, y in run2[3]] == rest


def test_compiled_model_in_attach_mode_loads_into_a_plain_model_and_back(tmp_path, installed_plugin_manager):
    accelerator = fresh_accelerator()
    statekit.attach(accelerator)
    torch.manual_seed(0)
    compiled = accelerator.prepare(torch.compile(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))))
    accelerator.save_state(str(tmp_path / "c"))
    from safetensors.torch import load_file

    assert all(k.startswith("_orig_mod.") for k in load_file(str(tmp_path / "c" / "model.safetensors")))  # Accelerate's file, untouched

    plain_acc = fresh_accelerator()
    plain = plain_acc.prepare(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1)))
    statekit.load_state(plain_acc, str(tmp_path / "c"), allow_pickle=True)
    assert_state_equal(plain.state_dict(), compiled._orig_mod.state_dict())

    statekit.save_state(plain_acc, str(tmp_path / "plain"))
    back_acc = fresh_accelerator()
    back = back_acc.prepare(torch.compile(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))))
    statekit.load_state(back_acc, str(tmp_path / "plain"))
    assert_state_equal(back._orig_mod.state_dict(), compiled._orig_mod.state_dict())

    from statekit.foreign.accelerate_convert import convert

    manifest = convert(str(tmp_path / "c"), str(tmp_path / "converted"), allow_pickle=True)
    assert "model_0.safetensors" in manifest.files
    assert not any(k.startswith("_orig_mod.") for k in load_file(str(tmp_path / "converted" / "model_0.safetensors")))


# --------------------------------------------------------------------------- drop-in


def test_load_state_keeps_iteration_and_naming_continues(tmp_path, installed_plugin_manager):
    accelerator = _project_accelerator(tmp_path / "project")
    _prepared(accelerator)
    manager = statekit.CheckpointManager(accelerator, str(tmp_path / "project" / "checkpoints"))
    manager.save()
    manager.save()
    assert [i.step for i in manager.list()] == [0, 1]
    assert accelerator.project_configuration.iteration == 2
    statekit.load_state(accelerator, manager.url_for(0))
    assert accelerator.project_configuration.iteration == 2  # as Accelerator.load_state: left alone
    manager.save()  # no CheckpointExistsError: the next name
    assert [i.step for i in manager.list()] == [0, 1, 2]

    fresh = _project_accelerator(tmp_path / "project")
    _prepared(fresh)
    again = statekit.CheckpointManager(fresh, str(tmp_path / "project" / "checkpoints"))
    assert again.resume() == 2
    again.save()  # a new process continues after the highest existing checkpoint
    assert [i.step for i in again.list()] == [0, 1, 2, 3]


def _diffusers_style_hooks(accelerator, calls):
    """The save_model_hook/load_model_hook pair of diffusers' training scripts, unchanged in shape."""

    def save_model_hook(models, weights, output_dir):
        calls.append(("save", len(models), len(weights), output_dir))
        if accelerator.is_main_process:
            for model in models:
                os.makedirs(os.path.join(output_dir, "net"), exist_ok=True)
                torch.save(accelerator.unwrap_model(model).state_dict(), os.path.join(output_dir, "net", "weights.pt"))
                weights.pop()

    def load_model_hook(models, input_dir):
        calls.append(("load", len(models), input_dir))
        for _ in range(len(models)):
            model = models.pop()
            state = torch.load(os.path.join(input_dir, "net", "weights.pt"), weights_only=True)
            accelerator.unwrap_model(model).load_state_dict(state)

    accelerator.register_save_state_pre_hook(save_model_hook)
    accelerator.register_load_state_pre_hook(load_model_hook)


def test_registered_accelerate_hooks_run_under_save_state_and_load_state(tmp_path, installed_plugin_manager):
    calls: list = []
    accelerator = fresh_accelerator()
    _diffusers_style_hooks(accelerator, calls)
    model, optimizer, loader = _prepared(accelerator)
    url = str(tmp_path / "c")
    manifest = statekit.save_state(accelerator, url)
    assert calls == [("save", 1, 1, url)]
    assert "model_0.safetensors" not in manifest.files  # the hook took the model
    assert manifest.objects["model_0"].owner == "accelerate-hooks"
    assert manifest.files["net/weights.pt"].writer == "accelerate-hooks"
    statekit.verify(url)

    other = fresh_accelerator()
    calls2: list = []
    _diffusers_style_hooks(other, calls2)
    model2, optimizer2, _ = _prepared(other, seed=9)
    statekit.load_state(other, url)
    assert calls2 == [("load", 1, url)]
    assert_state_equal(model2.state_dict(), model.state_dict())
    assert_state_equal(optimizer2.state_dict(), optimizer.state_dict())

    bare = fresh_accelerator()
    _prepared(bare)
    with pytest.raises(statekit.PluginError, match="register_load_state_pre_hook"):
        statekit.load_state(bare, url)


def test_registered_hooks_refuse_remote_urls_before_writing(installed_plugin_manager):
    accelerator = fresh_accelerator()
    _diffusers_style_hooks(accelerator, [])
    _prepared(accelerator)
    with pytest.raises(statekit.PluginError, match="only for checkpoints on local disk"):
        statekit.save_state(accelerator, "memory://hooks/c")
    assert not os.path.exists("memory:")


# --------------------------------------------------------------------------- migration


def _accelerate_project(tmp_path, saves=2):
    """An Accelerate run with automatic naming, saved ``saves`` times; returns (run, losses)."""
    run = build(seed=4, stateful=True)
    accelerator = run[0]
    accelerator.project_configuration.project_dir = str(tmp_path / "project")
    accelerator.project_configuration.automatic_checkpoint_naming = True
    for _ in range(saves):
        train_steps(run, 3)
        accelerator.save_state()
    return run


def test_manager_resumes_an_accelerate_project_root(tmp_path, installed_plugin_manager):
    _accelerate_project(tmp_path)
    root = str(tmp_path / "project" / "checkpoints")
    run = build(seed=8, stateful=True)
    manager = statekit.CheckpointManager(run[0], root)
    with pytest.raises(statekit.PickleNotAllowedError, match="checkpoint_1"):
        manager.resume()  # never a silent fresh start

    reference = build(seed=8, stateful=True)
    statekit.attach(reference[0])  # the same data-loader generators as the manager's run
    reference[0].load_state(os.path.join(root, "checkpoint_1"))
    run = build(seed=8, stateful=True)
    manager = statekit.CheckpointManager(run[0], root, allow_pickle=True)
    assert manager.resume() == 1
    assert_state_equal(run[1].state_dict(), reference[1].state_dict())
    assert_state_equal(run[2].state_dict(), reference[2].state_dict())
    rng = torch.get_rng_state()  # both loads restored it; each run trains from it (dropout)
    losses = train_steps(run, 5)
    torch.set_rng_state(rng)
    assert losses == train_steps(reference, 5)
    manager.save()
    assert [(i.step, i.accelerate) for i in manager.list()] == [(0, True), (1, True), (2, False)]


def test_manager_skips_an_incomplete_accelerate_folder(tmp_path, installed_plugin_manager):
    _accelerate_project(tmp_path)
    root = tmp_path / "project" / "checkpoints"
    (root / "checkpoint_1" / "optimizer.bin").unlink()  # an Accelerate save killed midway
    run = build(seed=8, stateful=True)
    manager = statekit.CheckpointManager(run[0], str(root), allow_pickle=True)
    with pytest.warns(statekit.StatekitWarning, match="checkpoint_1"):
        assert manager.resume() == 0


def test_convert_then_load_restores_what_accelerate_restores(tmp_path, installed_plugin_manager):
    from statekit.foreign.accelerate_convert import convert

    source = build(seed=4, stateful=True)
    source[0].scaler = None
    loader_iter = iter(source[3])
    for _ in range(3):
        x, y = next(loader_iter)
        loss = F.cross_entropy(source[1](x), y)
        source[0].backward(loss)
        source[2].step(); source[4].step(); source[2].zero_grad()
    source[0].step = 11
    source[0].save_state(str(tmp_path / "acc"))
    manifest = convert(str(tmp_path / "acc"), str(tmp_path / "sk"), allow_pickle=True)
    assert not (tmp_path / "sk" / ".statekit-lock").exists()
    assert statekit.verify(str(tmp_path / "sk")).files == manifest.files
    assert manifest.world_size == 1

    # each load restores the global RNG, from which the loaders draw: read each run right after its load
    by_accelerate = build(seed=6, stateful=True)
    by_accelerate[0].load_state(str(tmp_path / "acc"))
    after_accelerate = (random.random(), torch.rand(3), [y.tolist() for _, y in by_accelerate[3]])
    by_statekit = build(seed=7, stateful=True)
    statekit.load_state(by_statekit[0], str(tmp_path / "sk"))
    after_statekit = (random.random(), torch.rand(3), [y.tolist() for _, y in by_statekit[3]])

    for i in (1, 2):
        assert_state_equal(by_statekit[i].state_dict(), by_accelerate[i].state_dict())
    assert by_statekit[4].state_dict() == by_accelerate[4].state_dict()
    assert by_statekit[5].state_dict() == by_accelerate[5].state_dict()
    assert by_statekit[0].step == by_accelerate[0].step == 11
    assert after_statekit[0] == after_accelerate[0] and torch.equal(after_statekit[1], after_accelerate[1])
    assert after_statekit[2] == after_accelerate[2] and len(after_statekit[2]) == 13 - 3  # the rest of the epoch


@pytest.mark.parametrize("fault", ["extra-key", "missing-key", "shape", "optimizer-groups", "custom-state"])
def test_failed_accelerate_load_leaves_every_object_untouched(tmp_path, fault, installed_plugin_manager):
    from safetensors.torch import load_file, save_file

    source = build(seed=4)
    train_steps(source, 3)
    source[0].save_state(str(tmp_path / "acc"))
    path = str(tmp_path / "acc" / "model.safetensors")
    tensors = load_file(path)
    if fault == "extra-key":
        tensors["fc3.weight"] = torch.zeros(2)
    elif fault == "missing-key":
        del tensors["fc2.bias"]
    elif fault == "shape":
        tensors["fc2.bias"] = torch.zeros(7)
    if fault in ("extra-key", "missing-key", "shape"):
        save_file(tensors, path, metadata={"format": "pt"})
    elif fault == "optimizer-groups":  # fails in the first object applied
        optim_path = tmp_path / "acc" / "optimizer.bin"
        state = torch.load(optim_path, weights_only=True)
        state["param_groups"].append({**state["param_groups"][0], "params": [99]})
        torch.save(state, optim_path)
    else:  # fails after the optimizer and the scheduler were applied: they are put back
        torch.save({"count": 3}, tmp_path / "acc" / "custom_checkpoint_0.pkl")

    target = build(seed=9)
    train_steps(target, 2)
    objects = {i: target[i].state_dict() for i in (1, 4, 5)}
    snapshot = {i: (dict(v) if i != 1 else {k: t.clone() for k, t in v.items()}) for i, v in objects.items()}
    optim_before = {k: {n: t.clone() for n, t in s.items()} for k, s in target[2].state_dict()["state"].items()}
    rng_before = (torch.get_rng_state(), random.getstate())
    with pytest.raises(statekit.StateMismatchError):
        statekit.load_state(target[0], str(tmp_path / "acc"), allow_pickle=True)
    assert_state_equal(target[1].state_dict(), snapshot[1])
    assert target[4].state_dict() == snapshot[4] and target[5].state_dict() == snapshot[5]
    assert_state_equal(target[2].state_dict()["state"], optim_before)
    assert torch.equal(torch.get_rng_state(), rng_before[0]) and random.getstate() == rng_before[1]


# --------------------------------------------------------------------------- review i11


@pytest.mark.parametrize("stateful", [False, True], ids=["default-loader", "stateful-loader"])
@pytest.mark.parametrize("how", ["load_state", "manager"])
def test_attached_checkpoint_loaded_by_the_dropin_resumes_at_the_next_batch(tmp_path, stateful, how, installed_plugin_manager):
    """Saved by an attached ``accelerator.save_state``; loaded by ``statekit.load_state`` or
    the manager on the project root: statekit's loader positions and statekit-rng's
    generators are restored, as attach mode's ``accelerator.load_state`` restores them."""
    run = build(seed=1, stateful=stateful, n=96, batch_size=8)
    statekit.attach(run[0])
    batches = iter(run[3])
    for _ in range(3):
        next(batches)
    target = tmp_path / "checkpoints" / "checkpoint_0"
    run[0].save_state(str(target))
    rest = [y.tolist() for _, y in batches]

    run2 = build(seed=2, stateful=stateful, n=96, batch_size=8)
    if how == "load_state":
        statekit.attach(run2[0])
        statekit.load_state(run2[0], str(target), allow_pickle=True)
    else:
        assert statekit.CheckpointManager(run2[0], str(tmp_path / "checkpoints"), allow_pickle=True).resume() == 0
    assert [y.tolist() for _, y in run2[3]] == rest


def test_attached_checkpoint_with_a_plugin_owned_model_loads_through_the_dropin(tmp_path, plugin_manager):
    class TakeFirst:
        @statekit.hookimpl
        def statekit_save_state_pre(self, models, weights, checkpoint):
            i = next(i for i, m in enumerate(models) if checkpoint.key_of(m) == "model_0")
            model = models.pop(i)
            weights.pop(i)
            checkpoint.save_tensors("mine/model_0.safetensors", dict(model.state_dict()))

        @statekit.hookimpl
        def statekit_load_state_pre(self, models, checkpoint):
            for model in [m for m in models if checkpoint.key_of(m) == "model_0"]:
                model.load_state_dict(checkpoint.load_tensors("mine/model_0.safetensors"))
                models.remove(model)

    plugin_manager.register(TakeFirst(), name="takefirst")

    def two_models(seed):
        accelerator = fresh_accelerator()
        torch.manual_seed(seed)
        first, second = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
        optimizer = torch.optim.SGD([*first.parameters(), *second.parameters()], lr=0.1)
        prepared = accelerator.prepare(first, second, optimizer)
        statekit.attach(accelerator)
        return prepared, accelerator

    (first, second, _), accelerator = two_models(0)
    accelerator.save_state(str(tmp_path / "c"))  # Accelerate writes model_1's weights as model.safetensors
    (first2, second2, _), accelerator2 = two_models(1)
    statekit.load_state(accelerator2, str(tmp_path / "c"), allow_pickle=True)
    assert_state_equal(first2.state_dict(), first.state_dict())
    assert_state_equal(second2.state_dict(), second.state_dict())


def test_hooks_registered_before_attach_after_prepare(tmp_path, installed_plugin_manager):
    """diffusers' scripts register their hooks before prepare(); the README allows attach
    after prepare(): statekit's hooks still see Accelerate's full lists."""
    accelerator = fresh_accelerator()
    _diffusers_style_hooks(accelerator, [])
    model, optimizer, loader = _prepared(accelerator)
    statekit.attach(accelerator)
    accelerator.save_state(str(tmp_path / "c"))
    assert "net/weights.pt" in statekit.verify(str(tmp_path / "c")).files
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.zero_()
    accelerator.load_state(str(tmp_path / "c"))
    assert_state_equal(model.state_dict(), expected)


@pytest.mark.parametrize("edit", ["replace", "in-place"])
def test_registered_hook_editing_a_weights_entry_is_saved_as_edited(tmp_path, edit, installed_plugin_manager):
    """Accelerate saves whatever a save pre-hook left in ``weights``; so does the drop-in."""
    accelerator = fresh_accelerator()

    def hook(models, weights, output_dir):
        if edit == "replace":
            weights[0] = {k: v.clone() for k, v in weights[0].items() if k != "bias"}
        else:
            del weights[0]["bias"]

    accelerator.register_save_state_pre_hook(hook)
    model, optimizer, loader = _prepared(accelerator)
    manifest = statekit.save_state(accelerator, str(tmp_path / "c"))
    assert manifest.objects["model_0"].owner == "statekit"
    from safetensors.torch import load_file

    assert set(load_file(str(tmp_path / "c" / "model_0.safetensors"))) == {"weight"}
    assert set(model.state_dict()) == {"weight", "bias"}  # the model itself is untouched


def test_attach_makes_accelerates_files_durable_before_the_commit(tmp_path, monkeypatch, installed_plugin_manager):
    synced: list[str] = []
    monkeypatch.setattr("statekit.storage.fs.fsync_path", synced.append)  # what Storage.make_durable calls
    accelerator = fresh_accelerator()
    statekit.attach(accelerator)
    _prepared(accelerator)
    accelerator.save_state(str(tmp_path / "c"))
    assert {"model.safetensors", "optimizer.bin"} <= {os.path.basename(p) for p in synced}
