"""A remote tier frozen (its moto S3 server stopped with SIGSTOP) while training saves
asynchronously: no save blocks, the replication backlog is bounded and reported, and
everything is replicated once the server runs again (the in-process back-pressure tests are
in ``unit/manager/test_backpressure.py``)."""

from __future__ import annotations

import signal
import threading
import uuid
import warnings

import torch

import statekit


def test_a_frozen_remote_tier_never_blocks_a_save(frozen_s3, plugin_manager, tmp_path):
    """The remote tier frozen (SIGSTOP) for 5 s while training saves: no save() call
    blocks a second (measured by manager.stats()), the backlog is bounded and reported,
    and everything is replicated once the server runs again."""
    server, options = frozen_s3
    remote = f"s3://frozen/run-{uuid.uuid4().hex[:6]}"
    model = torch.nn.Linear(64, 64)
    manager = statekit.CheckpointManager({"model": model}, str(tmp_path / "local"), async_save=True,
                                         replicate_to=remote, replicate_options=options, replicate_max_backlog=3)
    manager.plugin_state["replicate"].backoff_seconds = 0.2
    thawed = threading.Event()
    server.send_signal(signal.SIGSTOP)
    timer = threading.Timer(5.0, lambda: (server.send_signal(signal.SIGCONT), thawed.set()))
    timer.start()
    step = 0
    frozen_backlog = None
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            while not thawed.is_set():
                step += 1
                with torch.no_grad():
                    model.weight.add_(1)
                manager.save(step)
                if step == 5:
                    frozen_backlog = manager.stats().replication
    finally:
        timer.cancel()
        server.send_signal(signal.SIGCONT)
    stats = manager.stats()
    assert step >= 5
    assert stats.blocking_s_max < 1.0, [r for r in stats.saves if r.blocking_s >= 1.0]
    assert frozen_backlog is not None and 1 <= frozen_backlog["checkpoints"] <= 3 and frozen_backlog["bytes"] > 0
    assert stats.replication["dropped"] >= 1
    assert any("not replicated: the backlog is full (3 checkpoints queued" in str(w.message) for w in caught)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        manager.wait(timeout=120)
    newest = f"{remote}/checkpoint-{step:08d}"
    statekit.verify(newest, storage_options=options)
    assert manager.stats().replication["checkpoints"] == 0
