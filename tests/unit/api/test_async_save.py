"""Async saves: staging, one save in flight, errors at the next save/wait and at exit."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import statekit
from statekit.api.asyncsave import AsyncSaveError, PendingSave
from statekit.manager.manager import checkpoint_name
from statekit.testing import assert_state_equal


def test_checkpoint_holds_the_values_at_save_time(tmp_path, plugin_manager):
    model = torch.nn.Linear(256, 256)
    manager = statekit.CheckpointManager({"model": model}, str(tmp_path), async_save=True)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    pending = manager.save(1)
    assert isinstance(pending, PendingSave)
    with torch.no_grad():
        model.weight.add_(1.0)  # the training loop goes on right away
    manifest = manager.wait()
    assert manifest.step == 1
    fresh = torch.nn.Linear(256, 256)
    statekit.load(str(tmp_path / checkpoint_name(1)), {"model": fresh})
    assert_state_equal(fresh.state_dict(), expected)


def test_staging_buffers_are_reused(tmp_path, plugin_manager):
    model = torch.nn.Linear(64, 64)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    optim.step()
    manager = statekit.CheckpointManager({"model": model, "optim": optim}, str(tmp_path), async_save=True)
    manager.save(1)
    first = manager.staging.allocated_bytes
    for step in (2, 3, 4):
        manager.save(step)
    manager.wait()
    assert first > 0 and manager.staging.allocated_bytes == first


def test_tied_weights_stay_tied_through_staging(tmp_path, plugin_manager):
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = torch.nn.Sequential(emb, head)
    manager = statekit.CheckpointManager({"model": model}, str(tmp_path), async_save=True)
    manager.save(1)
    manager.wait()
    target = tmp_path / checkpoint_name(1) / "model.safetensors"
    from safetensors import safe_open

    with safe_open(str(target), "pt") as f:
        assert len(list(f.keys())) == 1  # stored once, the alias is in the metadata


def test_one_save_in_flight_and_post_hooks_at_wait(tmp_path, plugin_manager):
    order = []

    class Post:
        @statekit.hookimpl
        def statekit_save_state_post(self, checkpoint):
            order.append(("post", checkpoint.step))

    plugin_manager.register(Post(), name="post")
    t = torch.zeros(4)
    manager = statekit.CheckpointManager({"t": t}, str(tmp_path), async_save=True)
    manager.save(1)
    assert order == []  # post-hooks run on the caller's thread at the next save/wait
    manager.save(2)
    assert order == [("post", 1)]
    manager.wait()
    assert order == [("post", 1), ("post", 2)]
    assert [i.step for i in manager.list()] == [1, 2]


def test_failure_in_background_thread_keeps_traceback(tmp_path, plugin_manager, monkeypatch):
    t = torch.zeros(4)
    manager = statekit.CheckpointManager({"t": t}, str(tmp_path), async_save=True)

    def broken_flush(self):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(statekit.Checkpoint, "flush", broken_flush)
    manager.save(1)
    with pytest.raises(AsyncSaveError, match=rf"background save to .*{checkpoint_name(1)} failed") as info:
        manager.save(2)
    assert isinstance(info.value.__cause__, OSError)
    assert info.value.__cause__.__traceback__ is not None
    monkeypatch.undo()
    assert manager.latest() is None  # nothing committed
    manager.save(3)
    manager.wait()
    assert manager.latest().endswith(checkpoint_name(3))


def test_context_manager_waits(tmp_path, plugin_manager):
    t = torch.arange(3.0)
    with statekit.CheckpointManager({"t": t}, str(tmp_path), async_save=True) as manager:
        manager.save(1)
    assert manager.pending is None and manager.latest().endswith(checkpoint_name(1))


def test_async_saves_sharing_a_staging_pool_keep_each_saves_values(tmp_path, plugin_manager, monkeypatch):
    """Two async saves given one StagingPool (the bridge's ``staging=``), the second started
    while the first still writes: the first checkpoint held the second's weights (valid
    checksums, no error); now the second save waits for the pool."""
    import threading

    from statekit.api.saveload import save_objects
    from statekit.engine.context import Checkpoint
    from statekit.engine.entries import classify
    from statekit.engine.staging import StagingPool

    gate = threading.Event()
    flush = Checkpoint.flush

    def slow_flush(self):
        gate.wait(5)  # the first write goes on only once the second save has staged (or waited)
        flush(self)

    monkeypatch.setattr(Checkpoint, "flush", slow_flush)
    model, pool, pending = torch.nn.Linear(64, 64), StagingPool(), []
    with torch.no_grad():
        model.weight.fill_(1.0)
    pending.append(save_objects(str(tmp_path / "a"), [classify("model", model)], blocking=False, staging=pool))
    with torch.no_grad():
        model.weight.fill_(2.0)
    second = threading.Thread(
        target=lambda: pending.append(save_objects(str(tmp_path / "b"), [classify("model", model)], blocking=False, staging=pool))
    )
    second.start()
    second.join(0.3)
    gate.set()
    second.join()
    for p in pending:
        p.wait()
    for name, value in (("a", 1.0), ("b", 2.0)):
        fresh = torch.nn.Linear(64, 64)
        statekit.load(str(tmp_path / name), {"model": fresh})
        assert fresh.weight.unique().tolist() == [value], name
