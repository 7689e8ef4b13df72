"""The optimizer-step barrier (statekit.engine.step_barrier) and version counters
(statekit.checks.versions): a step waits for an open reading; in-place writes are seen."""

from __future__ import annotations

import threading

import torch

from statekit.checks.versions import changed_since, versions
from statekit.engine.step_barrier import begin_reading, wait_for_readers


def _model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    return model, optimizer


def test_a_step_waits_until_the_reading_is_done():
    model, optimizer = _model_and_optimizer()
    before = model.weight.detach().clone()
    reading = begin_reading("test reader")
    entered, stepped = threading.Event(), threading.Event()

    def train():
        entered.set()
        optimizer.step()
        stepped.set()

    thread = threading.Thread(target=train)
    thread.start()
    entered.wait()
    # the step is held: the weights are still the reader's (checked while it waits)
    assert not stepped.wait(0.2)
    assert torch.equal(model.weight.detach(), before)
    reading.done()
    thread.join()
    assert stepped.is_set() and not torch.equal(model.weight.detach(), before)
    assert reading.waited_s > 0 and not reading.open
    reading.done()  # idempotent


def test_no_reading_no_wait():
    model, optimizer = _model_and_optimizer()
    optimizer.step()  # returns at once: nothing open
    assert wait_for_readers(timeout=0)


def test_versions_see_in_place_writes_and_replacements():
    model, optimizer = _model_and_optimizer()
    tensors = dict(model.state_dict(keep_vars=True))
    before = versions(tensors)
    assert changed_since(tensors, before) == []
    optimizer.step()
    assert changed_since(tensors, before) == ["weight", "bias"]
    after = versions(tensors)
    with torch.no_grad():
        model.bias.detach().zero_()  # through detach(): the same counter
    assert changed_since(tensors, after) == ["bias"]
    assert changed_since({"weight": torch.zeros(1)}, versions({"weight": model.weight})) == ["weight"]
    assert changed_since({}, {"weight": 0}) == ["weight"]
