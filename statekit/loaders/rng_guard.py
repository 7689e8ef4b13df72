"""The process's global random states: :func:`snapshot`/:func:`restore`, and :func:`rng_guard`,
a context manager that puts them back (plugin calls, re-read batches must not shift them)."""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Iterator
from typing import Any

import torch

from statekit.devices import current_accelerator_type


def _device_module() -> Any:
    """The current accelerator's device module (``torch.cuda``, ``torch.xpu``...) if it is
    available *and initialised*, else None: an uninitialised device has nothing to shift,
    and touching it would initialise it (:func:`statekit.devices.current_accelerator_type`)."""
    device_type = current_accelerator_type()
    if device_type is None:
        return None
    module = torch.get_device_module(device_type)
    is_initialized = getattr(module, "is_initialized", None)
    if is_initialized is not None and not is_initialized():
        return None
    return module if hasattr(module, "get_rng_state_all") else None


def snapshot() -> dict[str, Any]:
    """The process's global random states: Python ``random``, NumPy's global generator (if
    NumPy is imported), torch's CPU generator and the initialised accelerator's generators.

    Returns:
        ``{"python": tuple, "numpy": tuple | None, "torch": uint8 tensor (5,056 bytes),
        "device": list of uint8 tensors | None}``: values the codec stores as they are.
    """
    np_random = sys.modules.get("numpy.random")
    device = _device_module()
    return {
        "python": random.getstate(),
        "numpy": np_random.get_state() if np_random is not None else None,
        "torch": torch.get_rng_state(),
        "device": device.get_rng_state_all() if device is not None else None,
    }


def restore(states: dict[str, Any]) -> None:
    """Set the states :func:`snapshot` returned (NumPy's and the accelerator's only where
    they were taken and are available now; the accelerator's of the devices this process
    has)."""
    random.setstate(_as_python_state(states["python"]))
    np_random = sys.modules.get("numpy.random")
    if states.get("numpy") is not None and np_random is not None:
        np_random.set_state(tuple(states["numpy"]))
    torch.set_rng_state(states["torch"])
    device = _device_module()
    if states.get("device") is not None and device is not None:
        # states saved by a process that saw more devices (fetch_rng's, restored on resume):
        # set_rng_state_all would index past the live devices (statekit-rng warns about the count)
        count = getattr(device, "device_count", None)
        live = int(count()) if callable(count) else len(states["device"])
        device.set_rng_state_all(list(states["device"])[:live])


def _as_python_state(state: Any) -> tuple[Any, ...]:
    """``random.setstate`` wants ``(version, tuple of ints, gauss_next)``; a stored state may
    come back with lists."""
    version, internal, gauss_next = state
    return (version, tuple(internal), gauss_next)


@contextlib.contextmanager
def rng_guard() -> Iterator[None]:
    """Snapshot the global random states (:func:`snapshot`); restore them on exit.

    Cost: a few KiB copied per call (torch's CPU state is 5,056 bytes).
    """
    states = snapshot()
    try:
        yield
    finally:
        restore(states)
