"""strict=False: load what matches, report the rest (as ``load_state_dict(strict=False)``)."""

from __future__ import annotations

import pytest
import torch

import statekit
from statekit.testing import assert_state_equal


def _net(extra: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)] + ([torch.nn.Linear(2, 2)] if extra else [])
    return torch.nn.Sequential(*layers)


def test_strict_is_the_default(tmp_path):
    statekit.save(str(tmp_path / "c"), {"model": _net()})
    with pytest.raises(statekit.StateMismatchError, match="missing keys: 2.bias, 2.weight"):
        statekit.load(str(tmp_path / "c"), {"model": _net(extra=True)})


def test_partial_load_fills_shared_keys_and_reports_the_rest(tmp_path):
    saved = _net(extra=True)
    with torch.no_grad():
        for p in saved.parameters():
            p.add_(1.0)
    statekit.save(str(tmp_path / "c"), {"model": saved, "epoch": {"n": 3}})

    smaller = _net()
    other = torch.nn.Linear(1, 1)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    manifest = statekit.load(str(tmp_path / "c"), {"model": smaller, "aux": other}, strict=False)
    assert manifest.incompatible_keys == {"model": {"missing_keys": [], "unexpected_keys": ["2.bias", "2.weight"]}}
    assert manifest.missing_objects == ("aux",)
    assert_state_equal(smaller.state_dict(), {k: v for k, v in saved.state_dict().items() if not k.startswith("2.")})
    assert_state_equal(other.state_dict(), before)  # not in the checkpoint: left alone

    bigger = _net(extra=True)
    fresh_tail = {k: v.clone() for k, v in bigger.state_dict().items() if k.startswith("2.")}
    small = _net()
    statekit.save(str(tmp_path / "small"), {"model": small})
    manifest = statekit.load(str(tmp_path / "small"), {"model": bigger}, strict=False)
    assert manifest.incompatible_keys["model"] == {"missing_keys": ["2.bias", "2.weight"], "unexpected_keys": []}
    assert_state_equal({k: v for k, v in bigger.state_dict().items() if k.startswith("2.")}, fresh_tail)


def test_partial_load_still_refuses_a_shape_mismatch(tmp_path):
    statekit.save(str(tmp_path / "c"), {"model": torch.nn.Linear(3, 4)})
    wrong = torch.nn.Linear(3, 5)
    before = {k: v.clone() for k, v in wrong.state_dict().items()}
    with pytest.raises(statekit.StateMismatchError, match=r"weight \(saved \[4, 3\] torch.float32 vs model \[5, 3\]"):
        statekit.load(str(tmp_path / "c"), {"model": wrong}, strict=False)
    assert_state_equal(wrong.state_dict(), before)


def test_manager_and_load_state_take_strict(tmp_path, installed_plugin_manager):
    pytest.importorskip("accelerate")
    from accelerate_helpers import fresh_accelerator

    accelerator = fresh_accelerator()
    model = accelerator.prepare(_net(extra=True))
    manager = statekit.CheckpointManager(accelerator, str(tmp_path / "root"))
    manager.save(1)

    other = fresh_accelerator()
    smaller = other.prepare(_net())
    with pytest.raises(statekit.StateMismatchError):
        statekit.load_state(other, manager.url_for(1))
    manifest = statekit.load_state(other, manager.url_for(1), strict=False)
    assert manifest.incompatible_keys["model_0"]["unexpected_keys"] == ["2.bias", "2.weight"]
    again = statekit.CheckpointManager(other, str(tmp_path / "root"))
    assert again.resume(strict=False) == 1
    assert again.resumed_manifest.incompatible_keys["model_0"]["unexpected_keys"] == ["2.bias", "2.weight"]
    assert_state_equal(smaller.state_dict(), {k: v for k, v in model.state_dict().items() if not k.startswith("2.")})
