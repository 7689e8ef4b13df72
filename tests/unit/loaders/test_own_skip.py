"""statekit.loaders.own_skip: the hold of a resumed pass, driven by the generator shape of
statekit.loaders.tracking._tracked_iter (attach-mode resumes through real loaders:
tests/unit/api/test_attach_script_patterns.py, tests/integration/clients)."""

from __future__ import annotations

import sys

import pytest
import torch

import statekit
from statekit.loaders import own_skip


def _held_pass(hold, batches):
    """What _tracked_iter does around each yield."""
    for batch in batches:
        hold.yielded(sys._getframe())
        yield batch
        while hold.skipped():
            hold.yielded(sys._getframe())
            yield batch
    hold.close()


def _activity_hooks() -> int:
    """The global hooks own_skip holds now: not the step barrier's one permanent optimizer
    pre-hook (statekit.engine.step_barrier), which an earlier test on the same worker
    (tests/unit/engine/test_step_barrier.py) may have installed in this process."""
    from torch.optim.optimizer import _global_optimizer_pre_hooks

    from statekit.engine import step_barrier

    barrier = {handle.id for handle in step_barrier._hook}
    return len(torch.nn.modules.module._global_forward_pre_hooks) + len(set(_global_optimizer_pre_hooks) - barrier)


def test_an_optimizer_step_without_a_module_forward_counts_as_training():
    """A functional loop (no nn.Module call): the optimizer's step pre-hook, which torch calls
    while it iterates its live hook table, is the signal (and its removal waits until after)."""
    weight = torch.zeros(2, requires_grad=True)
    optimizer = torch.optim.SGD([weight], lr=0.1)
    trained = []
    for step, batch in enumerate(_held_pass(own_skip.Hold(2, "loader", 0), [10, 11, 12])):
        if step < 2:
            continue
        weight.grad = torch.full((2,), float(batch))
        optimizer.step()
        trained.append(batch)
    assert trained == [10, 11, 12]  # the loop's own skip of 2 landed on the first resumed batch
    assert _activity_hooks() == 0


def test_the_global_hooks_are_off_while_the_training_step_runs():
    """Armed at a yield, taken off by the first forward: the rest of the step (a compiled model's
    graph) runs as in a run that never resumed."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    during = []

    class Probe(torch.nn.Module):
        def forward(self, x):
            during.append(_activity_hooks())
            return x

    probe = Probe()
    for batch in _held_pass(own_skip.Hold(1, "loader", 0), [torch.ones(1, 2)]):
        probe(model(batch))
    assert during == [0] and _activity_hooks() == 0


def test_a_loop_that_trains_on_everything_is_never_held_and_one_that_collects_neither():
    model = torch.nn.Linear(2, 1)
    trained = [b for b in _held_pass(own_skip.Hold(3, "loader", 0), [1, 2, 3]) if model(torch.ones(2)) is not None]
    assert trained == [1, 2, 3]
    assert list(_held_pass(own_skip.Hold(3, "loader", 0), [1, 2, 3])) == [1, 2, 3]  # no `continue` executed


def test_a_skip_of_fewer_batches_than_were_consumed_is_named():
    model = torch.nn.Linear(2, 1)
    trained = []
    with pytest.warns(statekit.StatekitWarning, match=r"skipped 1 batch without training before it trained on batch 3"):
        for step, batch in enumerate(_held_pass(own_skip.Hold(3, "loader", 0), [1, 2, 3])):
            if step < 1:
                continue
            model(torch.ones(2))
            trained.append(batch)
    assert trained == [1, 2, 3]
