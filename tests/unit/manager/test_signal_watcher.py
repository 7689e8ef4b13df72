"""The save on a signal from the watcher thread, in one process: a step boundary's state by
reference (engine/moment) and its proof, the watcher's save while the main thread is away
from a safe point, its fallback, the chained wakeup fd, a second signal."""

from __future__ import annotations

import os
import signal
import socket

import pytest
import torch

import statekit
from statekit.engine import moment as moments
from statekit.engine.entries import classify
from statekit.errors import InvalidOptionError


def _run(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2)
    return model, optimizer, scheduler


def _step(model, optimizer, scheduler) -> None:
    model(torch.randn(6, 4)).sum().backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


def _entries(model, optimizer, scheduler):
    return [classify("model", model), classify("optimizer", optimizer), classify("scheduler", scheduler)]


def test_a_moment_names_the_tensors_written_since_its_boundary_and_resolves_only_unchanged_state():
    model, optimizer, scheduler = _run()
    _step(model, optimizer, scheduler)
    index = moments.TensorIndex()
    moment = moments.capture(1, _entries(model, optimizer, scheduler), index)
    assert moment.changed() == []
    resolved = moments.resolve(moment, _entries(model, optimizer, scheduler))
    assert torch.equal(resolved.states["model"]["0.weight"], model[0].weight)
    assert resolved.states["scheduler"]["last_epoch"] == 1
    scheduler.step()  # a later step of the scheduler does not change the moment's copy
    assert moment.states["scheduler"]["last_epoch"] == 1
    model.train()
    with torch.no_grad():
        model(torch.randn(6, 4))  # BatchNorm: running statistics and num_batches_tracked
    assert moment.changed() == ["model.1.num_batches_tracked"]
    with pytest.raises(moments.MomentChangedError, match=r"^model\.1\.num_batches_tracked changed since step 1$"):
        moments.resolve(moment, _entries(model, optimizer, scheduler))


def test_a_replaced_parameter_or_changed_lr_is_not_the_boundarys_state():
    model, optimizer, scheduler = _run()
    _step(model, optimizer, scheduler)
    moment = moments.capture(1, _entries(model, optimizer, scheduler), moments.TensorIndex())
    optimizer.param_groups[0]["lr"] = 0.5
    with pytest.raises(moments.MomentChangedError, match=r"^optimizer's param_groups changed since step 1$"):
        moments.resolve(moment, _entries(model, optimizer, scheduler))
    optimizer.param_groups[0]["lr"] = moment.states["optimizer"]["param_groups"][0]["lr"]
    model[2].bias = torch.nn.Parameter(model[2].bias.detach().clone())
    with pytest.raises(moments.MomentChangedError,
                       match=r"^model\.2\.bias is not the tensor step 1's boundary recorded \(created or replaced since\)$"):
        moments.resolve(moment, _entries(model, optimizer, scheduler))


def test_a_signal_away_from_a_safe_point_is_saved_from_the_watcher_with_the_boundarys_random_state(tmp_path):
    model, optimizer, scheduler = _run()
    policy = statekit.PreemptionPolicy(on_signal="return")
    with statekit.CheckpointManager({"model": model, "optimizer": optimizer, "scheduler": scheduler}, tmp_path,
                                    save_on_signal=policy) as manager:
        for step in (1, 2, 3):
            _step(model, optimizer, scheduler)
            manager.step_boundary(step)
        at_boundary = torch.get_rng_state()
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        torch.randn(100)  # the evaluation draws from the global generator after the boundary
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal: counted, nothing else
        assert manager.signal_save.watcher.finished.wait(30)
        assert manager.should_stop and manager.step_boundary(4)  # no save of step 4
    result = manager.signal_save.result
    assert result["step"] == 3 and result["from_watcher"] is True and result["saved"] is True
    assert result["path"].startswith("saved from the watcher at step 3 while the main thread was in ")
    assert manager.signal_save.signal_count == 2
    assert [c.step for c in manager.list()] == [3]
    model2, optimizer2, scheduler2 = _run(seed=1)
    resumed = statekit.CheckpointManager({"model": model2, "optimizer": optimizer2, "scheduler": scheduler2}, tmp_path)
    assert resumed.resume() == 3
    assert all(torch.equal(weights[k], v) for k, v in model2.state_dict().items())
    assert torch.equal(torch.get_rng_state(), at_boundary)  # statekit-rng wrote the boundary's generator


def test_a_tensor_written_since_the_boundary_falls_back_to_the_next_step_boundary(tmp_path):
    model, optimizer, scheduler = _run()
    with statekit.CheckpointManager({"model": model, "optimizer": optimizer}, tmp_path,
                                    save_on_signal=statekit.PreemptionPolicy(on_signal="return")) as manager:
        _step(model, optimizer, scheduler)
        manager.step_boundary(1)
        with torch.no_grad():
            model[0].weight.add_(1.0)  # in place, outside an optimizer step
        os.kill(os.getpid(), signal.SIGTERM)
        assert manager.signal_save.watcher.finished.wait(30)
        assert manager.signal_save.result is None and not manager.should_stop
        assert manager.step_boundary(2)  # today's path
    assert manager.signal_save.result["path"] == ("fell back: model.0.weight changed since step 1; saved at the step "
                                                  "boundary 2")
    assert [c.step for c in manager.list()] == [2]


def test_a_wakeup_fd_set_before_receives_every_signal_byte_and_is_put_back(tmp_path):
    theirs, ours = socket.socketpair()
    ours.setblocking(False)
    previous = signal.set_wakeup_fd(ours.fileno())
    try:
        model, optimizer, _ = _run()
        with statekit.CheckpointManager({"model": model}, tmp_path,
                                        save_on_signal=statekit.PreemptionPolicy(on_signal="return")) as manager:
            manager.step_boundary(1)
            os.kill(os.getpid(), signal.SIGUSR1)
            assert manager.signal_save.watcher.finished.wait(30)
            assert theirs.recv(8) == bytes([signal.SIGUSR1])  # forwarded by the watcher
        assert signal.set_wakeup_fd(ours.fileno()) == ours.fileno()  # ours is back in place
    finally:
        signal.set_wakeup_fd(previous)
        theirs.close()
        ours.close()


@pytest.mark.parametrize("field, value, message", [
    ("watcher", "yes", "PreemptionPolicy.watcher must be True or False, got 'yes'"),
    ("before_exit", 3, "PreemptionPolicy.before_exit must be a callable or None, got 3"),
])
def test_bad_watcher_options_are_refused_by_name(field, value, message):
    with pytest.raises(InvalidOptionError, match=f"^{message}$"):
        statekit.PreemptionPolicy(**{field: value})
