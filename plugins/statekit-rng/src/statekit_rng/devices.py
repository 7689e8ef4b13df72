"""The device generators of the current accelerator: discovery, and restoring saved states.

Devices are found with the core's ``statekit.plugin_api.current_accelerator_type`` (the
lookup the resume fingerprint uses too) and ``torch.get_device_module(device_type)``,
with no hard-coded list of backends (CUDA, XPU, MPS, HPU, a PrivateUse1 backend...).
:mod:`statekit_rng.plugin` calls :func:`discover_accelerator` through its own namespace,
so a test can replace it there. A backend needs no replacement: ``torch.accelerator``
finds PrivateUse1 backends too, and the core's resume fingerprint names the device that
``current_accelerator_type`` gives, so a replacement that names another device makes every
resume warn that its random state is not restored.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from statekit.plugin_api import current_accelerator_type


class DeviceRngModule(Protocol):
    """The part of a torch device module (``torch.cuda``, ``torch.xpu``...) this plugin uses.

    ``torch.get_device_module(device_type)`` returns such a module for CUDA, XPU and
    PrivateUse1 backends; :func:`discover_accelerator` adapts modules that only have
    per-device ``get_rng_state`` / ``set_rng_state`` (MPS).
    """

    def device_count(self) -> int:
        """Number of devices of this type visible to the process."""
        ...

    def get_rng_state_all(self) -> list[torch.Tensor]:
        """The generator state of every device, as CPU ``torch.uint8`` tensors."""
        ...

    def set_rng_state_all(self, new_states: Sequence[torch.Tensor]) -> None:
        """Set the generator state of devices ``0 .. len(new_states) - 1``."""
        ...


class _PerDeviceRng:
    """Adapts a device module with only ``get_rng_state(device)`` / ``set_rng_state(state,
    device)`` (``torch.mps``) to :class:`DeviceRngModule`."""

    def __init__(self, module: Any) -> None:
        self._module = module

    def device_count(self) -> int:
        count = getattr(self._module, "device_count", None)
        return int(count()) if callable(count) else 1

    def get_rng_state_all(self) -> list[torch.Tensor]:
        n = self.device_count()
        if n == 1:
            return [self._module.get_rng_state()]
        return [self._module.get_rng_state(i) for i in range(n)]

    def set_rng_state_all(self, new_states: Sequence[torch.Tensor]) -> None:
        if len(new_states) == 1 and self.device_count() == 1:
            self._module.set_rng_state(new_states[0])
            return
        for i, state in enumerate(new_states):
            self._module.set_rng_state(state, i)


def discover_accelerator() -> tuple[str, DeviceRngModule] | None:
    """Find the accelerator of this process and the module that holds its generators.

    The device type is the core's :func:`statekit.plugin_api.current_accelerator_type`
    (``torch.accelerator`` on torch >= 2.6; earlier versions probe ``cuda``, ``xpu``, ``mps``
    and the PrivateUse1 backend), the module ``torch.get_device_module(device_type)``: the device-generic path torch
    itself documents, instead of Accelerate's per-backend chain
    (``accelerate.utils.random.set_seed``).

    Hooks look this function up in the module namespace at every call, so a test can
    replace it (``monkeypatch.setattr(statekit_rng.plugin, "discover_accelerator", fake)``;
    the core's fingerprint still asks ``current_accelerator_type``).

    Returns:
        ``(device_type, module)`` with ``module`` following :class:`DeviceRngModule`
        (``("cuda", torch.cuda)``), or None when no accelerator is available.

    Raises:
        Whatever torch raises while initialising the device runtime.
    """
    device_type = current_accelerator_type()
    if device_type is None:
        return None
    module = torch.get_device_module(device_type)
    if not (hasattr(module, "get_rng_state_all") and hasattr(module, "set_rng_state_all")):
        module = _PerDeviceRng(module)
    return device_type, module


def _device_names(device_type: str, indices: Sequence[int]) -> str:
    return ", ".join(f"{device_type}:{i}" for i in indices)


def restore_devices(
    found: tuple[str, DeviceRngModule] | None,
    saved_type: str | None,
    saved_states: Sequence[torch.Tensor],
    not_restored: list[str],
) -> None:
    """Set the device generators of this process to the saved states that match.

    Args:
        found: what :func:`discover_accelerator` returned for this process.
        saved_type: the device type saved (``"cuda"``), or None when saved without one.
        saved_states: one saved state per device.
        not_restored: receives one human-readable item per generator group not restored
            (device type or count differs).
    """
    if found is None:
        if saved_type is not None and saved_states:
            not_restored.append(
                f"generators of {_device_names(saved_type, range(len(saved_states)))} "
                f"(this process has no accelerator)"
            )
        return
    now_type, module = found
    now_count = int(module.device_count())
    if saved_type is None:
        if now_count:
            not_restored.append(
                f"generators of {_device_names(now_type, range(now_count))} (the checkpoint was saved "
                "without an accelerator; they keep their current state)"
            )
        return
    if saved_type != now_type:
        not_restored.append(
            f"generators of {_device_names(saved_type, range(len(saved_states)))} (this process runs on "
            f"{now_type!r}; its {now_count} device generator(s) keep their current state)"
        )
        return
    n = min(len(saved_states), now_count)
    if n:
        module.set_rng_state_all(list(saved_states[:n]))
    if len(saved_states) > now_count:
        not_restored.append(
            f"generators of {_device_names(saved_type, range(now_count, len(saved_states)))} "
            f"(saved with {len(saved_states)} {saved_type} device(s), this process has {now_count})"
        )
    elif now_count > len(saved_states):
        not_restored.append(
            f"generators of {_device_names(now_type, range(len(saved_states), now_count))} (the checkpoint "
            f"holds {len(saved_states)} {saved_type} device state(s); they keep their current state)"
        )
