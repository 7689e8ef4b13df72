"""CheckpointManager's option groups (RetentionPolicy, AsyncPolicy, PreemptionPolicy) and a
Storage as its root: a group and its flat keywords make the same manager, a bad value is an
InvalidOptionError when the group is built, and a group together with one of its own flat
keywords is refused."""

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


def test_retention_group_keeps_what_the_flat_keywords_keep(tmp_path):
    grouped = statekit.CheckpointManager(objects(), str(tmp_path / "a"),
                                         retention=RetentionPolicy(keep_last=1, keep_best=1, mode="max"))
    flat = statekit.CheckpointManager(objects(), str(tmp_path / "b"), keep_last=1, keep_best=1, mode="max")
    assert grouped.retention == flat.retention
    for manager in (grouped, flat):
        for step, loss in ((1, 0.5), (2, 0.9), (3, 0.1), (4, 0.2)):
            manager.save(step=step, metrics={"loss": loss})
    assert steps(grouped) == steps(flat) == [2, 4]  # best by max loss, and the newest


def test_defaults_are_the_documented_ones(tmp_path):
    manager = statekit.CheckpointManager(objects(), str(tmp_path / "run"))
    assert manager.retention == RetentionPolicy() and manager.retention.keeps_all
    assert manager.async_policy == AsyncPolicy(enabled=False, backpressure="wait", max_wait_s=300.0)
    assert manager.preemption is None and manager.signal_save is None


def test_async_policy_makes_saves_background_ones(tmp_path):
    with statekit.CheckpointManager(objects(), str(tmp_path / "run"), async_policy=AsyncPolicy()) as manager:
        manager.save(step=1)
        assert manager.pending_step == 1  # handed to the writer thread, not committed by save()
    assert steps(manager) == [1]


def test_preemption_group_installs_the_handlers_the_flat_keywords_install(tmp_path):
    before = signal.getsignal(signal.SIGUSR2)
    with statekit.CheckpointManager(objects(), str(tmp_path / "a"),
                                    preemption=PreemptionPolicy(signals="USR2", grace_s=5, on_signal="return")) as grouped:
        assert grouped.preemption == PreemptionPolicy(signals=(signal.SIGUSR2,), grace_s=5.0, on_signal="return")
        assert grouped.signal_save.signals == (signal.SIGUSR2,) and grouped.signal_save.grace_s == 5.0
        assert signal.getsignal(signal.SIGUSR2) is not before
    assert signal.getsignal(signal.SIGUSR2) is before
    with statekit.CheckpointManager(objects(), str(tmp_path / "b"), save_on_signal="USR2", grace_s=5,
                                    on_signal="return") as flat:
        assert flat.preemption == grouped.preemption


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
    (lambda: PreemptionPolicy(check_every=0), r"PreemptionPolicy.check_every \(signal_check_every=\) must be a positive"),
])
def test_a_bad_value_is_refused_when_the_group_is_built(make, message):
    with pytest.raises(InvalidOptionError, match=message):
        make()


@pytest.mark.parametrize("kwargs, named", [
    ({"retention": RetentionPolicy(keep_last=2), "keep_last": 3}, "keep_last"),
    ({"retention": RetentionPolicy(), "monitor": "acc"}, "monitor"),
    ({"async_policy": AsyncPolicy(), "backpressure": "skip"}, "backpressure"),
    ({"preemption": PreemptionPolicy(), "grace_s": 10}, "grace_s"),
    ({"preemption": PreemptionPolicy(), "save_on_signal": True}, "save_on_signal"),
])
def test_a_group_with_its_own_flat_keyword_is_refused(tmp_path, kwargs, named):
    with pytest.raises(InvalidOptionError, match=rf"keyword\(s\) {named} set the same options"):
        statekit.CheckpointManager(objects(), str(tmp_path / "run"), **kwargs)
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


def test_a_none_flat_keyword_is_its_default_beside_a_group(tmp_path):
    """``keep_last=args.keep_last`` (None) beside ``retention=`` is the default, not a conflict."""
    manager = statekit.CheckpointManager(objects(), str(tmp_path / "run"), keep_last=None, grace_s=None,
                                         retention=RetentionPolicy(keep_best=2))
    assert manager.retention == RetentionPolicy(keep_best=2)


def test_preemption_keywords_without_save_on_signal_warn_that_they_do_nothing(tmp_path):
    with pytest.warns(statekit.StatekitWarning, match=r"grace_s, on_signal given without save_on_signal"):
        manager = statekit.CheckpointManager(objects(), str(tmp_path / "run"), grace_s=5, on_signal="return")
    assert manager.preemption is None
