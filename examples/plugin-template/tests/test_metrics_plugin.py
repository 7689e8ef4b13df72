"""Tests of statekit-metrics with the fixtures of ``statekit.testing`` (loaded by pytest
through statekit's ``pytest11`` entry point: no conftest needed)."""

from __future__ import annotations

import pytest
import torch

import statekit
import statekit_metrics
import statekit_metrics.plugin as metrics_plugin


def test_entry_point_is_installed(installed_plugin_manager):
    """``pip install`` registered the entry point ``metrics`` in group ``statekit``."""
    plugin = installed_plugin_manager.get_plugin("metrics")
    assert plugin is metrics_plugin


def test_round_trip(plugin_manager, storage_url, assert_state_equal):
    plugin_manager.register(metrics_plugin, name="metrics")
    model = torch.nn.Linear(3, 2)
    statekit.save(storage_url, {"model": model}, step=42, run_name="exp1", lr=0.5)

    manifest = statekit.verify(storage_url)
    assert manifest.files[statekit_metrics.FILE].writer == "metrics"
    assert manifest.records["metrics"] == {"file": "metrics.json"}

    fresh = torch.nn.Linear(3, 2)
    out: dict = {}
    statekit.load(storage_url, {"model": fresh}, metrics_out=out)
    assert out == {"step": 42, "options": {"run_name": "exp1", "lr": 0.5}}
    assert statekit_metrics.last_loaded() == out
    assert_state_equal(model.state_dict(), fresh.state_dict())


def test_options_that_are_not_json_are_left_out(plugin_manager, tmp_path):
    plugin_manager.register(metrics_plugin, name="metrics")
    url = str(tmp_path / "ckpt")
    statekit.save(url, {"t": torch.ones(2)}, step=1, callback=print, tag="a")
    out: dict = {}
    statekit.load(url, {"t": torch.zeros(2)}, metrics_out=out)
    assert out == {"step": 1, "options": {"tag": "a"}}


def test_checkpoint_without_the_plugin_loads(plugin_manager, tmp_path):
    url = str(tmp_path / "plain")
    statekit.save(url, {"t": torch.ones(2)})
    plugin_manager.register(metrics_plugin, name="metrics")
    out: dict = {}
    t = torch.zeros(2)
    statekit.load(url, {"t": t}, metrics_out=out)
    assert out == {} and torch.equal(t, torch.ones(2))


def test_bad_metrics_out_names_the_checkpoint(plugin_manager, tmp_path):
    plugin_manager.register(metrics_plugin, name="metrics")
    url = str(tmp_path / "ckpt")
    statekit.save(url, {"t": torch.ones(2)})
    with pytest.raises(statekit.StatekitError, match="metrics_out must be a dict"):
        statekit.load(url, {"t": torch.zeros(2)}, metrics_out=[])


def test_with_accelerate(plugin_manager, tiny_accelerate, tmp_path, assert_state_equal):
    plugin_manager.register(metrics_plugin, name="metrics")
    run = tiny_accelerate
    for i, batch in enumerate(run.loader):
        run.train_step(batch)
        if i == 2:
            break
    url = str(tmp_path / "acc")
    statekit.save_state(run.accelerator, url, step=3, run_name="acc")
    saved = {k: v.clone() for k, v in run.model.state_dict().items()}
    for batch in run.loader:  # change the weights, then restore them
        run.train_step(batch)
    out: dict = {}
    statekit.load_state(run.accelerator, url, metrics_out=out)
    assert out == {"step": 3, "options": {"run_name": "acc"}}
    assert_state_equal(saved, dict(run.model.state_dict()))
