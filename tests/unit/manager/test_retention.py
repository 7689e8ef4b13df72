"""Retention policies on local disk, memory:// and S3: keep_last, keep_best, keep_every_n_steps."""

from __future__ import annotations

import pytest
import torch

import statekit
from statekit.manager.manager import list_checkpoints


def _steps(root: str) -> list[int]:
    return [i.step for i in list_checkpoints(root) if i.committed]


def _run(root, losses: dict[int, float], **policy) -> statekit.CheckpointManager:
    manager = statekit.CheckpointManager({"t": torch.zeros(3)}, root, retention=statekit.RetentionPolicy(**policy))
    for step, loss in losses.items():
        manager.save(step, metrics={"loss": loss, "acc": -loss})
    return manager


LOSSES = {10: 0.9, 20: 0.2, 30: 0.5, 40: 0.1, 50: 0.7, 60: 0.6}


def test_keep_best_min(storage_url, plugin_manager):
    _run(storage_url, LOSSES, keep_best=2, monitor="loss", mode="min")
    assert _steps(storage_url) == [20, 40, 60]  # the two best, and the newest


def test_keep_best_max(storage_url, plugin_manager):
    _run(storage_url, LOSSES, keep_best=1, monitor="acc", mode="max")
    assert _steps(storage_url) == [40, 60]


def test_keep_every_n_steps_with_keep_last(tmp_path, plugin_manager):
    root = str(tmp_path)
    _run(root, LOSSES, keep_last=2, keep_every_n_steps=20)
    assert _steps(root) == [20, 40, 50, 60]


def test_policies_combine_as_a_union(tmp_path, plugin_manager):
    root = str(tmp_path)
    _run(root, LOSSES, keep_last=1, keep_best=1, keep_every_n_steps=30)
    assert _steps(root) == [30, 40, 60]


def test_no_policy_keeps_everything(tmp_path, plugin_manager):
    root = str(tmp_path)
    _run(root, LOSSES)
    assert _steps(root) == sorted(LOSSES)


def test_checkpoints_without_the_metric_are_never_best(tmp_path, plugin_manager):
    root = str(tmp_path)
    manager = statekit.CheckpointManager({"t": torch.zeros(1)}, root, retention=statekit.RetentionPolicy(keep_best=1))
    manager.save(1)
    manager.save(2, metrics={"loss": 5.0})
    manager.save(3)
    assert _steps(root) == [2, 3]


def test_failed_save_deletes_nothing(tmp_path, plugin_manager):
    root = str(tmp_path)

    class Boom:
        def state_dict(self):
            raise RuntimeError("boom")

        def load_state_dict(self, state):
            pass

    state = {"t": torch.zeros(1), "x": torch.ones(1)}
    manager = statekit.CheckpointManager(state, root, keep_last=1)
    manager.save(1)
    state["x"] = Boom()
    manager.objects["x"] = state["x"]
    with pytest.raises(RuntimeError, match="boom"):
        manager.save(2)
    assert _steps(root) == [1]  # deletion happens only after a new commit


@pytest.mark.parametrize("bad", [{"keep_last": 0}, {"keep_best": -1}, {"keep_every_n_steps": 1.5}, {"mode": "best"}])
def test_bad_policy_values(tmp_path, bad):
    with pytest.raises(ValueError):
        statekit.CheckpointManager({"t": torch.zeros(1)}, str(tmp_path), retention=statekit.RetentionPolicy(**bad))
