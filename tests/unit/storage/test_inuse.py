"""In-use markers: retention, gc and overwrite never delete a checkpoint a live process reads."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

import statekit
from statekit.cli import main
from statekit.storage.inuse import in_use_markers, mark_in_use, release_in_use
from statekit.manager.listing import checkpoint_name, delete_checkpoint, list_checkpoints


def test_retention_keeps_a_checkpoint_in_use(tmp_path, plugin_manager):
    root = tmp_path / "run"
    manager = statekit.CheckpointManager({"t": torch.zeros(2)}, str(root), keep_last=1)
    manager.save(1)
    marker = mark_in_use(str(root / checkpoint_name(1)), by="a-reader", model_key="model")
    with pytest.warns(statekit.StatekitWarning, match="retention kept .*read in place by a live process"):
        manager.save(2)
    assert [i.step for i in list_checkpoints(str(root))] == [1, 2]
    release_in_use(marker)
    manager.save(3)
    assert [i.step for i in list_checkpoints(str(root))] == [3]


def test_delete_and_overwrite_refuse_a_live_marker(tmp_path, plugin_manager):
    url = str(tmp_path / "c")
    statekit.save(url, {"t": torch.zeros(2)})
    marker = mark_in_use(url, by="a-reader")
    with pytest.raises(statekit.CheckpointInUseError, match="read in place"):
        delete_checkpoint(url)
    with pytest.raises(statekit.CheckpointInUseError):
        statekit.save(url, {"t": torch.ones(2)}, overwrite=True)
    release_in_use(marker)
    statekit.save(url, {"t": torch.ones(2)}, overwrite=True)


def test_marker_of_a_dead_process_is_stale(tmp_path, plugin_manager):
    url = str(tmp_path / "c")
    statekit.save(url, {"t": torch.zeros(2)})
    code = f"from statekit.storage.inuse import mark_in_use; print(mark_in_use({url!r}, by='a-reader'))"
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    assert in_use_markers(url) == [] and len(in_use_markers(url, include_stale=True)) == 1
    delete_checkpoint(url)  # a stale marker does not protect it


def test_gc_keeps_incomplete_checkpoint_in_use(tmp_path):
    root = tmp_path / "run"
    (root / checkpoint_name(7)).mkdir(parents=True)
    mark_in_use(str(root / checkpoint_name(7)), by="a-reader")
    report = json.loads(CliRunner().invoke(main, ["gc", str(root), "--json"]).output)
    assert report["removed"] == [] and report["kept"][0]["url"].endswith(checkpoint_name(7))
