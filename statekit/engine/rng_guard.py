"""A context manager that puts the process's random states back (plugin calls, re-read batches must not shift them)."""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Iterator
from typing import Any

import torch


def _device_module() -> Any:
    """The current accelerator's device module (``torch.cuda``, ``torch.xpu``...) if it is
    available *and initialised*, else None: an uninitialised device has nothing to shift,
    and touching it would initialise it (``torch.accelerator``, torch >= 2.6)."""
    accelerator_api = getattr(torch, "accelerator", None)
    if accelerator_api is None or not accelerator_api.is_available():
        return None
    device_type = accelerator_api.current_accelerator().type
    module = torch.get_device_module(device_type)
    is_initialized = getattr(module, "is_initialized", None)
    if is_initialized is not None and not is_initialized():
        return None
    return module if hasattr(module, "get_rng_state_all") else None


@contextlib.contextmanager
def rng_guard() -> Iterator[None]:
    """Snapshot Python ``random``, NumPy's global generator (if NumPy is imported), torch's
    CPU generator and the initialised accelerator's generators; restore them on exit.

    Cost: a few KiB copied per call (torch's CPU state is 5,056 bytes).
    """
    py_state = random.getstate()
    np_random = sys.modules.get("numpy.random")
    np_state = np_random.get_state() if np_random is not None else None
    torch_state = torch.get_rng_state()
    device = _device_module()
    device_states = device.get_rng_state_all() if device is not None else None
    try:
        yield
    finally:
        random.setstate(py_state)
        if np_state is not None:
            np_random.set_state(np_state)
        torch.set_rng_state(torch_state)
        if device_states is not None:
            device.set_rng_state_all(device_states)
