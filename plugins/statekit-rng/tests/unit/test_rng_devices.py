"""Accelerator generators: saved and restored through the (injected) device module, and
every mismatch of device type or count is reported."""

from __future__ import annotations

import warnings

import pytest
import torch

import statekit
import statekit_rng.devices as rng_devices
import statekit_rng.plugin as rng_plugin


def _save(url: str) -> dict:
    return statekit.save(url, {"w": torch.ones(2)})


def _load_warnings(url: str) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        statekit.load(url, {"w": torch.ones(2)})
    return [str(w.message) for w in caught if issubclass(w.category, statekit.StatekitWarning)]


def test_no_accelerator_on_this_machine() -> None:
    if torch.accelerator.is_available():  # pragma: no cover - depends on the machine
        pytest.skip("an accelerator is available here")
    assert rng_plugin.discover_accelerator() is None


def test_device_generators_round_trip(pm, url: str, fake_devices) -> None:
    devices = fake_devices("cuda", 2)
    devices.draw(0), devices.draw(1)
    manifest = _save(url)
    expected = [devices.draw(0), devices.draw(1)]
    devices.reseed(5)
    assert _load_warnings(url) == []
    assert torch.equal(devices.draw(0), expected[0])
    assert torch.equal(devices.draw(1), expected[1])
    assert manifest.records["rng"]["device_type"] == "cuda"
    assert manifest.records["rng"]["device_count"] == 2


def test_two_devices_saved_one_loaded_restores_device_0_and_warns_device_1(pm, memory_url: str, fake_devices) -> None:
    saved = fake_devices("cuda", 2)
    _save(memory_url)
    expected0 = saved.draw(0)

    loaded = fake_devices("cuda", 1, seed=7)
    messages = _load_warnings(memory_url)
    assert torch.equal(loaded.draw(0), expected0)
    assert len(messages) == 1
    assert "cuda:1" in messages[0] and "cuda:0" not in messages[0]
    assert "saved with 2 cuda device(s), this process has 1" in messages[0]


def test_one_device_saved_two_loaded_warns_device_1(pm, memory_url: str, fake_devices) -> None:
    saved = fake_devices("cuda", 1)
    _save(memory_url)
    expected0 = saved.draw(0)

    loaded = fake_devices("cuda", 2, seed=7)
    untouched1 = torch.Generator().manual_seed(8).get_state()
    messages = _load_warnings(memory_url)
    assert torch.equal(loaded.draw(0), expected0)
    assert torch.equal(loaded.generators[1].get_state(), untouched1)
    assert len(messages) == 1 and "cuda:1" in messages[0] and "cuda:0" not in messages[0]


def test_saved_on_cuda_loaded_without_accelerator_warns(pm, memory_url: str, fake_devices) -> None:
    fake_devices("cuda", 1)
    _save(memory_url)
    fake_devices(None)
    torch.manual_seed(0)
    expected = torch.get_rng_state()
    messages = _load_warnings(memory_url)
    assert len(messages) == 1
    assert "generators of cuda:0 (this process has no accelerator)" in messages[0]
    assert not torch.equal(torch.get_rng_state(), expected)  # the CPU state was still restored


def test_saved_without_accelerator_loaded_on_cuda_warns(pm, memory_url: str, fake_devices) -> None:
    fake_devices(None)
    _save(memory_url)
    fake_devices("cuda", 1)
    messages = _load_warnings(memory_url)
    assert len(messages) == 1 and "cuda:0" in messages[0] and "without an accelerator" in messages[0]


def test_other_device_type_warns(pm, memory_url: str, fake_devices) -> None:
    fake_devices("cuda", 1)
    _save(memory_url)
    xpu = fake_devices("xpu", 1, seed=3)
    before = xpu.generators[0].get_state()
    messages = _load_warnings(memory_url)
    assert len(messages) == 1 and "cuda:0" in messages[0] and "'xpu'" in messages[0]
    assert torch.equal(xpu.generators[0].get_state(), before)


class _MpsLike:
    """A module with only per-device get_rng_state/set_rng_state, like torch.mps."""

    def __init__(self) -> None:
        self.generator = torch.Generator().manual_seed(4)

    def device_count(self) -> int:
        return 1

    def get_rng_state(self, device: object = "mps") -> torch.Tensor:
        return self.generator.get_state()

    def set_rng_state(self, new_state: torch.Tensor, device: object = "mps") -> None:
        self.generator.set_state(new_state)


def test_per_device_module_is_adapted(monkeypatch: pytest.MonkeyPatch) -> None:
    module = _MpsLike()
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("mps"))
    monkeypatch.setattr(torch, "get_device_module", lambda device_type=None: module)
    found = rng_plugin.discover_accelerator()
    assert found is not None and found[0] == "mps"
    adapted = found[1]
    states = adapted.get_rng_state_all()
    first = torch.rand(2, generator=module.generator)
    adapted.set_rng_state_all(states)
    assert adapted.device_count() == 1
    assert torch.equal(torch.rand(2, generator=module.generator), first)
