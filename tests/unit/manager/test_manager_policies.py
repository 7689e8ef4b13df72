"""CheckpointManager's option groups (RetentionPolicy, AsyncPolicy, PreemptionPolicy) and a
Storage as its root: a bad value is an InvalidOptionError when the group is built, and a
removed flat keyword, or keep_last= beside retention=, is refused naming the fix."""

from __future__ import annotations

import signal

import pytest
import torch

import statekit
from statekit import AsyncPolicy, InvalidOptionError, PreemptionPolicy, RetentionPolicy
from statekit.storage import Storage


def objects():
    torch.manual_seed(0)
    return {"model": torch.nn.Linear(3, 2)}


def steps(manager):
    return [i.step for i in manager.list() if i.committed]


def test_defaults_are_the_documented_ones(tmp_path):
    manager = statekit.CheckpointManager(objects(), str(tmp_path / "run"))
    assert manager.retention == RetentionPolicy() and manager.retention.keeps_all
    assert manager.async_policy == AsyncPolicy(enabled=False, backpressure="wait", max_wait_s=300.0)
    assert manager.preemption is None and manager.signal_save is None


def test_async_policy_makes_saves_background_ones(tmp_path):
    with statekit.CheckpointManager(objects(), str(tmp_path / "run"), async_save=AsyncPolicy()) as manager:
        manager.save(step=1)
        assert manager.pending_step == 1  # handed to the writer thread, not committed by save()
    assert steps(manager) == [1]


@pytest.mark.parametrize("make, message", [
    (lambda: RetentionPolicy(keep_last=0), "keep_last must be a positive integer"),
    (lambda: RetentionPolicy(keep_best=True), "keep_best must be a positive integer"),
    (lambda: RetentionPolicy(mode="best"), "mode must be 'min' or 'max'"),
    (lambda: AsyncPolicy(backpressure="drop"), "backpressure must be one of"),
    (lambda: AsyncPolicy(max_wait_s=float("inf")), "max_wait_s must be a finite number"),
    (lambda: AsyncPolicy(enabled="yes"), r"AsyncPolicy.enabled \(async_save=\) must be True or False"),
    (lambda: RetentionPolicy(keep_best=1, monitor=""), "monitor must be a metric name"),
    (lambda: PreemptionPolicy(signals="SIGKILL"), "SIGKILL cannot be handled"),
    (lambda: PreemptionPolicy(grace_s=0), "grace_s must be a positive number"),
    (lambda: PreemptionPolicy(on_signal="stop"), "on_signal must be 'exit' or 'return'"),
    (lambda: PreemptionPolicy(check_every=0), r"PreemptionPolicy.check_every must be a positive integer"),
])
def test_a_bad_value_is_refused_when_the_group_is_built(make, message):
    with pytest.raises(InvalidOptionError, match=message):
        make()


@pytest.mark.parametrize("kwargs, message", [
    ({"keep_best": 2}, r"takes no keep_best=: pass retention=statekit.RetentionPolicy\(keep_best=2\)"),
    ({"grace_s": 5}, r"takes no grace_s=: pass save_on_signal=statekit.PreemptionPolicy\(grace_s=5\)"),
    ({"keep_last": 3, "retention": RetentionPolicy(keep_last=2)}, r"keep_last=3 and retention=RetentionPolicy"),
])
def test_a_removed_or_doubled_keyword_is_refused_naming_the_fix(tmp_path, kwargs, message):
    with pytest.raises(InvalidOptionError, match=message):
        statekit.CheckpointManager({}, str(tmp_path / "run"), **kwargs)
    assert not (tmp_path / "run").exists()


def test_a_group_of_the_wrong_class_is_named(tmp_path):
    with pytest.raises(InvalidOptionError, match=r"retention must be a statekit.RetentionPolicy, got dict"):
        statekit.CheckpointManager(objects(), str(tmp_path / "run"), retention={"keep_last": 2})


def test_a_storage_as_root_carries_its_options(tmp_path):
    root = Storage(f"memory://{tmp_path.name}/run", {"skip_instance_cache": True})
    manager = statekit.CheckpointManager(objects(), root, keep_last=1)
    assert manager.root is root and manager.storage_options == {"skip_instance_cache": True}
    manager.save(step=1)
    manager.save(step=2)
    assert steps(manager) == [2]
    with pytest.raises(InvalidOptionError, match="storage_options given with a Storage, which carries its own"):
        statekit.CheckpointManager(objects(), root, storage_options={"skip_instance_cache": True})


def test_keep_last_none_beside_retention_is_the_default_not_a_conflict(tmp_path):
    manager = statekit.CheckpointManager(objects(), str(tmp_path / "run"), keep_last=None,
                                         retention=RetentionPolicy(keep_best=2))
    assert manager.retention == RetentionPolicy(keep_best=2)
