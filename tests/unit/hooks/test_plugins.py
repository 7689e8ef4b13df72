"""The hook contract: one test per hook, claims and ownership, errors, RNG guard, discovery, env switches."""

from __future__ import annotations

import importlib
import inspect
import json
import os
import random
import signal
import sys
import textwrap
import uuid
import warnings
from importlib.metadata import entry_points

import numpy as np
import pluggy
import pytest
import torch
from torch import nn

import statekit
from statekit import format as fmt, hookimpl
from statekit.engine.entries import LazyStateDict
from statekit.hooks import hookspecs
from statekit.hooks import registry as plugins
from statekit.format.manifest import read_manifest
from statekit.storage import Storage
from statekit.engine.context import Checkpoint
from statekit.errors import PluginError, PluginMissingError, StatekitError, UnsupportedValueError
from statekit.storage import Storage
from statekit.testing import assert_state_equal

from plugin_helpers import PluginSite
from repo_paths import TESTS

pytestmark = pytest.mark.filterwarnings(
    "ignore:no installed plugin saves random-number-generator state:statekit.StatekitWarning"
)

HOOKS = sorted(name for name, _ in inspect.getmembers(hookspecs, inspect.isfunction) if name.startswith("statekit_"))


def test_every_hook_has_a_test():
    assert HOOKS == [
        "statekit_attach",
        "statekit_boundary_state",
        "statekit_checkpoint_committed",
        "statekit_load_state_post",
        "statekit_load_state_pre",
        "statekit_manager_options",
        "statekit_manager_start",
        "statekit_manager_wait",
        "statekit_resume_roots",
        "statekit_retention_keep",
        "statekit_save_state_post",
        "statekit_save_state_pre",
    ]
    import re

    manager_hooks_tests = (TESTS / "unit" / "manager" / "test_manager_hooks.py").read_text()  # the manager hooks' tests
    names = set(globals()) | set(re.findall(r"^def (test_hook_\w+)\(", manager_hooks_tests, re.M))
    tests = {name for name in names if name.startswith("test_hook_")}
    assert tests == {f"test_hook_{h}" for h in HOOKS}  # and no test_hook_ for a hook that does not exist
    missing = [h for h in HOOKS if f"test_hook_{h}" not in tests]
    assert not missing, f"hooks without a test_hook_<name>: {missing}"


# --------------------------------------------------------------------------- helpers


class Recorder:
    """A throwaway plugin recording every hook call (arguments as seen during the call)."""

    def __init__(self):
        self.calls = []

    def _record(self, hook, **kwargs):
        self.calls.append((hook, kwargs))

    @hookimpl
    def statekit_save_state_pre(self, models, weights, output_dir, checkpoint):
        self._record(
            "save_pre",
            models=list(models),
            weights=list(weights),
            lazy=[w.computed for w in weights],
            output_dir=output_dir,
            checkpoint=checkpoint,
            plugin=checkpoint.plugin,
            objects=dict(checkpoint.objects),
            mode=checkpoint.mode,
            manifest_exists=Storage(output_dir).exists(fmt.MANIFEST_NAME),
        )

    @hookimpl
    def statekit_save_state_post(self, models, output_dir, checkpoint):
        self._record(
            "save_post",
            models=list(models),
            output_dir=output_dir,
            manifest=checkpoint.manifest,
            manifest_exists=Storage(output_dir).exists(fmt.MANIFEST_NAME),
            plugin=checkpoint.plugin,
        )

    @hookimpl
    def statekit_load_state_pre(self, models, input_dir, checkpoint):
        self._record(
            "load_pre",
            models=list(models),
            input_dir=input_dir,
            plugin=checkpoint.plugin,
            mode=checkpoint.mode,
            step=checkpoint.step,
            manifest=checkpoint.manifest,
            objects=dict(checkpoint.objects),
        )

    @hookimpl
    def statekit_load_state_post(self, models, input_dir, checkpoint):
        self._record(
            "load_post",
            models=list(models),
            input_dir=input_dir,
            plugin=checkpoint.plugin,
            weights=[{k: v.clone() for k, v in m.state_dict().items()} for m in models],
        )

    def calls_of(self, hook):
        return [kw for h, kw in self.calls if h == hook]


class Owner:
    """Takes the model saved under ``key`` and stores it itself (an FSDP-like plugin)."""

    def __init__(self, key="model"):
        self.key = key
        self.seen_records = None
        self.owner_seen = None

    @hookimpl
    def statekit_save_state_pre(self, models, weights, output_dir, checkpoint):
        for i, m in enumerate(models):
            if checkpoint.key_of(m) == self.key:
                models.pop(i)
                weights.pop(i)
                checkpoint.save_tensors(f"{self.key}/weights.safetensors", m.state_dict())
                checkpoint.save_json(f"{self.key}/meta.json", {"layers": len(m.state_dict())})
                checkpoint.records["layout"] = {"key": self.key, "files": 2}
                return

    @hookimpl
    def statekit_load_state_pre(self, models, input_dir, checkpoint):
        self.seen_records = dict(checkpoint.records)
        for m in list(models):
            key = checkpoint.key_of(m)
            if key == self.key:
                self.owner_seen = checkpoint.owner_of(key)
                models.remove(m)
                with torch.no_grad():
                    checkpoint.load_tensors(f"{key}/weights.safetensors", into=m.state_dict())


def new_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


def url_for(tmp_path, name="ckpt"):
    return str(tmp_path / name)


# --------------------------------------------------------------------------- one test per hook


def test_hook_statekit_attach(plugin_manager):
    if not hasattr(statekit, "attach"):
        pytest.skip("needs the Accelerate bridge (statekit.attach)")
    seen = []

    class Attacher:
        @hookimpl
        def statekit_attach(self, accelerator, objects):
            seen.append((accelerator, dict(objects)))

    plugin_manager.register(Attacher(), name="attacher")
    model, opt_state = new_model(), {"lr": 0.1}
    handle = statekit.attach(None, objects={"model": model, "state": opt_state})
    try:
        assert len(seen) == 1
        accelerator, objects = seen[0]
        assert accelerator is None
        assert objects == {"state": opt_state}  # models are not in objects
        assert objects["state"] is opt_state
    finally:
        handle.remove()

    class Failing:
        @hookimpl
        def statekit_attach(self, accelerator, objects):
            raise ValueError("cannot attach")

    plugin_manager.register(Failing(), name="failing")
    with pytest.raises(PluginError, match="cannot attach") as info:
        statekit.attach(None, objects={})
    assert info.value.plugin_name == "failing" and info.value.hook_name == "statekit_attach"


def test_hook_statekit_save_state_pre(plugin_manager, tmp_path):
    rec = Recorder()
    plugin_manager.register(rec, name="recorder")
    model, other = new_model(), nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    url = url_for(tmp_path)
    manifest = statekit.save(url, {"model": model, "aux": other, "opt": opt, "t": torch.ones(1)}, step=7, flavour="x")
    (call,) = rec.calls_of("save_pre")
    assert call["models"] == [model, other]
    assert call["models"][0] is model and call["models"][1] is other
    assert len(call["weights"]) == 2 and call["lazy"] == [False, False]
    assert isinstance(call["weights"][0], LazyStateDict)
    assert_state_equal(dict(call["weights"][0]), dict(model.state_dict()))
    assert call["output_dir"] == url and isinstance(call["output_dir"], str)
    ckpt = call["checkpoint"]
    assert isinstance(ckpt, Checkpoint)
    assert ckpt.url == url and ckpt.step == 7 and ckpt.rank == 0 and ckpt.world_size == 1
    assert ckpt.options == {"flavour": "x"} and ckpt.accelerator is None
    assert call["plugin"] == "recorder" and ckpt.plugin is None  # set only during the call
    assert call["mode"] == "save"
    assert call["objects"] == {"opt": opt, "t": call["objects"]["t"]} and list(call["objects"]) == ["opt", "t"]
    assert call["manifest_exists"] is False  # pre-hooks run before anything is committed
    assert ckpt.key_of(model) == "model" and ckpt.key_of(other) == "aux"
    # the recorder took nothing: the core saved everything
    assert {o.owner for o in manifest.objects.values()} == {"statekit"}
    assert manifest.plugins == {}


def test_hook_statekit_save_state_post(plugin_manager, tmp_path):
    rec = Recorder()
    owner = Owner()
    plugin_manager.register(owner, name="owner")
    plugin_manager.register(rec, name="recorder")
    model = new_model()
    url = url_for(tmp_path)
    manifest = statekit.save(url, {"model": model, "t": torch.ones(1)})
    (call,) = rec.calls_of("save_post")
    assert call["manifest_exists"] is True  # post-hooks run after the commit
    assert call["manifest"] == manifest
    assert call["models"] == [model]  # every model, including those plugins took
    assert call["output_dir"] == url and call["plugin"] == "recorder"
    order = [h for h, _ in rec.calls]
    assert order == ["save_pre", "save_post"]


def test_hook_statekit_load_state_pre(plugin_manager, tmp_path):
    plugin_manager.register(Owner(), name="owner")
    src = new_model(1)
    url = url_for(tmp_path)
    statekit.save(url, {"model": src, "t": torch.ones(2)}, step=5)

    rec = Recorder()
    owner = Owner()
    with plugins.use_plugin_manager(plugins.build_plugin_manager(autoload=False)) as pm:
        pm.register(owner, name="owner")
        pm.register(rec, name="recorder")
        dst, t = new_model(2), torch.zeros(2)
        manifest = statekit.load(url, {"model": dst, "t": t}, verify=True, flavour="y")
    assert owner.seen_records == {"layout": {"key": "model", "files": 2}}
    assert owner.owner_seen == "owner"
    assert_state_equal(dict(src.state_dict()), dict(dst.state_dict()))
    assert torch.equal(t, torch.ones(2))
    (call,) = rec.calls_of("load_pre")
    assert call["input_dir"] == url and call["plugin"] == "recorder" and call["mode"] == "load"
    assert call["step"] == 5 and call["manifest"] == manifest
    assert list(call["objects"]) == ["t"]
    # pluggy order: the last registered (recorder) runs first and still sees the model
    assert call["models"] == [dst]


def test_hook_statekit_load_state_post(plugin_manager, tmp_path):
    src = new_model(1)
    url = url_for(tmp_path)
    statekit.save(url, {"model": src})
    rec = Recorder()
    plugin_manager.register(rec, name="recorder")
    dst = new_model(2)
    statekit.load(url, {"model": dst})
    (call,) = rec.calls_of("load_post")
    assert call["models"] == [dst] and call["input_dir"] == url and call["plugin"] == "recorder"
    # the core restored the model before the post-hook ran
    assert_state_equal(dict(src.state_dict()), call["weights"][0])
    assert [h for h, _ in rec.calls] == ["load_pre", "load_post"]


# --------------------------------------------------------------------------- ownership


def test_owner_and_writer_recorded(plugin_manager, tmp_path):
    plugin_manager.register(Owner(), name="owner")
    url = url_for(tmp_path)
    manifest = statekit.save(url, {"model": new_model(), "other": nn.Linear(2, 2)})
    obj = manifest.objects["model"]
    assert obj.owner == "owner"
    assert obj.owner_distribution == "statekit-owner"
    assert obj.files == ()
    assert manifest.objects["other"].owner == "statekit"
    assert manifest.files["model/weights.safetensors"].writer == "owner"
    assert manifest.files["model/meta.json"].writer == "owner"
    assert manifest.files["other.safetensors"].writer == "statekit"
    assert "model.safetensors" not in manifest.files  # the core skipped the taken model
    assert manifest.plugins == {"owner": "unknown"}  # in-code plugin: no distribution version
    assert manifest.records == {"owner": {"layout": {"key": "model", "files": 2}}}


def test_owned_object(plugin_manager, tmp_path):
    class OptOwner:
        @hookimpl
        def statekit_save_state_pre(self, models, weights, output_dir, checkpoint):
            opt = checkpoint.objects.pop("opt")
            checkpoint.save_state("opt_by_plugin", opt.state_dict())

        @hookimpl
        def statekit_load_state_pre(self, models, input_dir, checkpoint):
            opt = checkpoint.objects.pop("opt")
            opt.load_state_dict(checkpoint.load_state("opt_by_plugin"))

    plugin_manager.register(OptOwner(), name="optowner")
    model = new_model()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    url = url_for(tmp_path)
    manifest = statekit.save(url, {"model": model, "opt": opt})
    assert manifest.objects["opt"].owner == "optowner"
    assert "opt.json" not in manifest.files and "opt_by_plugin.json" in manifest.files
    model2 = new_model(3)
    opt2 = torch.optim.Adam(model2.parameters())
    statekit.load(url, {"model": model2, "opt": opt2})
    assert_state_equal(opt.state_dict(), opt2.state_dict())


def test_owner_that_does_not_take_its_model(plugin_manager, tmp_path):
    plugin_manager.register(Owner(), name="owner")
    url = url_for(tmp_path)
    statekit.save(url, {"model": new_model()})

    class Lazy:  # registered as "owner" but never takes the model
        @hookimpl
        def statekit_load_state_pre(self, models, input_dir, checkpoint):
            pass

    with plugins.use_plugin_manager(plugins.build_plugin_manager(autoload=False)) as pm:
        pm.register(Lazy(), name="owner")
        target = new_model(4)
        before = {k: v.clone() for k, v in target.state_dict().items()}
        with pytest.raises(PluginError, match="did not load it") as info:
            statekit.load(url, {"model": target})
    assert info.value.plugin_name == "owner"
    assert info.value.hook_name == "statekit_load_state_pre"
    assert "'model'" in str(info.value)
    assert_state_equal(before, dict(target.state_dict()))


def test_another_plugin_taking_an_owned_model_is_an_error(plugin_manager, tmp_path):
    plugin_manager.register(Owner(), name="owner")
    url = url_for(tmp_path)
    statekit.save(url, {"model": new_model()})
    with plugins.use_plugin_manager(plugins.build_plugin_manager(autoload=False)) as pm:
        pm.register(Owner(), name="impostor")
        with pytest.raises(PluginError) as info:
            statekit.load(url, {"model": new_model()})
    assert info.value.plugin_name == "owner"


def test_owner_missing_at_load(plugin_manager, tmp_path):
    plugin_manager.register(Owner(), name="shardy")
    url = url_for(tmp_path)
    statekit.save(url, {"model": new_model()})
    rec = Recorder()
    with plugins.use_plugin_manager(plugins.build_plugin_manager(autoload=False)) as pm:
        pm.register(rec, name="recorder")
        with pytest.raises(PluginMissingError, match="pip install statekit-shardy") as info:
            statekit.load(url, {"model": new_model()})
    assert info.value.plugin_name == "shardy"
    assert info.value.distribution == "statekit-shardy"
    assert "'model'" in str(info.value)
    assert rec.calls == []  # before any hook runs


def test_owner_blocked_at_load(plugin_manager, tmp_path, monkeypatch):
    plugin_manager.register(Owner(), name="shardy")
    url = url_for(tmp_path)
    statekit.save(url, {"model": new_model()})
    monkeypatch.setenv("STATEKIT_DISABLE_PLUGINS", "shardy")
    with plugins.use_plugin_manager(plugins.build_plugin_manager(autoload=False)) as pm:
        assert pm.register(Owner(), name="shardy") is None  # blocked
        with pytest.raises(PluginMissingError, match="STATEKIT_DISABLE_PLUGINS"):
            statekit.load(url, {"model": new_model()})


class Box:
    """A user object statekit does not know (no state_dict/load_state_dict)."""

    def __init__(self, value: int) -> None:
        self.value = value


class BoxPlugin:
    """A third-party plugin that takes every ``Box`` by removing it from ``checkpoint.objects``."""

    STATEKIT_OPTIONS = frozenset()

    @hookimpl
    def statekit_save_state_pre(self, models, weights, output_dir, checkpoint):
        for key in [k for k, v in checkpoint.objects.items() if isinstance(v, Box)]:
            checkpoint.save_json(f"{key}.json", {"value": checkpoint.objects.pop(key).value})

    @hookimpl
    def statekit_load_state_pre(self, models, input_dir, checkpoint):
        for key in [k for k, v in checkpoint.objects.items() if isinstance(v, Box)]:
            checkpoint.objects.pop(key).value = checkpoint.load_json(f"{key}.json")["value"]


def test_a_plugin_takes_an_object_type_the_core_does_not_know(plugin_manager, tmp_path):
    """As the docs say plugins claim objects: one without state_dict() is the plugin's to take,
    with statekit.save/load and with CheckpointManager.save/resume."""
    plugin_manager.register(BoxPlugin(), name="box")
    url = url_for(tmp_path)
    manifest = statekit.save(url, {"box": Box(7), "t": torch.ones(2)})
    assert manifest.objects["box"].owner == "box"
    box = Box(0)
    statekit.load(url, {"box": box, "t": torch.zeros(2)})
    assert box.value == 7
    manager = statekit.CheckpointManager({"box": Box(9)}, str(tmp_path / "root"))
    manager.save(step=3)
    resumed = Box(0)
    assert statekit.CheckpointManager({"box": resumed}, str(tmp_path / "root")).resume() == 3
    assert resumed.value == 9


def test_an_object_no_plugin_takes_is_refused_before_anything_is_written(plugin_manager, tmp_path):
    url = url_for(tmp_path)
    with pytest.raises(UnsupportedValueError, match=r"state\['box'\] \(Box\) has no state_dict.*no installed plugin took it"):
        statekit.save(url, {"box": Box(1), "t": torch.ones(2)})
    assert not Storage(url).exists(fmt.MANIFEST_NAME)


def test_a_blocked_plugins_object_is_plugin_missing_at_resume(plugin_manager, tmp_path, monkeypatch):
    """Its plugin blocked, resume() says PluginMissingError naming the plugin, not "no state_dict"."""
    plugin_manager.register(BoxPlugin(), name="box")
    statekit.CheckpointManager({"box": Box(9)}, str(tmp_path / "root")).save(step=3)
    monkeypatch.setenv("STATEKIT_DISABLE_PLUGINS", "box")
    with plugins.use_plugin_manager(plugins.build_plugin_manager(autoload=False)) as pm:
        assert pm.register(BoxPlugin(), name="box") is None  # blocked
        manager = statekit.CheckpointManager({"box": Box(0)}, str(tmp_path / "root"))
        with pytest.warns(statekit.StatekitWarning, match="cannot resume"), pytest.raises(PluginMissingError, match="'box'.*STATEKIT_DISABLE_PLUGINS"):
            manager.resume()


def test_models_and_weights_out_of_step(plugin_manager, tmp_path):
    class Sloppy:
        @hookimpl
        def statekit_save_state_pre(self, models, weights, output_dir, checkpoint):
            models.pop()  # forgets weights.pop()

    plugin_manager.register(Sloppy(), name="sloppy")
    url = url_for(tmp_path)
    with pytest.raises(PluginError, match="out of step") as info:
        statekit.save(url, {"model": new_model()})
    assert info.value.plugin_name == "sloppy"
    assert not Storage(url).exists(fmt.MANIFEST_NAME)


# --------------------------------------------------------------------------- errors


def test_failing_pre_hook_commits_nothing(plugin_manager, tmp_path):
    class Failing:
        @hookimpl
        def statekit_save_state_pre(self, models, weights, output_dir, checkpoint):
            checkpoint.save_json("partial.json", {"a": 1})
            raise KeyError("no such shard")

    plugin_manager.register(Failing(), name="failing")
    url = url_for(tmp_path)
    with pytest.raises(PluginError) as info:
        statekit.save(url, {"model": new_model()})
    exc = info.value
    assert exc.plugin_name == "failing"
    assert exc.hook_name == "statekit_save_state_pre"
    assert isinstance(exc.__cause__, KeyError)
    assert "plugin 'failing' failed in statekit_save_state_pre: KeyError" in str(exc)
    assert not Storage(url).exists(fmt.MANIFEST_NAME)
    with pytest.raises(statekit.IncompleteCheckpointError):
        statekit.load(url, {"model": new_model()})


def test_failing_post_hook_keeps_commit(plugin_manager, tmp_path):
    class Failing:
        @hookimpl
        def statekit_save_state_post(self, models, output_dir, checkpoint):
            raise OSError("upload failed")

    plugin_manager.register(Failing(), name="uploader")
    url = url_for(tmp_path)
    src = new_model()
    with pytest.raises(PluginError, match="upload failed") as info:
        statekit.save(url, {"model": src})
    assert info.value.plugin_name == "uploader" and info.value.hook_name == "statekit_save_state_post"
    plugin_manager.unregister(name="uploader")
    dst = new_model(5)
    statekit.load(url, {"model": dst})  # committed and loadable
    assert_state_equal(dict(src.state_dict()), dict(dst.state_dict()))


def test_failing_load_post_hook(plugin_manager, tmp_path):
    url = url_for(tmp_path)
    statekit.save(url, {"t": torch.ones(1)})

    class Failing:
        @hookimpl
        def statekit_load_state_post(self, models, input_dir, checkpoint):
            raise RuntimeError("late")

    plugin_manager.register(Failing(), name="late")
    t = torch.zeros(1)
    with pytest.raises(PluginError, match="late") as info:
        statekit.load(url, {"t": t})
    assert info.value.hook_name == "statekit_load_state_post"
    assert torch.equal(t, torch.ones(1))  # restored before the post-hook


def test_plugin_error_passes_through_with_hook_name(plugin_manager, tmp_path):
    class Raiser:
        @hookimpl
        def statekit_save_state_pre(self, models, weights, output_dir, checkpoint):
            raise PluginError("custom", plugin_name="raiser")

    plugin_manager.register(Raiser(), name="raiser")
    with pytest.raises(PluginError, match="^custom$") as info:
        statekit.save(url_for(tmp_path), {"t": torch.ones(1)})
    assert info.value.hook_name == "statekit_save_state_pre"


def test_plugin_cannot_write_after_commit(plugin_manager, tmp_path):
    class LateWriter:
        @hookimpl
        def statekit_save_state_post(self, models, output_dir, checkpoint):
            checkpoint.save_json("late.json", {})

    plugin_manager.register(LateWriter(), name="late")
    with pytest.raises(PluginError, match="not open for writing"):
        statekit.save(url_for(tmp_path), {"t": torch.ones(1)})


def test_plugin_cannot_escape_checkpoint(plugin_manager, tmp_path):
    class Escaper:
        @hookimpl
        def statekit_save_state_pre(self, models, weights, output_dir, checkpoint):
            checkpoint.save_json("../outside.json", {})

    plugin_manager.register(Escaper(), name="escaper")
    with pytest.raises(PluginError, match="invalid relative path"):
        statekit.save(url_for(tmp_path), {"t": torch.ones(1)})
    assert not (tmp_path / "outside.json").exists()


def test_plugin_cannot_write_a_file_twice(plugin_manager, tmp_path):
    class Twice:
        @hookimpl
        def statekit_save_state_pre(self, models, weights, output_dir, checkpoint):
            checkpoint.save_json("t.json", {})  # the core writes t.json for key "t"

    plugin_manager.register(Twice(), name="twice")
    with pytest.raises(StatekitError, match="written twice"):
        statekit.save(url_for(tmp_path), {"t": torch.ones(1)})


class BlobPlugin:
    """Writes ``blob.bin`` on save; reads it on load with ``read_bytes`` or ``open``."""

    def __init__(self, reader="read_bytes"):
        self.reader = reader
        self.data = None

    @hookimpl
    def statekit_save_state_pre(self, checkpoint):
        with checkpoint.open("blob.bin", "wb") as f:
            f.write(b"0123456789" * 10)
        checkpoint.save_tensors("blob.safetensors", {"x": torch.arange(10.0)})

    @hookimpl
    def statekit_load_state_pre(self, checkpoint):
        if self.reader == "read_bytes":
            self.data = checkpoint.read_bytes("blob.bin")
        elif self.reader == "open":
            with checkpoint.open("blob.bin", "rb") as f:
                self.data = f.read()
        else:
            self.data = checkpoint.load_tensors("blob.safetensors")


@pytest.mark.parametrize("reader", ["read_bytes", "load_tensors"])
def test_plugin_reads_are_verified(plugin_manager, tmp_path, reader):
    plugin_manager.register(BlobPlugin(), name="blob")
    url = url_for(tmp_path)
    manifest = statekit.save(url, {"t": torch.ones(1)})
    assert manifest.files["blob.bin"].writer == "blob"
    assert manifest.files["blob.bin"].size_bytes == 100
    plugin_manager.unregister(name="blob")
    good = BlobPlugin(reader)
    plugin_manager.register(good, name="blob")
    statekit.load(url, {"t": torch.zeros(1)})
    assert good.data is not None
    rel = "blob.bin" if reader == "read_bytes" else "blob.safetensors"
    data = bytearray((tmp_path / "ckpt" / rel).read_bytes())
    data[-1] ^= 1
    (tmp_path / "ckpt" / rel).write_bytes(bytes(data))
    with pytest.raises(statekit.CorruptCheckpointError) as info:  # keeps its type through the plugin ...
        statekit.load(url, {"t": torch.zeros(1)})
    assert info.value.plugin_name == "blob"  # ... and is attributed to it
    assert info.value.hook_name == "statekit_load_state_pre"
    assert rel in str(info.value)


def test_plugin_open_reads_are_verified(plugin_manager, tmp_path):
    plugin_manager.register(BlobPlugin("open"), name="blob")
    url = url_for(tmp_path)
    statekit.save(url, {"t": torch.ones(1)})
    data = bytearray((tmp_path / "ckpt" / "blob.bin").read_bytes())
    data[3] ^= 1
    (tmp_path / "ckpt" / "blob.bin").write_bytes(bytes(data))
    with pytest.raises(statekit.CorruptCheckpointError, match="blob.bin: checksum") as info:
        statekit.load(url, {"t": torch.zeros(1)})
    assert info.value.plugin_name == "blob"


# --------------------------------------------------------------------------- laziness, order, RNG


def test_weights_are_lazy(plugin_manager, tmp_path, monkeypatch):
    # the state check digests every saved object, a taken one too (its own state_dict() call):
    # off here, the weights list alone is judged
    monkeypatch.setenv("STATEKIT_STATE_CHECK", "off")
    class Counting(nn.Linear):
        def __init__(self):
            super().__init__(2, 2)
            self.calls = 0

        def state_dict(self, *args, **kwargs):
            self.calls += 1
            return super().state_dict(*args, **kwargs)

    class Taker:
        @hookimpl
        def statekit_save_state_pre(self, models, weights, output_dir, checkpoint):
            i = next(i for i, m in enumerate(models) if checkpoint.key_of(m) == "taken")
            models.pop(i)
            weights.pop(i)  # must not compute the state dict
            checkpoint.records["took"] = True

    plugin_manager.register(Taker(), name="taker")
    taken, kept = Counting(), Counting()
    statekit.save(url_for(tmp_path), {"taken": taken, "kept": kept})
    assert taken.calls == 0
    assert kept.calls == 1  # the core computed it once


def test_call_order_tryfirst(plugin_manager, tmp_path):
    order = []

    def make(name, **opts):
        class P:
            @hookimpl(**opts)
            def statekit_save_state_pre(self, checkpoint):
                order.append((name, checkpoint.plugin))

        return P()

    plugin_manager.register(make("first", tryfirst=True), name="first")
    plugin_manager.register(make("a"), name="a")
    plugin_manager.register(make("b"), name="b")
    plugin_manager.register(make("last", trylast=True), name="last")
    statekit.save(url_for(tmp_path), {"t": torch.ones(1)})
    assert order == [("first", "first"), ("b", "b"), ("a", "a"), ("last", "last")]


def test_plugin_cannot_shift_rng(plugin_manager, tmp_path):
    class Noisy:
        @hookimpl
        def statekit_save_state_pre(self, checkpoint):
            torch.rand(10)
            random.random()
            np.random.rand(3)
            torch.manual_seed(999)

        @hookimpl
        def statekit_load_state_post(self, checkpoint):
            torch.randn(5)
            random.seed(1)

    plugin_manager.register(Noisy(), name="noisy")
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    torch_state, py_state, np_state = torch.get_rng_state(), random.getstate(), np.random.get_state()
    url = url_for(tmp_path)
    statekit.save(url, {"t": torch.ones(1)})
    statekit.load(url, {"t": torch.zeros(1)})
    assert torch.equal(torch.get_rng_state(), torch_state)
    assert random.getstate() == py_state
    assert_state_equal(np.random.get_state(), np_state)


def test_rng_managing_plugin_is_not_guarded(plugin_manager, tmp_path):
    class Manages:
        STATEKIT_MANAGES_RNG = True

        @hookimpl
        def statekit_load_state_post(self, checkpoint):
            torch.manual_seed(1234)

    plugin_manager.register(Manages(), name="rng")
    url = url_for(tmp_path)
    statekit.save(url, {"t": torch.ones(1)})
    torch.manual_seed(0)
    statekit.load(url, {"t": torch.zeros(1)})
    expected = torch.Generator().manual_seed(1234).get_state()
    assert torch.equal(torch.get_rng_state(), expected)


# --------------------------------------------------------------------------- registration


def test_misspelled_hook_in_entry_point(plugin_site, monkeypatch):
    mod = plugin_site.add(
        "typo",
        """
        from statekit import hookimpl

        @hookimpl
        def statekit_save_state_pree(models):
            pass
        """,
    )
    with pytest.raises(PluginError, match="statekit_save_state_pree") as info:
        plugins.build_plugin_manager()
    assert info.value.plugin_name == "typo"
    del mod


def test_misspelled_hook_in_code(plugin_manager):
    class Typo:
        @hookimpl
        def statekit_save_state_pree(self, models):
            pass

    with pytest.raises(PluginError, match="statekit_save_state_pree"):
        plugin_manager.register(Typo(), name="typo")
        plugin_manager.check_pending()


def test_unknown_argument_rejected(plugin_manager):
    class BadArgs:
        @hookimpl
        def statekit_save_state_pre(self, models, nonsense):
            pass

    with pytest.raises(PluginError, match="nonsense") as info:
        plugin_manager.register(BadArgs(), name="badargs")
    assert info.value.plugin_name == "badargs"
    assert plugin_manager.get_plugin("badargs") is None


@pytest.mark.parametrize("opts", [{"hookwrapper": True}, {"wrapper": True}], ids=["hookwrapper", "wrapper"])
def test_wrapper_rejected(plugin_manager, opts):
    class Wrapper:
        @hookimpl(**opts)
        def statekit_save_state_pre(self, models):
            return (yield)

    with pytest.raises(PluginError, match="hook wrappers are not supported") as info:
        plugin_manager.register(Wrapper(), name="wrapper")
    assert info.value.plugin_name == "wrapper"
    assert plugin_manager.get_plugin("wrapper") is None
    assert "wrapper" not in plugin_manager.sources


def test_name_taken(plugin_manager):
    plugin_manager.register(Recorder(), name="dup")
    with pytest.raises(PluginError, match="dup"):
        plugin_manager.register(Recorder(), name="dup")


def test_register_and_unregister_in_code(plugin_manager):
    rec = Recorder()
    assert plugin_manager.register(rec, name="mine") == "mine"
    assert plugin_manager.sources["mine"] == plugins.PluginSource(name="mine", origin="code")
    plugin_manager.unregister(name="mine")
    assert plugin_manager.get_plugin("mine") is None
    assert "mine" not in plugin_manager.sources


def test_unregister_by_object_forgets_source(plugin_manager):
    rec = Recorder()
    plugin_manager.register(rec, name="mine")
    plugin_manager.unregister(rec)
    assert "mine" not in plugin_manager.sources


def test_get_plugin_manager_is_built_once_and_swappable(monkeypatch):
    monkeypatch.setenv("STATEKIT_DISABLE_PLUGIN_AUTOLOAD", "1")
    original = plugins._manager
    try:
        plugins.reset_plugin_manager()
        pm = statekit.get_plugin_manager()
        assert isinstance(pm, pluggy.PluginManager) and pm.project_name == "statekit"
        assert statekit.get_plugin_manager() is pm
        other = plugins.build_plugin_manager(autoload=False)
        with plugins.use_plugin_manager(other):
            assert statekit.get_plugin_manager() is other
        assert statekit.get_plugin_manager() is pm
        plugins.reset_plugin_manager()
        assert statekit.get_plugin_manager() is not pm
    finally:
        plugins._manager = original


def test_manages_rng(plugin_manager):
    assert not plugin_manager.manages_rng()

    class Rng:
        STATEKIT_MANAGES_RNG = True

    plugin_manager.register(Rng(), name="rng")
    assert plugin_manager.manages_rng()


def test_an_option_no_plugin_reads_warns_once_naming_the_closest_one(tmp_path, plugin_manager):
    class Offloadish:
        STATEKIT_OPTIONS = frozenset({"device_map", "offload_folder"})

    plugin_manager.register(Offloadish(), name="offloadish")
    with pytest.warns(statekit.StatekitWarning, match=r"'devce_map' is read by no registered plugin \(registered: offloadish, replicate\).*did you mean 'device_map'"):
        statekit.save(str(tmp_path / "a"), {"t": torch.zeros(1)}, devce_map="auto")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        statekit.save(str(tmp_path / "b"), {"t": torch.zeros(1)}, devce_map="auto")  # once per name
        statekit.load(str(tmp_path / "b"), {"t": torch.zeros(1)}, device_map=None, offload_folder=None)  # declared


def test_a_plugin_that_declares_no_options_does_not_hide_typos(tmp_path, plugin_manager):
    class Declares:
        STATEKIT_OPTIONS = frozenset({"device_map"})

    class Undeclared:  # counts as reading none: named in the warning, never silences it
        pass

    plugin_manager.register(Declares(), name="declares")
    plugin_manager.register(Undeclared(), name="undeclared")
    model = torch.nn.Linear(2, 2)
    with pytest.warns(statekit.StatekitWarning, match=r"'keep_lats' is declared by no registered plugin.*did you mean 'keep_last'\?.*plugin\(s\) undeclared declare no STATEKIT_OPTIONS") as caught:
        statekit.CheckpointManager({"model": model}, str(tmp_path / "run"), keep_lats=2)
    assert caught[0].filename == __file__  # the user's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        statekit.save(str(tmp_path / "a"), {"t": torch.zeros(1)}, device_map=None)  # declared by one plugin


def test_every_installed_statekit_plugin_declares_its_options():
    pm = plugins.build_plugin_manager(autoload=True)
    ours = [name for name, source in pm.sources.items() if (source.distribution or "").startswith("statekit")]
    assert ours, "no statekit plugin installed"
    undeclared = [name for name in ours if getattr(pm.get_plugin(name), "STATEKIT_OPTIONS", None) is None]
    assert undeclared == []


# --------------------------------------------------------------------------- discovery and env switches


@pytest.fixture
def plugin_site(tmp_path, monkeypatch):
    return PluginSite(tmp_path / "site", monkeypatch)


GOOD_PLUGIN = """
from statekit import hookimpl

CALLS = []

@hookimpl
def statekit_save_state_pre(models, checkpoint):
    CALLS.append(checkpoint.plugin)
"""


def test_entry_point_discovery(plugin_site):
    module = plugin_site.add("good", GOOD_PLUGIN)
    pm = plugins.build_plugin_manager()
    assert pm.get_plugin("good") is sys.modules[module]
    source = pm.sources["good"]
    assert source == plugins.PluginSource("good", "entry point", plugin_site.distribution("good"), "1.2.3", module)


def test_entry_point_plugin_version_in_manifest(plugin_site, tmp_path):
    module = plugin_site.add(
        "owner",
        """
        from statekit import hookimpl

        @hookimpl
        def statekit_save_state_pre(models, weights, checkpoint):
            models.pop(0)
            weights.pop(0)
            checkpoint.records["took"] = True
        """,
        version="4.5.6",
    )
    with plugins.use_plugin_manager(plugins.build_plugin_manager()):
        manifest = statekit.save(url_for(tmp_path), {"model": new_model()})
    assert sys.modules[module]
    assert manifest.plugins == {"owner": "4.5.6"}
    assert manifest.objects["model"].owner_distribution == plugin_site.distribution("owner")


def test_disable_plugins_env(plugin_site, monkeypatch):
    plugin_site.add("good", GOOD_PLUGIN)
    plugin_site.add("other", GOOD_PLUGIN)
    monkeypatch.setenv("STATEKIT_DISABLE_PLUGINS", ",".join([*plugin_site.blocked, " good "]))
    pm = plugins.build_plugin_manager()
    assert pm.get_plugin("good") is None and pm.is_blocked("good")
    assert pm.get_plugin("other") is not None
    assert pm.register(object(), name="good") is None  # blocked in code too


def test_disable_autoload_env(plugin_site, monkeypatch):
    plugin_site.add("good", GOOD_PLUGIN)
    monkeypatch.setenv("STATEKIT_DISABLE_PLUGIN_AUTOLOAD", "1")
    assert plugins.build_plugin_manager().get_plugin("good") is None
    assert plugins.build_plugin_manager(autoload=True).get_plugin("good") is not None  # explicit wins
    monkeypatch.setenv("STATEKIT_DISABLE_PLUGIN_AUTOLOAD", "0")
    assert plugins.build_plugin_manager().get_plugin("good") is not None


def test_installed_plugin_manager_fixture(plugin_site, request):
    plugin_site.add("good", GOOD_PLUGIN)
    pm = request.getfixturevalue("installed_plugin_manager")
    assert pm.get_plugin("good") is not None
    assert statekit.get_plugin_manager() is pm


def test_trace_plugins_env(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("STATEKIT_TRACE_PLUGINS", "1")
    pm = plugins.build_plugin_manager(autoload=False)
    pm.register(Recorder(), name="recorder")
    with plugins.use_plugin_manager(pm):
        statekit.save(url_for(tmp_path), {"t": torch.ones(1)})
    err = capsys.readouterr().err
    assert "statekit: statekit_save_state_pre -> plugin 'recorder'" in err
    assert "statekit: statekit_save_state_pre <- plugin 'recorder' done" in err
    assert "statekit: statekit_save_state_post -> plugin 'recorder'" in err


def test_no_trace_by_default(monkeypatch, capsys, tmp_path):
    monkeypatch.delenv("STATEKIT_TRACE_PLUGINS", raising=False)
    pm = plugins.build_plugin_manager(autoload=False)
    pm.register(Recorder(), name="recorder")
    with plugins.use_plugin_manager(pm):
        statekit.save(url_for(tmp_path), {"t": torch.ones(1)})
    assert "statekit:" not in capsys.readouterr().err


def test_entry_point_that_fails_to_import(plugin_site):
    module = plugin_site.add("broken", "raise ImportError('needs torch 9')\n", version="0.0.1")
    plugin_site.add("good", GOOD_PLUGIN)
    with pytest.warns(statekit.StatekitWarning, match=r"STATEKIT_DISABLE_PLUGINS=broken") as caught:
        pm = plugins.build_plugin_manager()  # the others load: one broken plugin breaks nothing else
    message = str(caught[0].message)
    assert "plugin 'broken'" in message
    assert plugin_site.distribution("broken") in message
    assert "0.0.1" in message
    assert f"entry point {module!r}" in message
    assert "ImportError: needs torch 9" in message
    assert "do NOT hold its state" in message
    assert pm.get_plugin("good") is not None and pm.get_plugin("broken") is None
    assert pm.broken["broken"].error == "ImportError: needs torch 9"


def test_blocked_broken_entry_point_is_not_imported(plugin_site, monkeypatch):
    plugin_site.add("broken", "raise ImportError('needs torch 9')\n")
    monkeypatch.setenv("STATEKIT_DISABLE_PLUGINS", ",".join([*plugin_site.blocked, "broken"]))
    assert plugins.build_plugin_manager().get_plugin("broken") is None


def test_save_json_indents_small_files_and_writes_large_ones_compact(tmp_path, plugin_manager):
    from statekit.engine import file_writer

    small = {"a": [1, 2]}
    large = {f"k{i}": [i, i + 1] for i in range(file_writer.READABLE_JSON_BYTES // 8)}

    class Writer:
        @statekit.hookimpl
        def statekit_save_state_pre(self, models, weights, output_dir, checkpoint):
            checkpoint.save_json("extra/small.json", small)
            checkpoint.save_json("extra/large.json", large)

    plugin_manager.register(Writer(), name="json-writer")
    url = str(tmp_path / "c")
    statekit.save(url, {"t": torch.zeros(2)})
    small_text = (tmp_path / "c" / "extra" / "small.json").read_text()
    large_text = (tmp_path / "c" / "extra" / "large.json").read_text()
    assert "\n" in small_text and json.loads(small_text) == small
    assert "\n" not in large_text and ", " not in large_text and json.loads(large_text) == large
    manifest = statekit.verify(url)  # sizes and checksums are those of the bytes written
    assert {"extra/small.json", "extra/large.json"} <= set(manifest.files)


def test_a_model_a_plugin_took_is_state_checked(plugin_manager, tmp_path):
    """The state check compares the live tensors, whoever saved and loaded them: a plugin
    whose load leaves a weight wrong is named, as the core's would be."""
    class Taker:
        @hookimpl
        def statekit_save_state_pre(self, models, weights, output_dir, checkpoint):
            i = next(i for i, m in enumerate(models) if checkpoint.key_of(m) == "taken")
            torch.save(models[i].state_dict(), f"{output_dir}/taken.pt")  # its own layout
            models.pop(i)
            weights.pop(i)

        @hookimpl
        def statekit_load_state_pre(self, models, input_dir, checkpoint):
            i = next(i for i, m in enumerate(models) if checkpoint.key_of(m) == "taken")
            state = torch.load(f"{input_dir}/taken.pt")
            state["weight"][0].zero_()  # a load path that loses a row
            models.pop(i).load_state_dict(state)

    plugin_manager.register(Taker(), name="taker")
    torch.manual_seed(0)
    taken = nn.Linear(3, 2)
    url = url_for(tmp_path)
    statekit.save(url, {"taken": taken})
    digest = read_manifest(Storage(url)).state_digest
    assert set(digest.objects["taken"]) == {"weight", "bias"}
    with pytest.warns(statekit.StateCheckWarning, match=r"model 'taken': weight differs from the saved state"):
        statekit.load(url, {"taken": nn.Linear(3, 2)})


def test_copy_listing_is_the_one_declared_else_generic():
    from statekit.hooks.registry import CopyListing, PluginManager

    class Copier:
        STATEKIT_COPY_LISTING = CopyListing(frozenset({"copier"}), copied="mirrored", state_field="mirroring")

    class Other:
        STATEKIT_COPY_LISTING = CopyListing(frozenset({"other"}))

    pm = PluginManager()
    assert pm.copy_listing() == CopyListing()  # nothing declared: the generic words, no markers
    pm.register(Copier(), name="copier")
    assert pm.copy_listing() == Copier.STATEKIT_COPY_LISTING
    pm.register(Other(), name="other")
    assert pm.copy_listing() == CopyListing(frozenset({"copier", "other"}))  # several: generic words, every marker


# --------------------------------------------------------------------------- statekit_boundary_state


class Counting:
    """A plugin with a counter that the training loop changes (non-tensor state)."""

    def __init__(self) -> None:
        self.counter = 0
        self.saw: list = []

    @hookimpl
    def statekit_boundary_state(self, objects):
        return {"counter": self.counter, "objects": sorted(objects)}

    @hookimpl
    def statekit_save_state_pre(self, checkpoint):
        self.saw.append(checkpoint.boundary_state())


def test_hook_statekit_boundary_state(plugin_manager, tmp_path):
    plugin = Counting()
    plugin_manager.register(plugin, name="counting")
    model = nn.Linear(2, 2)
    with statekit.CheckpointManager({"model": model, "extra": {"x": 1}}, tmp_path,
                                    save_on_signal=statekit.PreemptionPolicy(on_signal="return")) as manager:
        manager.save(1)  # a save of the live state: boundary_state() is None
        plugin.counter = 5
        manager.step_boundary(2)
        plugin.counter = 9  # after the boundary: not what the signal's save writes
        os.kill(os.getpid(), signal.SIGTERM)
        assert manager.signal_save.watcher.finished.wait(30)
    assert manager.signal_save.result["from_watcher"] and manager.signal_save.result["step"] == 2
    assert plugin.saw == [None, {"counter": 5, "objects": ["extra"]}]
