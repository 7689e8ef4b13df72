"""statekit.devices: the one accelerator lookup, and the resume fingerprint agreeing with it."""

from __future__ import annotations

import types

import pytest
import torch

from statekit.api import fingerprint
from statekit.devices import current_accelerator_type


def test_torch_accelerator_decides_where_it_exists(monkeypatch):
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("xpu"))
    assert current_accelerator_type() == "xpu"
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    assert current_accelerator_type() is None


@pytest.mark.parametrize("available, found", [({"cuda"}, "cuda"), ({"xpu"}, "xpu"), (set(), None)])
def test_torch_without_torch_accelerator_probes_the_backends(monkeypatch, available, found):
    """torch 2.4 / 2.5 have no ``torch.accelerator``: the device modules are asked."""
    monkeypatch.delattr(torch, "accelerator")

    def device_module(device_type: str):
        return types.SimpleNamespace(is_available=lambda: device_type in available)

    monkeypatch.setattr(torch, "get_device_module", device_module)
    assert current_accelerator_type() == found


def test_the_resume_fingerprint_names_the_same_device_as_the_rng_plugin(monkeypatch, installed_plugin_manager):
    """The fingerprint's RNG kinds come from the same lookup statekit-rng saves by, so a
    GPU run on torch without ``torch.accelerator`` is not warned about CUDA state it has."""
    monkeypatch.delattr(torch, "accelerator")
    monkeypatch.setattr(torch, "get_device_module", lambda t: types.SimpleNamespace(is_available=lambda: t == "cuda"))
    assert installed_plugin_manager.manages_rng()
    assert fingerprint.rng_live() == ["cuda", "numpy", "python", "torch"]


def test_random_states_snapshot_and_restore_put_every_generator_back():
    """The one snapshot/restore (statekit.devices, plugin_api): Python, NumPy and torch CPU
    draws after a restore repeat those after the snapshot; rng_guard puts them back."""
    import random

    import numpy as np
    import numpy.random  # noqa: F401 - NumPy's state is taken once numpy.random is imported

    from statekit.plugin_api import restore_random_states, snapshot_random_states

    states = snapshot_random_states()
    first = (random.random(), np.random.rand(), torch.rand(3))
    restore_random_states(states)
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert first[:2] == again[:2] and torch.equal(first[2], again[2])
    from statekit.devices import rng_guard

    restore_random_states(states)
    random.random(), np.random.rand(), torch.rand(3)
    expected = (random.random(), np.random.rand(), torch.rand(3))
    restore_random_states(states)
    random.random(), np.random.rand(), torch.rand(3)
    with rng_guard():
        random.random(), np.random.rand(), torch.rand(3)
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert expected[:2] == got[:2] and torch.equal(expected[2], got[2])
