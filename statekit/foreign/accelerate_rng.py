"""The random states of an Accelerate checkpoint (``random_states_<rank>.pkl``): restore
them as ``Accelerator.load_state`` does, and snapshot the live ones to put back on failure.

The keys follow ``accelerate.checkpointing.save_accelerator_state``
(https://github.com/huggingface/accelerate/blob/main/src/accelerate/checkpointing.py):
``random_state``, ``numpy_random_seed``, ``torch_manual_seed`` and one
``torch_<device>_manual_seed`` list per accelerator the saving process saw.
"""

from __future__ import annotations

import random
import sys
from typing import Any

import torch

from statekit.errors import StatekitWarning, warn_user

DEVICE_SEED_KINDS = ("xpu", "mlu", "sdaa", "musa", "hpu", "neuron", "cuda")
"""Accelerators whose generators Accelerate saves as ``torch_<kind>_manual_seed``."""


def _device_module(kind: str) -> Any:
    """``torch.<kind>`` when that accelerator is available in this process, else None."""
    module = getattr(torch, kind, None)
    try:
        return module if module is not None and module.is_available() else None
    except Exception:  # noqa: BLE001 - an out-of-tree backend's probe failing means "not here"
        return None


def restore_rng(states: dict[str, Any], source: str = "Accelerate checkpoint") -> None:
    """Set the global generators from one ``random_states_<rank>.pkl`` dict, as
    ``accelerate.checkpointing.load_accelerator_state`` does (Python ``random``, NumPy,
    torch CPU, and each accelerator present here whose states were saved).

    Accelerate saves every device its process sees. Where this process sees another
    number, the common ones are restored and a :class:`StatekitWarning` naming ``source``
    says which are not (Accelerate's own ``load_state`` raises there).

    Args:
        states: the unpickled dict.
        source: the checkpoint, for the warning.
    """
    random.setstate(states["random_state"])
    np_random = sys.modules.get("numpy.random")
    if np_random is not None and "numpy_random_seed" in states:
        np_random.set_state(states["numpy_random_seed"])
    torch.set_rng_state(states["torch_manual_seed"])
    for kind in DEVICE_SEED_KINDS:
        key = f"torch_{kind}_manual_seed"
        module = _device_module(kind) if key in states else None
        if module is None:
            continue
        saved, count = list(states[key]), module.device_count()
        module.set_rng_state_all(saved[:count])
        if len(saved) != count:
            rest = f"{kind}:{count}-{len(saved) - 1} not restored" if len(saved) > count else "the others keep their state"
            warn_user(f"{source}: random states of {len(saved)} {kind.upper()} device(s) saved, this process sees "
                      f"{count} ({rest}): draws on those devices (dropout) differ from the saved run's",
                      StatekitWarning)


def rng_snapshot() -> dict[str, Any]:
    """This process's generators in the same dict form (for :func:`restore_rng`)."""
    states: dict[str, Any] = {"random_state": random.getstate(), "torch_manual_seed": torch.get_rng_state()}
    np_random = sys.modules.get("numpy.random")
    if np_random is not None:
        states["numpy_random_seed"] = np_random.get_state()
    for kind in DEVICE_SEED_KINDS:
        module = _device_module(kind)
        if module is not None:
            states[f"torch_{kind}_manual_seed"] = module.get_rng_state_all()
    return states
