"""The manager hooks (docs/hooks.md, Manager hooks): one test per hook, with its errors."""

from __future__ import annotations

import re
import threading

import pytest
import torch
from torch import nn

import statekit
from statekit import format as fmt, hookimpl
from statekit.manager.listing import CheckpointDir, checkpoint_name
from statekit.errors import PluginError, PluginMissingError, StorageError
from statekit.storage import Storage
from statekit.testing import assert_state_equal

pytestmark = pytest.mark.filterwarnings(
    "ignore:no installed plugin saves random-number-generator state:statekit.StatekitWarning"
)


def run_state(seed=0):
    torch.manual_seed(seed)
    model = nn.Linear(3, 2)
    return {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1)}


def failing(hook):
    """A plugin whose implementation of ``hook`` raises ValueError."""

    def fail(manager, **kwargs):
        raise ValueError("plugin broke")

    names = {
        "statekit_manager_start": lambda self, manager: fail(manager),
        "statekit_checkpoint_committed": lambda self, url, manager: fail(manager),
        "statekit_retention_keep": lambda self, checkpoints, manager: fail(manager),
        "statekit_resume_roots": lambda self, manager: fail(manager),
        "statekit_manager_wait": lambda self, manager, timeout: fail(manager),
    }
    return type("Failing", (), {hook: hookimpl(names[hook])})()


def test_hook_statekit_manager_start(plugin_manager, tmp_path):
    seen = []

    class Starter:
        @hookimpl
        def statekit_manager_start(self, manager):
            seen.append((manager, threading.current_thread() is threading.main_thread(), manager.attachment is not None))
            manager.plugin_state["starter"] = {"started": True}

    plugin_manager.register(Starter(), name="starter")
    manager = statekit.CheckpointManager(run_state(), str(tmp_path / "run"))
    assert seen == [(manager, True, True)]  # once, on the caller's thread, after attach
    assert manager.plugin_state["starter"] == {"started": True}
    manager.save(1)
    assert len(seen) == 1  # not per save

    plugin_manager.register(failing("statekit_manager_start"), name="broken")
    with pytest.raises(PluginError, match="plugin broke") as info:
        statekit.CheckpointManager(run_state(), str(tmp_path / "run2"))
    assert info.value.plugin_name == "broken" and info.value.hook_name == "statekit_manager_start"


class Committed:
    def __init__(self):
        self.calls = []
        self.release = threading.Event()
        self.entered = threading.Event()
        self.block = False

    @hookimpl
    def statekit_checkpoint_committed(self, url, manifest, manager):
        latest = Storage(manager.root_url).read_bytes("latest").decode().strip()
        self.calls.append(dict(url=url, manifest=manifest, manager=manager, latest=latest,
                               committed=Storage(url).exists(fmt.MANIFEST_NAME),
                               main=threading.current_thread() is threading.main_thread()))
        if self.block:
            self.entered.set()
            assert self.release.wait(30)


def test_hook_statekit_checkpoint_committed(plugin_manager, tmp_path):
    rec = Committed()
    plugin_manager.register(rec, name="committed")
    manager = statekit.CheckpointManager(run_state(), str(tmp_path / "run"))
    manifest = manager.save(3)
    (call,) = rec.calls
    assert call["url"] == manager.url_for(3) and call["manifest"] == manifest and call["manager"] is manager
    assert call["committed"] and call["latest"] == checkpoint_name(3) and call["main"]

    # an async save: called on the writer thread at the commit, before wait(), and without
    # the RNG guard (restoring the global state would rewind the training thread's draws)
    rec.block = True
    torch.manual_seed(123)
    expected = torch.rand(4), torch.rand(4)
    torch.manual_seed(123)
    pending = manager.save(4, blocking=False)
    assert rec.entered.wait(30)
    first = torch.rand(4)  # the training thread draws while the hook runs
    rec.release.set()
    manifest = pending.wait()
    second = torch.rand(4)
    assert torch.equal(first, expected[0]) and torch.equal(second, expected[1])
    call = rec.calls[-1]
    assert call["url"] == manager.url_for(4) and call["manifest"] == manifest and not call["main"]

    # an error is raised by the save; the checkpoint stays committed
    rec.block = False
    plugin_manager.register(failing("statekit_checkpoint_committed"), name="broken")
    with pytest.raises(PluginError, match="plugin broke") as info:
        manager.save(5)
    assert info.value.plugin_name == "broken" and info.value.hook_name == "statekit_checkpoint_committed"
    assert [i.step for i in manager.list() if i.committed] == [3, 4, 5]
    assert manager.latest() == manager.url_for(5)
    assert "is committed" in str(info.value)

    # async: wait() raises the hook's PluginError saying the checkpoint committed, not
    # "background save failed"
    pending = manager.save(6, blocking=False)
    with pytest.raises(PluginError, match=r"plugin broke.*the checkpoint .*checkpoint-00000006 is committed") as info:
        pending.wait()
    assert not isinstance(info.value, statekit.AsyncSaveError)
    assert info.value.hook_name == "statekit_checkpoint_committed"
    assert manager.latest() == manager.url_for(6)


def test_hook_statekit_retention_keep(plugin_manager, tmp_path):
    seen = []

    class KeepFirst:
        @hookimpl
        def statekit_retention_keep(self, checkpoints, manager):
            seen.append(([i.step for i in checkpoints], all(isinstance(i, CheckpointDir) for i in checkpoints), manager))
            return [checkpoints[0].url] if checkpoints[0].step == 1 else None

    plugin_manager.register(KeepFirst(), name="keepfirst")
    manager = statekit.CheckpointManager(run_state(), str(tmp_path / "run"), keep_last=1)
    for step in (1, 2, 3):
        manager.save(step)
    assert [i.step for i in manager.list()] == [1, 3]  # kept by the plugin, and the newest
    assert seen[-1] == ([1, 2, 3], True, manager) and [s for s, _, _ in seen] == [[1], [1, 2], [1, 2, 3]]

    plugin_manager.register(failing("statekit_retention_keep"), name="broken")
    with pytest.raises(PluginError, match="plugin broke") as info:
        manager.save(4)
    assert info.value.hook_name == "statekit_retention_keep"
    assert [i.step for i in manager.list()] == [1, 3, 4]  # nothing deleted; the new one committed


def test_no_hook_keeps_nothing_extra(plugin_manager, tmp_path):
    manager = statekit.CheckpointManager(run_state(), str(tmp_path / "run"), keep_last=1)
    for step in (1, 2, 3):
        manager.save(step)
    assert [i.step for i in manager.list()] == [3]


def test_hook_statekit_resume_roots(plugin_manager, tmp_path, monkeypatch):
    other = str(tmp_path / "other")
    source = run_state(1)
    statekit.CheckpointManager(source, other).save(7)  # newer, under another root only
    offered = []

    class Roots:
        @hookimpl
        def statekit_resume_roots(self, manager):
            offered.append(manager)
            return [Storage(str(tmp_path / "missing-root" / "x")), Storage(other, {"auto_mkdir": False})]

    plugin_manager.register(Roots(), name="roots")
    seen_options = []
    from statekit.manager import manager as manager_module

    original = manager_module.loading.load_objects
    monkeypatch.setattr(manager_module.loading, "load_objects",
                        lambda url, entries, **kw: seen_options.append((url, kw["storage_options"])) or original(url, entries, **kw))
    target = run_state(2)
    manager = statekit.CheckpointManager(target, str(tmp_path / "run"))
    manager.save(5)
    assert manager.resume() == 7
    assert offered == [manager]
    assert seen_options == [(other + "/" + checkpoint_name(7), {"auto_mkdir": False})]
    assert_state_equal(target["model"].state_dict(), source["model"].state_dict())

    # the same step under both roots with different manifests: warned, the local one first
    changed = run_state(3)
    statekit.CheckpointManager(changed, str(tmp_path / "run")).save(7, overwrite=True)
    with pytest.warns(statekit.StatekitWarning, match="different manifests; using the local one"):
        assert manager.resume() == 7
    assert seen_options[-1] == (manager.url_for(7), None)
    assert_state_equal(target["model"].state_dict(), changed["model"].state_dict())

    plugin_manager.register(failing("statekit_resume_roots"), name="broken")
    before = {k: v.clone() for k, v in target["model"].state_dict().items()}
    with pytest.raises(PluginError, match="plugin broke") as info:
        manager.resume()
    assert info.value.hook_name == "statekit_resume_roots"
    assert_state_equal(target["model"].state_dict(), before)  # nothing loaded


def test_unlistable_offered_root_warns_and_is_left_out(plugin_manager, tmp_path):
    unlistable = Storage(str(tmp_path / "elsewhere"))

    def fail():
        raise StorageError(f"{unlistable.url}: listing failed")

    unlistable.listdir = fail

    class Roots:
        @hookimpl
        def statekit_resume_roots(self, manager):
            return [unlistable]

    plugin_manager.register(Roots(), name="roots")
    manager = statekit.CheckpointManager(run_state(), str(tmp_path / "run"))
    manager.save(2)
    with pytest.warns(statekit.StatekitWarning, match=rf"cannot list {re.escape(unlistable.url)}"):
        assert manager.resume() == 2


def test_hook_statekit_manager_wait(plugin_manager, tmp_path):
    seen = []

    class Waiter:
        @hookimpl
        def statekit_manager_wait(self, manager, timeout):
            seen.append((manager, timeout, manager.pending is None))

    plugin_manager.register(Waiter(), name="waiter")
    with statekit.CheckpointManager(run_state(), str(tmp_path / "run")) as manager:
        manager.save(1, blocking=False)
        manager.wait(timeout=2.5)
    assert seen == [(manager, 2.5, True), (manager, None, True)]  # wait(), then leaving the block

    plugin_manager.register(failing("statekit_manager_wait"), name="broken")
    with pytest.raises(PluginError, match="plugin broke") as info:
        manager.wait()
    assert info.value.hook_name == "statekit_manager_wait"


def test_replicate_to_with_the_builtin_plugin_blocked(tmp_path, monkeypatch):
    monkeypatch.setenv("STATEKIT_DISABLE_PLUGINS", "replicate")
    from statekit.hooks.registry import build_plugin_manager, use_plugin_manager

    with use_plugin_manager(build_plugin_manager(autoload=False)):
        with pytest.raises(PluginMissingError, match="replicate_to=.*needs the plugin 'replicate'.*STATEKIT_DISABLE_PLUGINS blocks"):
            statekit.CheckpointManager(run_state(), str(tmp_path / "run"), replicate_to=str(tmp_path / "remote"))
        statekit.CheckpointManager(run_state(), str(tmp_path / "run")).save(1)  # without replicate_to: fine
    assert not (tmp_path / "remote").exists()


def test_a_blocked_third_party_plugins_manager_option_is_plugin_missing(tmp_path, monkeypatch):
    """A third-party tier plugin's manager option, given while the plugin is blocked, is a
    PluginMissingError as the built-in replicate plugin's is (not a warning)."""
    from types import SimpleNamespace

    from statekit.hooks import registry

    plugin_module = SimpleNamespace(STATEKIT_MANAGER_OPTIONS={"tier_to": None})
    entry_point = SimpleNamespace(name="tier", load=lambda: plugin_module, dist=SimpleNamespace(name="statekit-tier"))
    monkeypatch.setattr(registry, "_installed_entry_points", lambda: [entry_point])
    monkeypatch.setenv("STATEKIT_DISABLE_PLUGINS", "tier")
    with registry.use_plugin_manager(registry.build_plugin_manager(autoload=False)):
        with pytest.raises(PluginMissingError, match=r"tier_to='s3://b/run' needs the plugin 'tier' \(statekit-tier\)") as info:
            statekit.CheckpointManager(run_state(), str(tmp_path / "run"), tier_to="s3://b/run")
        assert info.value.distribution == "statekit-tier"
        statekit.CheckpointManager(run_state(), str(tmp_path / "run"), tier_to=None)  # the default: nothing lost


@pytest.mark.parametrize(
    "hook, result",
    [("statekit_retention_keep", 3), ("statekit_resume_roots", "s3://bucket/run"), ("statekit_resume_roots", [("a", "b", "c")])],
)
def test_a_malformed_result_is_a_plugin_error(plugin_manager, tmp_path, hook, result):
    impl = {
        "statekit_retention_keep": lambda self, checkpoints, manager: result,
        "statekit_resume_roots": lambda self, manager: result,
    }[hook]
    plugin_manager.register(type("Odd", (), {hook: hookimpl(impl)})(), name="odd")
    manager = statekit.CheckpointManager(run_state(), str(tmp_path / "run"), keep_last=1)
    with pytest.raises(PluginError, match=rf"plugin 'odd': {hook} must return") as info:
        manager.save(1)  # retention runs after every commit
        manager.resume()
    assert info.value.plugin_name == "odd" and info.value.hook_name == hook
    assert manager.latest() == manager.url_for(1)  # committed either way


def test_one_url_kept_by_retention(plugin_manager, tmp_path):
    class KeepOne:
        @hookimpl
        def statekit_retention_keep(self, checkpoints, manager):
            return manager.url_for(1)  # one URL, not an iterable of them

    plugin_manager.register(KeepOne(), name="keepone")
    manager = statekit.CheckpointManager(run_state(), str(tmp_path / "run"), keep_last=1)
    for step in (1, 2, 3):
        manager.save(step)
    assert [i.step for i in manager.list()] == [1, 3]


def test_hook_statekit_manager_options(plugin_manager, tmp_path):
    seen = []

    class Owner:
        STATEKIT_MANAGER_OPTIONS = {"mirror_to": None, "mirror_every": 1}

        @hookimpl
        def statekit_manager_options(self, options):
            seen.append(("options", dict(options), threading.current_thread() is threading.main_thread()))
            if options["mirror_every"] == 0:
                raise statekit.InvalidOptionError("mirror_every must be positive, got 0")
            if options["mirror_every"] == -1:
                raise ValueError("plugin broke")

        @hookimpl
        def statekit_manager_start(self, manager):
            seen.append(("start", manager.manager_options["mirror_to"]))

    plugin_manager.register(Owner(), name="owner")
    manager = statekit.CheckpointManager(run_state(), str(tmp_path / "run"), mirror_to="there")
    assert seen[0] == ("options", {**manager.manager_options}, True)  # once, before start, every declared name
    assert seen[0][1]["mirror_to"] == "there" and seen[0][1]["mirror_every"] == 1  # the default
    assert seen[1:] == [("start", "there")] and manager.options == {}  # not a checkpoint option

    seen.clear()
    with pytest.raises(statekit.InvalidOptionError, match="mirror_every must be positive, got 0") as info:
        statekit.CheckpointManager(run_state(), str(tmp_path / "run"), mirror_every=0)
    assert info.value.plugin_name == "owner" and info.value.hook_name == "statekit_manager_options"
    with pytest.raises(PluginError, match="plugin broke") as info:
        statekit.CheckpointManager(run_state(), str(tmp_path / "run"), mirror_every=-1)
    assert info.value.hook_name == "statekit_manager_options"
    assert [s[0] for s in seen] == ["options", "options"]  # refused before anything started
