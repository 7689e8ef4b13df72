"""A model with load code of its own (load_state_dict hooks, a module overriding
``_load_from_state_dict`` or ``load_state_dict``) loads through ``load_state_dict``, so
that code runs; a plain one is filled in place (engine/read.custom_load)."""

from __future__ import annotations

import logging

import pytest
import torch

import statekit
from statekit.engine.read import custom_load


class Scaled(torch.nn.Linear):
    """Stores its weight doubled and halves it on load: its own _load_from_state_dict."""

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = destination[prefix + "weight"] * 2

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        state_dict[prefix + "weight"] = state_dict[prefix + "weight"] / 2
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def _pair(factory):
    torch.manual_seed(0)
    saved = factory()
    torch.manual_seed(1)
    return saved, factory()


def test_an_overridden_load_from_state_dict_runs(tmp_path):
    saved, fresh = _pair(lambda: torch.nn.Sequential(torch.nn.ReLU(), Scaled(3, 4)))
    statekit.save(tmp_path / "ckpt", {"model": saved})
    statekit.load(tmp_path / "ckpt", {"model": fresh})
    assert torch.equal(fresh[1].weight, saved[1].weight)  # filled in place it would be twice the value
    assert torch.equal(fresh[1].bias, saved[1].bias)


def test_load_state_dict_hooks_run(tmp_path):
    saved, fresh = _pair(lambda: torch.nn.Linear(3, 4))
    statekit.save(tmp_path / "ckpt", {"model": saved})
    seen = []
    fresh.register_load_state_dict_pre_hook(lambda module, state_dict, prefix, *a: seen.append(sorted(state_dict)))
    fresh.register_load_state_dict_post_hook(lambda module, keys: seen.append("post"))
    statekit.load(tmp_path / "ckpt", {"model": fresh})
    assert seen == [["bias", "weight"], "post"]
    assert torch.equal(fresh.weight, saved.weight)


def test_tied_weights_stay_tied_through_load_state_dict(tmp_path):
    def tied():
        model = torch.nn.Sequential(torch.nn.Embedding(5, 3), Scaled(3, 5))
        model[1].weight = model[0].weight
        return model

    saved, fresh = _pair(tied)
    statekit.save(tmp_path / "ckpt", {"model": saved})
    statekit.load(tmp_path / "ckpt", {"model": fresh})
    assert fresh[1].weight is fresh[0].weight
    assert torch.equal(fresh[0].weight, saved[0].weight)


def test_plain_models_and_torch_norms_are_filled_in_place(tmp_path, caplog):
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.InstanceNorm1d(4))
    assert custom_load(model) is None
    statekit.save(tmp_path / "ckpt", {"model": model})
    weight = model[0].weight
    with caplog.at_level(logging.DEBUG, logger="statekit"):
        statekit.load(tmp_path / "ckpt", {"model": model})
    assert model[0].weight is weight
    assert "loading through load_state_dict" not in caplog.text


@pytest.mark.parametrize(
    ("build", "reason"),
    [
        (lambda: torch.nn.Sequential(torch.nn.ReLU(), Scaled(2, 2)), "module '1' (Scaled) overrides _load_from_state_dict"),
        (lambda: type("Own", (torch.nn.Linear,), {"load_state_dict": lambda self, *a, **k: None})(2, 2),
         "Own overrides load_state_dict"),
    ],
)
def test_custom_load_names_the_module(build, reason):
    assert custom_load(build()) == reason


def test_a_hook_is_named_with_its_module():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model[0].register_load_state_dict_post_hook(lambda module, keys: None)
    assert custom_load(model) == "module '0' (Linear) has load_state_dict hooks"
