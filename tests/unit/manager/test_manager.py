"""CheckpointManager: naming, latest, exact mid-epoch resume, retention, killed saves."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import statekit
from statekit.manager.manager import checkpoint_name, list_checkpoints
from statekit.testing import assert_state_equal

from accelerate_helpers import build, train_steps

pytest.importorskip("accelerate")


@pytest.mark.parametrize("stateful", [False, True], ids=["default-loader", "stateful-loader"])
def test_mid_epoch_resume_is_exact(tmp_path, installed_plugin_manager, stateful):
    root = str(tmp_path / "run")
    total, save_at = 30, 17  # 13 batches per epoch: step 17 is batch 4 of epoch 2
    reference = build(seed=0, stateful=stateful)
    statekit.CheckpointManager(reference[0], str(tmp_path / "ref"))
    expected = train_steps(reference, total)

    first = build(seed=0, stateful=stateful)
    manager = statekit.CheckpointManager(first[0], root)
    losses = train_steps(first, save_at, on_step=lambda s: manager.save(s) if s == save_at else None)
    train_steps(first, 5, start=save_at)  # the run goes on past the checkpoint, then dies

    resumed = build(seed=0, stateful=stateful)
    manager = statekit.CheckpointManager(resumed[0], root)
    assert manager.resume() == save_at
    losses += train_steps(resumed, total - save_at, start=save_at)
    assert losses == expected
    assert_state_equal(resumed[1].state_dict(), reference[1].state_dict())
    assert_state_equal(resumed[2].state_dict(), reference[2].state_dict())


def test_resume_without_checkpoints_returns_none(tmp_path, installed_plugin_manager):
    run = build()
    assert statekit.CheckpointManager(run[0], str(tmp_path / "empty")).resume() is None


def test_latest_ignores_incomplete_and_hint(tmp_path, installed_plugin_manager):
    run = build()
    root = tmp_path / "run"
    manager = statekit.CheckpointManager(run[0], str(root))
    manager.save(5)
    assert (root / "latest").read_text().strip() == checkpoint_name(5)
    (root / checkpoint_name(9)).mkdir()  # an interrupted save: no manifest
    (root / checkpoint_name(9) / "model_0.safetensors").write_bytes(b"partial")
    (root / "latest").write_text(checkpoint_name(9))  # a stale or lying hint
    assert manager.latest() == str(root / checkpoint_name(5))
    assert [(i.step, i.committed) for i in manager.list()] == [(5, True), (9, False)]
    assert build()[0] is not None
    assert statekit.CheckpointManager(build()[0], str(root)).resume() == 5


def test_keep_last_deletes_only_after_commit_and_never_the_resumed(tmp_path, installed_plugin_manager):
    run = build()
    root = str(tmp_path / "run")
    manager = statekit.CheckpointManager(run[0], root, keep_last=2)
    for step in (1, 2, 3, 4):
        manager.save(step)
    assert [i.step for i in list_checkpoints(root)] == [3, 4]

    resumed = build()
    manager = statekit.CheckpointManager(resumed[0], root, keep_last=1)
    assert manager.resume() == 4
    manager.save(5)
    manager.save(6)
    # keep_last=1 would leave only 6, but step 4 is what this run resumed from
    assert [i.step for i in list_checkpoints(root)] == [4, 6]


def test_keep_last_validation(tmp_path):
    with pytest.raises(statekit.InvalidOptionError, match="keep_last"):
        statekit.CheckpointManager({"t": torch.zeros(1)}, str(tmp_path), keep_last=0)


def test_mapping_api_manager(tmp_path, installed_plugin_manager):
    model = torch.nn.Linear(3, 3)
    manager = statekit.CheckpointManager({"model": model}, str(tmp_path / "m"))
    manager.save(1, metrics={"loss": 0.5})
    info = manager.list()[0]
    assert info.metrics == {"loss": 0.5} and info.size_bytes > 0
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.zero_()
    assert manager.resume() == 1
    assert_state_equal(model.state_dict(), saved)


def test_resume_falls_back_from_a_corrupt_checkpoint(tmp_path, installed_plugin_manager):
    model = torch.nn.Linear(3, 3)
    root = tmp_path / "m"
    manager = statekit.CheckpointManager({"model": model}, str(root))
    manager.save(1)
    good = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1)
    manager.save(2)
    bad = root / checkpoint_name(2) / "model.safetensors"
    data = bytearray(bad.read_bytes())
    data[-1] ^= 0xFF
    bad.write_bytes(bytes(data))
    with pytest.warns(statekit.StatekitWarning, match=r"checkpoint-00000002/model\.safetensors"):
        assert manager.resume() == 1
    assert_state_equal(model.state_dict(), good)
    # the run goes on from step 1 and reaches step 2 again: the unloadable checkpoint is replaced
    with pytest.warns(statekit.StatekitWarning, match="skipped as unloadable"):
        manager.save(2)
    statekit.verify(str(root / checkpoint_name(2)))
    with pytest.raises(statekit.CheckpointExistsError):  # a loadable one is never replaced silently
        manager.save(2)


# The k-th write of the save of step 2 (the lock, the changed model's file, the hard link
# of the unchanged tensor's file from step 1 (an incremental save), its JSON, the manifest's
# temporary file, ``latest``); 0 kills at the manifest's os.link (the exclusive commit).


def test_a_checkpoint_skipped_for_a_missing_plugin_is_not_replaced(tmp_path, plugin_manager):
    """resume() falls back past a checkpoint whose plugin is not installed here: the
    checkpoint is good (another environment loads it), so saving its step again must not
    replace it silently."""

    class Taker:
        @statekit.hookimpl
        def statekit_save_state_pre(self, models, weights, checkpoint):
            models.pop(0)
            weights.pop(0)
            checkpoint.save_state("taken", {"ok": 1})

    root = str(tmp_path / "m")
    manager = statekit.CheckpointManager({"model": torch.nn.Linear(3, 3)}, root)
    manager.save(1)
    plugin_manager.register(Taker(), name="taker")
    manager.save(2)
    plugin_manager.unregister(name="taker")
    again = statekit.CheckpointManager({"model": torch.nn.Linear(3, 3)}, root)
    with pytest.warns(statekit.StatekitWarning, match="not available"):
        assert again.resume() == 1
    with pytest.raises(statekit.CheckpointExistsError):
        again.save(2)


def test_listing_returns_checkpoint_dirs(tmp_path, installed_plugin_manager):
    """A listing's entries are CheckpointDir (Checkpoint is the save/load context)."""
    manager = statekit.CheckpointManager(build(seed=0, stateful=False)[0], str(tmp_path))
    manager.save(1)
    listed = manager.list()
    assert len(listed) == 1 and type(listed[0]) is statekit.CheckpointDir
    assert listed[0].step == 1 and listed[0].committed
    assert not hasattr(statekit, "CheckpointInfo")  # the pre-release name is gone
