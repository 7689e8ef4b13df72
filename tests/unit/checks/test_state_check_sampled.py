"""The CPU default (a sampled digest) measured against the fault matrix on tensors large
enough to be sampled (>= 65,536 elements): what it sees and what it may miss is exactly
what docs/concepts.md ("State check") says, and ``STATEKIT_STATE_CHECK=full`` sees every
fault. The same faults on small tensors (every element digested) are
tests/unit/checks/test_state_check.py."""

from __future__ import annotations

import pytest
import torch

import statekit
from statekit.checks.state_check import MODE_ENV
from statekit.checks.digest import Sampling

WIDTH = 512  # a [512, 512] weight: 262,144 elements, sampled by default
SAMPLING = Sampling()


class Big(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(WIDTH, WIDTH)
        self.hidden = torch.nn.Linear(WIDTH, WIDTH)
        self.norm = torch.nn.BatchNorm1d(WIDTH)
        self.head = torch.nn.Linear(WIDTH, WIDTH, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, x):
        return self.head(self.norm(torch.relu(self.hidden(self.embed(x)))))


def _objects(seed):
    torch.manual_seed(seed)
    model = Big()
    return {"model": model, "optimizer": torch.optim.AdamW(model.parameters(), lr=0.01)}


@pytest.fixture(scope="module", params=["sampled", "full"])
def saved(request, tmp_path_factory):
    """A trained Big and its AdamW saved with the digest of ``request.param``."""
    mp = pytest.MonkeyPatch()
    mp.setenv(MODE_ENV, request.param)
    objects = _objects(0)
    for _ in range(2):
        objects["model"](torch.arange(8)).sum().backward()
        objects["optimizer"].step()
        objects["optimizer"].zero_grad()
    url = str(tmp_path_factory.mktemp("big") / "ckpt")
    statekit.save(url, objects)
    yield request.param, url
    mp.undo()


def _covers_a_block(start, stop):
    """Whether flat positions [start, stop) include a sampled one (i % stride < block)."""
    first = (start // SAMPLING.stride) * SAMPLING.stride
    return any(max(start, b) < min(stop, b + SAMPLING.block) for b in range(first, stop, SAMPLING.stride))


def _rows(first, count):
    return first * WIDTH, (first + count) * WIDTH


def _zero_rows(first, count):
    def fault(objects):
        objects["model"].hidden.weight[first:first + count].zero_()
    return fault


def _swap_halves(objects):
    w = objects["model"].hidden.weight
    w.copy_(torch.cat([w[WIDTH // 2:], w[:WIDTH // 2]]))


def _drop_moments(objects):
    for state in objects["optimizer"].state.values():
        state["exp_avg"].zero_()


def _untie(objects):
    model = objects["model"]
    model.head.weight = torch.nn.Parameter(model.embed.weight.detach() + 1)


def _reset_buffer(objects):
    objects["model"].norm.running_var.fill_(1.0)


# (fault, the tensor it names, whether the sampled digest must see it)
FAULTS = {
    "moments-dropped": (_drop_moments, r"exp_avg of 'hidden\.weight' is all zeros", True),
    "shards-swapped": (_swap_halves, r"model 'model': hidden\.weight differs", True),
    "tie-broken": (_untie, r"model 'model': head\.weight differs", True),
    "buffer-not-restored": (_reset_buffer, r"model 'model': norm\.running_var differs", True),  # 512 elements: whole
    "slice-of-8-rows": (_zero_rows(40, 8), r"model 'model': hidden\.weight", True),  # 4,096 elements >= 4,081
    "slice-of-3-rows-on-a-block": (_zero_rows(8, 3), r"model 'model': hidden\.weight", _covers_a_block(*_rows(8, 3))),
    "slice-of-3-rows-between-blocks": (_zero_rows(3, 3), r"model 'model': hidden\.weight", _covers_a_block(*_rows(3, 3))),
}


def _load_with(monkeypatch, url, fault):
    objects = _objects(1)
    original = statekit.engine.read.LoadPlan.read

    def faulty(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        with torch.no_grad():
            fault(objects)
        return result

    monkeypatch.setattr(statekit.engine.read.LoadPlan, "read", faulty)
    if fault is _drop_moments:  # the optimizer loads after the model: fault it after its own load
        monkeypatch.undo()
        load = torch.optim.AdamW.load_state_dict

        def dropping(self, state_dict):
            load(self, state_dict)
            _drop_moments(objects)

        monkeypatch.setattr(torch.optim.AdamW, "load_state_dict", dropping, raising=False)
    statekit.load(url, objects)


def test_the_documented_rule_predicts_the_three_row_slices():
    assert _covers_a_block(*_rows(8, 3))  # rows 8-10 start at position 4,096: a block
    assert not _covers_a_block(*_rows(3, 3))  # rows 3-5: positions 1,536-3,071, between the blocks at 0 and 4,096


@pytest.mark.parametrize("name", list(FAULTS))
def test_each_fault_is_named_or_missed_as_documented(saved, monkeypatch, name):
    mode, url = saved
    fault, named, sampled_sees = FAULTS[name]
    if mode == "full" or sampled_sees:
        with pytest.warns(statekit.StateCheckWarning, match=named):
            _load_with(monkeypatch, url, fault)
    else:  # a change confined to fewer than 4,081 elements between the blocks: the documented miss
        _load_with(monkeypatch, url, fault)  # (any StateCheckWarning fails the test: pytest's filterwarnings)
