"""Storage never blocks training (issue 30 items 3-4): back-pressure of async saves, a
bounded replication backlog, no retry on a full remote tier, and ``manager.stats()``.

The slow save is real: a plugin's commit hook (which runs on an async save's writer
thread) holds the write open until the test releases it, so "still writing" is a state
the test controls, not a race it sleeps through.
"""

from __future__ import annotations

import errno
import json
import signal
import threading
import uuid
import warnings

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

import statekit
from statekit import hookimpl
from statekit.testing import assert_state_equal


class HoldCommit:
    """Keeps every async save "writing" until ``release`` is set."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()

    @hookimpl
    def statekit_checkpoint_committed(self, url, manifest, manager):
        self.entered.set()
        assert self.release.wait(60), "the test never released the save"


@pytest.fixture
def held(plugin_manager):
    hold = HoldCommit()
    plugin_manager.register(hold, name="hold-commit")
    yield hold
    hold.release.set()


def _skips(caught):
    return [str(w.message) for w in caught if "skipped" in str(w.message)]


def test_skip_policy_skips_a_save_while_the_previous_one_writes(held, tmp_path):
    model = torch.nn.Linear(8, 8)
    manager = statekit.CheckpointManager({"model": model}, str(tmp_path), async_save=statekit.AsyncPolicy(backpressure="skip"))
    manager.save(1)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    assert held.entered.wait(30)
    with torch.no_grad():
        model.weight.add_(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert manager.save(2) is None
        assert manager.save(3) is None
    messages = _skips(caught)
    assert len(messages) == 2
    assert messages[0].startswith("save of step 2 skipped: the async save to ")
    assert "checkpoint-00000001 is still writing" in messages[0] and "backpressure='skip'" in messages[0]
    assert "2 save(s) skipped in this run; the newest committed checkpoint stays latest" in messages[1]
    stats = manager.stats()
    assert stats.skipped_saves == 2 and stats.save_count == 3
    assert [(r.step, r.outcome) for r in stats.saves] == [(1, "writing"), (2, "skipped"), (3, "skipped")]
    held.release.set()
    manager.wait()
    assert [(i.step, i.committed) for i in manager.list()] == [(1, True)]
    # the next save after the write finished is made as usual
    manager.save(4)
    manager.wait()
    assert [(i.step, i.committed) for i in manager.list()] == [(1, True), (4, True)]
    fresh = torch.nn.Linear(8, 8)
    resumed = statekit.CheckpointManager({"model": fresh}, str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert resumed.resume() == 4
    assert_state_equal(fresh.state_dict(), model.state_dict())
    assert not torch.equal(saved["weight"], model.state_dict()["weight"])


def test_wait_policy_waits_up_to_its_bound_then_skips(held, tmp_path):
    manager = statekit.CheckpointManager({"model": torch.nn.Linear(8, 8)}, str(tmp_path), async_save=statekit.AsyncPolicy(max_wait_s=0.2))
    manager.save(1)
    assert held.entered.wait(30)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert manager.save(2) is None
    [message] = _skips(caught)
    assert "(backpressure='wait', max_wait_s=0.2)" in message
    record = manager.stats().saves[-1]
    assert record.outcome == "skipped" and record.step == 2
    assert 0.2 <= record.waited_s <= record.blocking_s
    held.release.set()
    assert manager.wait().step == 1


def test_wait_policy_saves_once_the_previous_save_is_done(held, tmp_path):
    manager = statekit.CheckpointManager({"model": torch.nn.Linear(8, 8)}, str(tmp_path), async_save=statekit.AsyncPolicy(max_wait_s=60))
    manager.save(1)
    assert held.entered.wait(30)
    held.release.set()  # finishes while save(2) waits
    manager.save(2)
    manager.wait()
    stats = manager.stats()
    assert stats.skipped_saves == 0 and [r.outcome for r in stats.saves] == ["writing", "writing"]
    assert [(i.step, i.committed) for i in manager.list()] == [(1, True), (2, True)]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"backpressure": "drop"}, "backpressure must be one of ('wait', 'skip'), got 'drop'"),
        ({"max_wait_s": -1}, "max_wait_s must be a finite number of seconds >= 0 or None, got -1"),
        ({"max_wait_s": float("inf")}, "max_wait_s must be a finite number of seconds >= 0 or None, got inf"),
    ],
)
def test_bad_backpressure_options_are_refused(plugin_manager, tmp_path, options, message):
    with pytest.raises(statekit.InvalidOptionError) as info:
        statekit.CheckpointManager({"model": torch.nn.Linear(2, 2)}, str(tmp_path), async_save=statekit.AsyncPolicy(**options))
    assert str(info.value) == message


def test_stats_count_the_steps_a_resume_goes_back(plugin_manager, tmp_path):
    model = torch.nn.Linear(4, 4)
    manager = statekit.CheckpointManager({"model": model}, str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        manager.save(10)
        manager.save(20)
    (tmp_path / "checkpoint-00000030").mkdir()  # a save the run started when it was killed
    again = statekit.CheckpointManager({"model": torch.nn.Linear(4, 4)}, str(tmp_path))
    assert again.stats().steps_lost_on_resume is None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert again.resume() == 20
    stats = json.loads(again.stats().to_json())
    assert (stats["resumed_step"], stats["reached_step"], stats["steps_lost_on_resume"]) == (20, 30, 10)
    assert stats["replication"] is None and stats["saves"] == []


# --------------------------------------------------------------------------- the remote tier


class FullFileSystem(MemoryFileSystem):
    """A remote tier that is out of space: every write fails with ENOSPC."""

    protocol = "fulldisk"
    tries = 0

    def _open(self, path, mode="rb", **kwargs):
        if "w" in mode or "a" in mode:
            FullFileSystem.tries += 1
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return super()._open(path, mode, **kwargs)

    def pipe_file(self, path, value, **kwargs):
        FullFileSystem.tries += 1
        raise OSError(errno.ENOSPC, "No space left on device", path)


def test_a_full_remote_tier_is_not_retried(plugin_manager, tmp_path):
    fsspec.register_implementation("fulldisk", FullFileSystem, clobber=True)
    FullFileSystem.tries = 0
    manager = statekit.CheckpointManager({"model": torch.nn.Linear(4, 4)}, str(tmp_path / "local"),
                                         replicate_to="fulldisk://bucket/run")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        manager.save(1)
        assert manager.plugin_state["replicate"].wait(timeout=60) == ["checkpoint-00000001"]
    messages = [str(w.message) for w in caught]
    assert any("fulldisk://bucket/run/checkpoint-00000001: replication failed with ENOSPC (no space left); not retried"
               in m for m in messages), messages
    assert not any("retrying in" in m for m in messages)
    assert FullFileSystem.tries == 1
    assert "ENOSPC" in manager.plugin_state["replicate"].failed["checkpoint-00000001"]
