"""Fixtures for statekit-rng tests: a fresh plugin manager per test, checkpoint URLs, and
a fake accelerator device module (this machine has no accelerator)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence

import pytest
import torch

import statekit.hooks.registry
import statekit_rng.plugin as rng_plugin


class FakeDeviceModule:
    """A device module with ``n`` devices whose generators are CPU ``torch.Generator``s.

    Follows ``torch.cuda``'s contract: ``set_rng_state_all`` sets devices
    ``0 .. len(states) - 1`` and fails for more states than devices.
    """

    def __init__(self, n: int, seed: int = 1000) -> None:
        self.generators = [torch.Generator().manual_seed(seed + i) for i in range(n)]

    def device_count(self) -> int:
        return len(self.generators)

    def get_rng_state_all(self) -> list[torch.Tensor]:
        return [g.get_state() for g in self.generators]

    def set_rng_state_all(self, new_states: Sequence[torch.Tensor]) -> None:
        if len(new_states) > len(self.generators):
            raise RuntimeError(f"{len(new_states)} states for {len(self.generators)} devices")
        for g, state in zip(self.generators, new_states):
            g.set_state(state)

    def draw(self, device: int) -> torch.Tensor:
        """Three uniform numbers from device ``device``'s generator."""
        return torch.rand(3, generator=self.generators[device])

    def reseed(self, seed: int) -> None:
        for i, g in enumerate(self.generators):
            g.manual_seed(seed + i)


@pytest.fixture
def pm(monkeypatch: pytest.MonkeyPatch) -> Iterator[statekit.hooks.registry.PluginManager]:
    """A freshly built process-wide plugin manager (entry points loaded, nothing blocked)."""
    monkeypatch.delenv("STATEKIT_DISABLE_PLUGINS", raising=False)
    monkeypatch.delenv("STATEKIT_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    with statekit.hooks.registry.use_plugin_manager(statekit.hooks.registry.build_plugin_manager()) as manager:
        yield manager


@pytest.fixture
def memory_url() -> str:
    """A unique ``memory://`` checkpoint URL."""
    return f"memory://statekit-rng-tests/{uuid.uuid4().hex}/ckpt"


@pytest.fixture(params=["local", "memory"])
def url(request: pytest.FixtureRequest, tmp_path, memory_url: str) -> str:
    """A checkpoint URL in a temporary directory, or in ``memory://``."""
    return str(tmp_path / "ckpt") if request.param == "local" else memory_url


@pytest.fixture
def fake_devices(monkeypatch: pytest.MonkeyPatch):
    """Install fake accelerators: ``fake_devices("cuda", 2)`` returns the module; ``fake_devices(None)`` none."""

    def install(device_type: str | None, n: int = 1, seed: int = 1000) -> FakeDeviceModule | None:
        if device_type is None:
            monkeypatch.setattr(rng_plugin, "discover_accelerator", lambda: None)
            if hasattr(torch, "accelerator"):  # the core's resume fingerprint sees none either
                monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
            return None
        module = FakeDeviceModule(n, seed)
        monkeypatch.setattr(rng_plugin, "discover_accelerator", lambda: (device_type, module))
        return module

    return install
