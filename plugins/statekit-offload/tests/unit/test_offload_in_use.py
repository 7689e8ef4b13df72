"""In-use markers protecting checkpoints read in place, and plugin discovery."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ALL_DISK, IDS, build_net

import statekit
from statekit_offload import in_use_markers, is_in_use, mark_in_use, offload_info, release_in_use, remove_stale_markers


def test_marker_lives_as_long_as_the_model(saved, tmp_path):
    url, _, ref = saved
    model = build_net(meta=True)
    statekit.load(url, {"model": model}, device_map=ALL_DISK, offload_folder=tmp_path / "off")
    marker = offload_info(model).marker
    assert os.path.dirname(marker) == os.path.abspath(url) and os.path.basename(marker).startswith(f".in-use-{os.getpid()}-")
    [found] = in_use_markers(url)
    assert found.live and found.pid == os.getpid() and found.model_key == "model"
    assert found.offload_folder == str(tmp_path / "off")
    assert is_in_use(url)
    statekit.verify(url)  # the marker is not part of the checkpoint
    with torch.no_grad():
        assert torch.equal(model(IDS), ref)
    del model
    gc.collect()
    assert not os.path.exists(marker) and not is_in_use(url)


def test_stale_marker_of_a_dead_process(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    child = subprocess.run(
        [sys.executable, "-c", f"from statekit_offload import mark_in_use; print(mark_in_use({str(ckpt)!r}, by='statekit-offload'))"],
        capture_output=True, text=True, check=True,
    )
    path = child.stdout.strip()
    assert os.path.exists(path)
    assert not is_in_use(str(ckpt))  # that process has exited
    [stale] = in_use_markers(str(ckpt), include_stale=True)
    assert not stale.live and stale.path == path
    assert remove_stale_markers(str(ckpt)) == [path] and not os.path.exists(path)


def test_markers_of_other_hosts_and_unreadable_markers_count_as_live(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / ".in-use-1-remote").write_text(json.dumps({"pid": 1, "host": "another-host.example", "pid_start": 5}))
    (ckpt / ".in-use-garbage").write_text("{not json")
    assert len(in_use_markers(str(ckpt))) == 2 and remove_stale_markers(str(ckpt)) == []


def test_mark_and_release(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    path = mark_in_use(str(ckpt), by="statekit-offload", model_key="m")
    assert is_in_use(f"file://{ckpt}")
    release_in_use(path)
    release_in_use(path)  # twice is fine
    assert not is_in_use(str(ckpt))
    with pytest.raises(statekit.StorageError, match="local filesystem"):
        mark_in_use("memory://somewhere/ckpt", by="statekit-offload")


def test_entry_point_and_cheap_import():
    from importlib.metadata import entry_points

    [ep] = [ep for ep in entry_points(group="statekit") if ep.name == "offload"]
    assert ep.value == "statekit_offload.plugin"
    code = (
        "import sys, statekit_offload.plugin as p; "
        "assert 'accelerate' not in sys.modules, 'accelerate imported'; "
        "assert callable(p.STATEKIT_CONVERTERS['offload'])"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_installed_plugin_is_discovered(monkeypatch):
    monkeypatch.delenv("STATEKIT_DISABLE_PLUGINS", raising=False)
    pm = statekit.hooks.registry.build_plugin_manager(autoload=True)
    assert pm.get_plugin("offload") is not None
    monkeypatch.setenv("STATEKIT_DISABLE_PLUGINS", "offload")
    assert statekit.hooks.registry.build_plugin_manager(autoload=True).get_plugin("offload") is None
