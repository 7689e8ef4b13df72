"""``statekit_boundary_state``: a plugin's state captured at each step boundary, handed back
to its ``statekit_save_state_pre`` (``checkpoint.boundary_state()``) by a save of that
boundary (the save on a signal from the watcher thread), None in every other save."""

from __future__ import annotations

import os
import signal

from torch import nn

import statekit
from statekit import hookimpl


class Counting:
    """A plugin with a counter that the training loop changes (non-tensor state)."""

    def __init__(self) -> None:
        self.counter = 0
        self.saw: list = []

    @hookimpl
    def statekit_boundary_state(self, objects):
        return {"counter": self.counter, "objects": sorted(objects)}

    @hookimpl
    def statekit_save_state_pre(self, checkpoint):
        self.saw.append(checkpoint.boundary_state())


def test_hook_statekit_boundary_state(plugin_manager, tmp_path):
    plugin = Counting()
    plugin_manager.register(plugin, name="counting")
    model = nn.Linear(2, 2)
    with statekit.CheckpointManager({"model": model, "extra": {"x": 1}}, tmp_path,
                                    save_on_signal=statekit.PreemptionPolicy(on_signal="return")) as manager:
        manager.save(1)  # a save of the live state: boundary_state() is None
        plugin.counter = 5
        manager.step_boundary(2)
        plugin.counter = 9  # after the boundary: not what the signal's save writes
        os.kill(os.getpid(), signal.SIGTERM)
        assert manager.signal_save.watcher.finished.wait(30)
    assert manager.signal_save.result["from_watcher"] and manager.signal_save.result["step"] == 2
    assert plugin.saw == [None, {"counter": 5, "objects": ["extra"]}]
