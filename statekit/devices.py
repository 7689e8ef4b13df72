"""The accelerator of this process and the process's random generators: the one place statekit
finds them (:func:`current_accelerator_type`, :func:`accelerator_generators`) and the one
place it snapshots and restores them (:func:`snapshot_random_states`,
:func:`restore_random_states`, :func:`rng_guard`). Users keep their own stored layouts.
Why one owner: docs/design-notes.md, "Module layout".
"""

from __future__ import annotations

import contextlib
import random
import sys
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol

import torch


def current_accelerator_type() -> str | None:
    """The device type of this process's accelerator (``"cuda"``, ``"xpu"``, ``"mps"``, a
    PrivateUse1 backend's name), or None: ``torch.accelerator.current_accelerator()`` (torch
    >= 2.6, https://pytorch.org/docs/stable/accelerator.html), else ``is_available`` probes.
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


class DeviceRngModule(Protocol):
    """The part of a torch device module (``torch.cuda``, ``torch.xpu``...) that holds the
    accelerator's generators (``torch.get_device_module(device_type)``).
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


def accelerator_generators(initialised_only: bool = False) -> tuple[str, DeviceRngModule] | None:
    """The accelerator of this process and the module that holds its generators
    (``torch.get_device_module(device_type)``, adapted for per-device-only backends such as MPS).

    Args:
        initialised_only: give None for a device runtime not initialised yet (reading its
            generators would initialise it): the RNG guard and the loaders ask so.

    Returns:
        ``(device_type, module)`` (``("cuda", torch.cuda)``) with ``module`` following
        :class:`DeviceRngModule`, or None when no accelerator is available (or initialised).

    Raises:
        RuntimeError: what torch raises while initialising the device runtime (passed on).
    """
    device_type = current_accelerator_type()
    if device_type is None:
        return None
    module = torch.get_device_module(device_type)
    if initialised_only:
        is_initialized = getattr(module, "is_initialized", None)
        if is_initialized is not None and not is_initialized():
            return None
    if not (hasattr(module, "get_rng_state_all") and hasattr(module, "set_rng_state_all")):
        module = _PerDeviceRng(module)
    return device_type, module


_FIND = object()


def snapshot_random_states(accelerator: Any = _FIND) -> dict[str, Any]:
    """The process's global random states: Python ``random``, NumPy's global generator (if
    NumPy is imported), torch's CPU generator and the accelerator's generators.

    Args:
        accelerator: ``(device_type, module)`` whose generators to read, or None for none;
            by default :func:`accelerator_generators` with ``initialised_only=True``.

    Returns:
        ``{"python": tuple, "numpy": tuple | None, "torch": uint8 tensor (5,056 bytes),
        "device": list of uint8 tensors | None}``: values the codec stores as they are.
        Cost: a few KiB copied (about 11 us without an accelerator).
    """
    found = accelerator_generators(initialised_only=True) if accelerator is _FIND else accelerator
    np_random = sys.modules.get("numpy.random")
    return {
        "python": random.getstate(),
        "numpy": np_random.get_state() if np_random is not None else None,
        "torch": torch.get_rng_state(),
        "device": found[1].get_rng_state_all() if found is not None else None,
    }


def restore_random_states(states: dict[str, Any], accelerator: Any = _FIND) -> None:
    """Set the states :func:`snapshot_random_states` returned (NumPy's and the accelerator's only
    where taken and available; device states cut to this process's device count).

    Args:
        states: a :func:`snapshot_random_states` result (``"device"`` may be None).
        accelerator: ``(device_type, module)`` whose generators to set, or None for none;
            by default :func:`accelerator_generators` with ``initialised_only=True``.
    """
    random.setstate(_as_python_state(states["python"]))
    np_random = sys.modules.get("numpy.random")
    if states.get("numpy") is not None and np_random is not None:
        np_random.set_state(tuple(states["numpy"]))
    torch.set_rng_state(states["torch"])
    if states.get("device") is None:
        return
    found = accelerator_generators(initialised_only=True) if accelerator is _FIND else accelerator
    if found is not None:
        # set_rng_state_all would index past the live devices (statekit-rng warns about the count)
        device = found[1]
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
    """Snapshot the global random states (:func:`snapshot_random_states`); restore them on exit.

    Cost: a few KiB copied per call (torch's CPU state is 5,056 bytes). Inside
    :func:`no_rng_guard` on this thread: nothing (the states are another thread's).
    """
    if getattr(_unguarded, "on", False):
        yield
        return
    states = snapshot_random_states()
    try:
        yield
    finally:
        restore_random_states(states)


def wait_for_current_streams(devices: Iterable[torch.device]) -> None:
    """Block until the work queued so far on each device's current stream (this thread's) has
    finished, so other threads (on their own default streams) read the values written.

    Args:
        devices: the devices whose tensors other threads will read; CPU and ``meta``
            devices are skipped.
    """
    for device in set(devices):
        if device.type in ("cpu", "meta"):
            continue
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
            continue
        accelerator = getattr(torch, "accelerator", None)
        if accelerator is not None and hasattr(accelerator, "synchronize"):
            accelerator.synchronize(device)
        else:  # torch < 2.6: the backend's own module
            torch.get_device_module(device.type).synchronize()


_unguarded = threading.local()


@contextlib.contextmanager
def no_rng_guard() -> Iterator[None]:
    """Turn :func:`rng_guard` off on this thread for the block: a save run from a thread
    other than the training thread (the save on a signal from the watcher) must not put
    back random states the training thread has drawn from since (the generators are
    process-wide)."""
    _unguarded.on = True
    try:
        yield
    finally:
        _unguarded.on = False
