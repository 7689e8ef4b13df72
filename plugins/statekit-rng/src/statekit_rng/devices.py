"""The device generators of the current accelerator: discovery, and restoring saved states.

Devices are found with the core's :func:`statekit.plugin_api.accelerator_generators`
(``torch.get_device_module`` of the current accelerator), with no hard-coded list of backends.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from statekit.plugin_api import DeviceRngModule, accelerator_generators

__all__ = ["DeviceRngModule", "discover_accelerator", "restore_devices"]


def discover_accelerator() -> tuple[str, DeviceRngModule] | None:
    """Find the accelerator of this process and the module that holds its generators.

    The core's :func:`statekit.plugin_api.accelerator_generators`; the hooks look this
    function up in :mod:`statekit_rng.plugin` at every call, so a test can replace it there.

    Returns:
        ``(device_type, module)`` with ``module`` following :class:`DeviceRngModule`
        (``("cuda", torch.cuda)``), or None when no accelerator is available.

    Raises:
        Whatever torch raises while initialising the device runtime.
    """
    return accelerator_generators()


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
