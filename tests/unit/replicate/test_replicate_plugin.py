"""Two-tier storage as a plugin like any other: the ``replicate`` plugin (package
``statekit_replicate``) is registered by its entry point, owns its manager options through
``STATEKIT_MANAGER_OPTIONS``, and a third-party plugin can do the same with the plugin API
alone (the import contract and ``tests/unit/test_plugin_api.py`` check the package's imports)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from click.testing import CliRunner

import statekit
from statekit import hookimpl
from statekit.cli import main as cli
from statekit.plugin_api import InvalidOptionError, ManagerView


def test_statekit_plugins_lists_the_replicate_plugin(monkeypatch):
    monkeypatch.setenv("STATEKIT_DISABLE_PLUGIN_AUTOLOAD", "1")  # it ships with statekit: it loads all the same
    from statekit.hooks.registry import build_plugin_manager, use_plugin_manager

    with use_plugin_manager(build_plugin_manager()):
        result = CliRunner().invoke(cli, ["plugins", "--json"])
    assert result.exit_code == 0, result.output
    rows = {r["name"]: r for r in json.loads(result.output)}
    row = rows["replicate"]
    assert (row["distribution"], row["origin"], row["entry_point"]) == ("statekit", "entry point", "statekit_replicate.plugin:plugin")
    assert {"statekit_manager_options", "statekit_manager_start", "statekit_checkpoint_committed", "statekit_retention_keep",
            "statekit_resume_roots", "statekit_manager_wait"} <= set(row["hooks"])


class Mirror:
    """A third-party-style plugin on the plugin API: a manager option of its own, validated,
    read back from the manager view in the manager hooks."""

    STATEKIT_OPTIONS: frozenset[str] = frozenset()
    STATEKIT_MANAGER_OPTIONS = {"mirror_to": None, "mirror_every": 1}

    def __init__(self):
        self.seen = []

    @hookimpl
    def statekit_manager_options(self, options):
        every = options["mirror_every"]
        if not isinstance(every, int) or every < 1:
            raise InvalidOptionError(f"mirror_every must be a positive integer, got {every!r}")

    @hookimpl
    def statekit_manager_start(self, manager: ManagerView):
        manager.plugin_state["mirror"] = {"to": manager.manager_options["mirror_to"]}

    @hookimpl
    def statekit_checkpoint_committed(self, url, manager: ManagerView):
        name = url.rstrip("/").rsplit("/", 1)[-1]
        self.seen.append((manager.plugin_state["mirror"]["to"], manager.manager_options["mirror_every"],
                          manager.url_of(name) == url, [i.name for i in manager.list()]))


def test_a_plugin_owns_manager_options_through_the_plugin_api(plugin_manager, tmp_path, recwarn):
    mirror = Mirror()
    plugin_manager.register(mirror, name="mirror")
    manager = statekit.CheckpointManager({"t": torch.arange(3.0)}, str(tmp_path / "run"), mirror_to="elsewhere", mirror_every=2)
    assert isinstance(manager, ManagerView)
    assert dict(manager.manager_options) == {"mirror_to": "elsewhere", "mirror_every": 2, "replicate_to": None,
                                             "replicate_options": None, "remote_keep_last": None, "delete_unreplicated": False,
                                             "replicate_max_backlog": 16, "replicate_hedge_after_s": 30.0}
    assert manager.options == {}  # manager options are not passed to saves and loads
    manager.save(1)
    assert mirror.seen == [("elsewhere", 2, True, ["checkpoint-00000001"])]
    assert not [w for w in recwarn if "mirror" in str(w.message)]  # declared: no "read by no plugin" warning

    with pytest.raises(statekit.InvalidOptionError, match="mirror_every must be a positive integer, got 0") as info:
        statekit.CheckpointManager({"t": torch.arange(3.0)}, str(tmp_path / "run"), mirror_every=0)
    assert info.value.plugin_name == "mirror"

    with pytest.warns(statekit.StatekitWarning, match=r"option 'mirror_too' is read by no registered plugin.*did you mean 'mirror_to'"):
        statekit.CheckpointManager({"t": torch.arange(3.0)}, str(tmp_path / "run"), mirror_too="x")


def test_two_plugins_cannot_own_one_manager_option(plugin_manager, tmp_path):
    plugin_manager.register(Mirror(), name="mirror")
    plugin_manager.register(type("Other", (), {"STATEKIT_MANAGER_OPTIONS": {"mirror_to": None}})(), name="other")
    with pytest.raises(statekit.PluginError, match="plugins 'mirror' and 'other' both declare the manager option 'mirror_to'"):
        statekit.CheckpointManager({"t": torch.arange(3.0)}, str(tmp_path / "run"))


@pytest.mark.parametrize("value", ["soon", "-1", "inf", "nan"])
def test_a_bad_exit_timeout_is_refused_when_the_manager_starts(plugin_manager, tmp_path, monkeypatch, value):
    monkeypatch.setenv("STATEKIT_REPLICATION_EXIT_TIMEOUT", value)
    with pytest.raises(statekit.InvalidOptionError,
                       match=rf"STATEKIT_REPLICATION_EXIT_TIMEOUT='{value}' is not a number of seconds >= 0"):
        statekit.CheckpointManager({"t": torch.arange(3.0)}, str(tmp_path / "run"), replicate_to=str(tmp_path / "remote"))


SCRIPT = textwrap.dedent(
    """
    import sys, threading
    import torch
    import statekit
    import statekit_replicate.replication as replication

    local, remote, mode = sys.argv[1:]
    if mode == "frozen":  # a remote tier that never answers: the upload never ends
        never = threading.Event()
        replication.copy_checkpoint = lambda *args, **kwargs: never.wait()
    manager = statekit.CheckpointManager({"t": torch.arange(5.0)}, local, replicate_to=remote, async_save=mode == "async")
    manager.save(1)
    # the script ends right after its last save, without manager.wait()
    """
)


def _run(tmp_path, mode, timeout_env):
    env = {**os.environ, "STATEKIT_REPLICATION_EXIT_TIMEOUT": timeout_env, "STATEKIT_DISABLE_PLUGINS": "rng"}
    local, remote = str(tmp_path / "local"), str(tmp_path / "remote")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, local, remote, mode], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stderr, remote


def test_the_exit_timeout_takes_any_number_of_seconds(tmp_path):
    stderr, remote = _run(tmp_path, "frozen", "1e-3")  # was read as 600 s (only digits and one dot were numbers)
    assert "statekit: waiting up to 0.001 s for replication to" in stderr
    assert "checkpoint-00000001: not replicated yet (still copying)" in stderr


def test_an_async_save_at_the_end_of_a_script_is_replicated_at_exit(tmp_path):
    _, remote = _run(tmp_path, "async", "")
    restored = {"t": torch.zeros(5)}
    assert statekit.CheckpointManager(restored, remote).resume() == 1
    assert torch.equal(restored["t"], torch.arange(5.0))
