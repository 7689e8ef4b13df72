"""The random states of an Accelerate checkpoint (``random_states_<rank>.pkl``): restored as
``Accelerator.load_state`` does, snapshot to put back on failure. Keys follow
``accelerate.checkpointing.save_accelerator_state``
(https://github.com/huggingface/accelerate/blob/main/src/accelerate/checkpointing.py); the
generators themselves are :mod:`statekit.devices`'s."""

from __future__ import annotations

from typing import Any

from statekit.devices import accelerator_generators, restore_random_states, snapshot_random_states
from statekit.errors import StatekitWarning, warn_user


def _device_key(device_type: str) -> str:
    """Accelerate's key of one accelerator's generators: ``torch_<type>_manual_seed``."""
    return f"torch_{device_type}_manual_seed"


def restore_rng(states: dict[str, Any], source: str = "Accelerate checkpoint") -> None:
    """Set the global generators from one unpickled ``random_states_<rank>.pkl`` dict, as
    ``load_accelerator_state`` does (Python, NumPy, torch CPU, this process's accelerator). Where this
    process sees another number of devices than were saved, the common ones are restored and a
    :class:`StatekitWarning` naming ``source`` says which are not (Accelerate's ``load_state`` raises)."""
    found = accelerator_generators()
    saved = list(states[_device_key(found[0])]) if found is not None and _device_key(found[0]) in states else None
    restore_random_states(
        {"python": states["random_state"], "numpy": states.get("numpy_random_seed"), "torch": states["torch_manual_seed"],
         "device": saved},
        accelerator=found,
    )
    if found is None or saved is None:
        return
    kind, count = found[0], int(found[1].device_count())
    if len(saved) != count:
        rest = f"{kind}:{count}-{len(saved) - 1} not restored" if len(saved) > count else "the others keep their state"
        warn_user(f"{source}: random states of {len(saved)} {kind.upper()} device(s) saved, this process sees "
                  f"{count} ({rest}): draws on those devices (dropout) differ from the saved run's",
                  StatekitWarning)


def rng_snapshot() -> dict[str, Any]:
    """This process's generators in the same dict form (for :func:`restore_rng`)."""
    found = accelerator_generators()
    now = snapshot_random_states(accelerator=found)
    states: dict[str, Any] = {"random_state": now["python"], "torch_manual_seed": now["torch"]}
    if now["numpy"] is not None:
        states["numpy_random_seed"] = now["numpy"]
    if found is not None:
        states[_device_key(found[0])] = now["device"]
    return states
