"""The accelerator of this process: the one place statekit finds it.

The RNG guard (:mod:`statekit.loaders.rng_guard`), the resume fingerprint
(:mod:`statekit.api.fingerprint`) and statekit-rng (through :mod:`statekit.plugin_api`)
must agree on which device's generators a checkpoint holds; each asking torch its own way
made them disagree where ``torch.accelerator`` is missing (torch 2.4 and 2.5).
"""

from __future__ import annotations

import torch


def current_accelerator_type() -> str | None:
    """The device type of this process's accelerator (``"cuda"``, ``"xpu"``, ``"mps"``, a
    PrivateUse1 backend's name), or None when none is available.

    Follows ``torch.accelerator.current_accelerator()`` (torch >= 2.6:
    https://pytorch.org/docs/stable/accelerator.html); before it, probes ``cuda``, ``xpu``,
    ``mps`` and the PrivateUse1 backend through ``torch.get_device_module(type).is_available()``.
    Does not initialise the device runtime beyond what ``is_available`` does.
    """
    accelerator_api = getattr(torch, "accelerator", None)
    if accelerator_api is not None and hasattr(accelerator_api, "current_accelerator"):  # torch >= 2.6
        if not accelerator_api.is_available():
            return None
        device = accelerator_api.current_accelerator()
        return device.type if device is not None else None
    # torch 2.4 / 2.5: probe the in-tree backends, then the PrivateUse1 backend.
    for device_type in ("cuda", "xpu", "mps", torch._C._get_privateuse1_backend_name()):
        try:
            module = torch.get_device_module(device_type)
        except (RuntimeError, AttributeError):
            continue
        is_available = getattr(module, "is_available", None)
        if callable(is_available) and is_available():
            return device_type
    return None
