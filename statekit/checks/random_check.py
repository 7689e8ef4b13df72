"""Is the random state after a load the one the saved run continued with?

The end of a save records XXH3-64 of each global generator's state per rank
(``records["statekit"]["random_states"]``, optional); the load compares the live states once
every hook ran, whoever restored them. Why: docs/design-notes.md, "Attach mode under the
scripts users run" (random state at Accelerate's moment).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import xxhash

from statekit import distributed
from statekit.devices import snapshot_random_states
from statekit.errors import StateCheckWarning, StateMismatchError, warn_user

logger = logging.getLogger(__name__)

RECORD_KEY = "random_states"
"""Key of the per-rank digests in the core's record of the manifest."""


def digest(states: Mapping[str, Any] | None = None) -> dict[str, str]:
    """XXH3-64 digests of the global generators' states.

    Args:
        states: a :func:`statekit.devices.snapshot_random_states` result; None: the live states.

    Returns:
        ``{"python" | "numpy" | "torch" | "device": "xxh3_64:<16 hex digits>"}`` for each
        generator present. Cost: a few KiB hashed (microseconds).
    """
    states = snapshot_random_states() if states is None else states
    out = {}
    for kind, state in states.items():
        if state is None:
            continue
        hasher = xxhash.xxh3_64()
        _feed(hasher, state)
        out[kind] = f"xxh3_64:{hasher.hexdigest()}"
    return out


def _feed(hasher: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        hasher.update(value.detach().cpu().contiguous().numpy().tobytes())
    elif isinstance(value, (list, tuple)):
        hasher.update(f"[{len(value)}".encode())
        for item in value:
            _feed(hasher, item)
    elif hasattr(value, "tobytes"):  # NumPy's key array
        hasher.update(value.tobytes())
    else:
        hasher.update(repr(value).encode())


def record_all_ranks() -> list[dict[str, str]] | None:
    """Every rank's :func:`digest` of its live states, gathered: call on every rank at the end
    of a save, when the run is about to continue.

    Returns:
        On rank 0 the list indexed by rank; on other ranks None.
    """
    return distributed.gather_to_rank0(digest())


def check(saved: Sequence[Mapping[str, str]] | None, url: str, rank: int, world_size: int, strict: bool = False) -> bool:
    """Compare this rank's live generator states with what the save recorded for this rank.

    Args:
        saved: the manifest's record (list by saved rank), or None (nothing checked).
        url: the checkpoint, for the message.
        rank: this rank.
        world_size: the load's.
        strict: raise instead of warning (``strict_resume=True``).

    Returns:
        True when checked and equal; False when not checked or different.

    Warns:
        StateCheckWarning: a generator's state differs (names the generators).

    Raises:
        StateMismatchError: the same, under ``strict``.
    """
    if not saved or len(saved) != world_size or rank >= len(saved):
        return False
    live = digest()
    differ = sorted(kind for kind, value in saved[rank].items() if kind in live and live[kind] != value)
    if not differ:
        logger.debug("%s: random states after the load equal the saved run's (%s)", url, ", ".join(sorted(saved[rank])))
        return True
    where = f" on rank {rank}" if world_size > 1 else ""
    message = (
        f"{url}: random state{where} after the load differs from the state the saved run continued with "
        f"({', '.join(differ)} generator{'s' if len(differ) > 1 else ''}): every random draw from here on (noise, "
        "dropout, shuffling) differs from the uninterrupted run. Something drew random numbers during the save "
        "after the state was captured, or a hook or plugin restored another state (docs/concepts.md, 'Random state')"
    )
    if strict:
        raise StateMismatchError(message)
    warn_user(message, StateCheckWarning)
    return False
