"""Saves that are refused, naming why (docs/bad-input.md): a value that needs pickle, a
committed checkpoint without ``overwrite=True``, a state key that is not file-name-safe."""

from __future__ import annotations

import pytest
import torch

import statekit


def _saved(tmp_path, **extra):
    url = str(tmp_path / "c")
    statekit.save(url, {"model": torch.nn.Linear(4, 2), **extra})
    return url


def test_value_without_pickle_free_form(tmp_path):
    with pytest.raises(statekit.UnsupportedValueError, match=r"state\['fn'\]"):
        statekit.save(str(tmp_path / "c"), {"d": {"fn": lambda: 1}})


def test_committed_checkpoint_not_overwritten(tmp_path):
    url = _saved(tmp_path)
    with pytest.raises(statekit.CheckpointExistsError, match="overwrite=True"):
        statekit.save(url, {"model": torch.nn.Linear(4, 2)})


def test_unsafe_state_key(tmp_path):
    with pytest.raises(statekit.UnsupportedValueError, match="file-name-safe"):
        statekit.save(str(tmp_path / "c"), {"../evil": torch.zeros(1)})
