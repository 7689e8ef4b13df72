"""statekit-rng hooks: every random-number generator of a run, saved and restored per rank.

What is saved (``rng/rank-<rank:05d>.json`` + ``.safetensors``, no pickle), the data-loader
policy and the world-size rules: docs/plugins/rng.md. The snapshot runs first on save
(``tryfirst``) and the restore last on load (``trylast``); ``STATEKIT_MANAGES_RNG`` keeps
the host's RNG guard from putting back what this plugin restored. The hooks call
:func:`discover_accelerator` through this module's namespace, so a test can replace it.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from statekit.plugin_api import (
    CorruptCheckpointError,
    FormatVersionError,
    StatekitWarning,
    hookimpl,
    parse_rank_path,
    rank_path,
    restore_random_states,
    snapshot_random_states,
)
from statekit_rng.devices import DeviceRngModule, discover_accelerator, restore_devices
from statekit_rng.loaders import data_loaders, generator_entry, generator_holders, restore_loaders

if TYPE_CHECKING:
    from statekit.plugin_api import Checkpoint

__all__ = [
    "STATEKIT_MANAGES_RNG",
    "STATEKIT_OPTIONS",
    "STATE_FORMAT",
    "STATE_KEY",
    "DeviceRngModule",
    "discover_accelerator",
    "restore",
    "snapshot",
    "statekit_load_state_post",
    "statekit_boundary_state",
    "statekit_load_state_pre",
    "statekit_save_state_pre",
]

STATEKIT_MANAGES_RNG = True
"""Tells the host that this plugin manages random state itself: no RNG guard around its
hooks, and no "RNG state is not saved" warning."""

STATEKIT_OPTIONS: frozenset[str] = frozenset()
"""The ``checkpoint.options`` this plugin reads: none."""

STATE_FORMAT = 1
"""Version of the per-rank state file layout written by this module."""

STATE_KEY = "rng"
"""Key of the per-rank state: one rank's RNG state is ``rank_path(STATE_KEY, rank)`` (``rng/rank-00000``)
plus ``.json`` / ``.safetensors``."""

# Data loaders seen by statekit_load_state_pre, by checkpoint: a plugin that takes a
# loader in load_state_pre removes it from checkpoint.objects before the restore runs.
_loaders_at_load: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()


# --------------------------------------------------------------------------- save


def snapshot(objects: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Capture this process's random states (what one rank's file holds).

    Args:
        objects: stateful objects by stable key; their data loaders' generators are captured.

    Returns:
        A dict: ``format`` (int), ``python`` (``random.getstate()`` tuple), ``numpy``
        (``numpy.random.get_state()`` tuple; the key array is ``uint32[624]``), ``torch``
        (``uint8[5056]`` CPU tensor), ``device_type`` (str or None), ``devices`` (one
        ``uint8`` CPU tensor per device), ``loaders`` (``key -> role -> {"device": str,
        "state": uint8 tensor}``).

    Raises:
        Whatever torch raises while reading a device generator.
    """
    import numpy.random  # noqa: F401 - the core's snapshot takes NumPy's state once it is imported

    found = discover_accelerator()
    host = snapshot_random_states(accelerator=None)  # Python, NumPy, torch CPU; the devices below
    device_type, device_states = None, []
    if found is not None:
        device_type, module = found
        device_states = [s.detach().to("cpu") for s in module.get_rng_state_all()]
    loaders: dict[str, dict[str, Any]] = {}
    for key, loader in data_loaders(objects or {}):
        entries = {
            role: generator_entry(holder.generator)
            for role, holder in generator_holders(loader).items()
            if isinstance(getattr(holder, "generator", None), torch.Generator)
        }
        if entries:
            loaders[key] = entries
    return {
        "format": STATE_FORMAT,
        "python": host["python"],
        "numpy": host["numpy"],
        "torch": host["torch"],
        "device_type": device_type,
        "devices": device_states,
        "loaders": loaders,
    }


@hookimpl
def statekit_boundary_state(objects: Mapping[str, Any]) -> dict[str, Any]:
    """This rank's random states at a step boundary (:func:`snapshot`: a few KiB copied,
    about 15 us without an accelerator), which a save of that boundary writes instead of
    the live states (the save on a signal from statekit's watcher thread while the main
    thread evaluates).

    Args:
        objects: the stateful objects by stable key (their data loaders' generators).

    Returns:
        The :func:`snapshot` dict.
    """
    return snapshot(objects)


@hookimpl(tryfirst=True)
def statekit_save_state_pre(checkpoint: Checkpoint) -> None:
    """Write this rank's random states to ``rng/rank-<rank:05d>.*``, before any other plugin.

    Records (``records["rng"]``): ``format``, ``world_size``, ``device_type``,
    ``device_count`` and the data-loader keys saved. Sets ``checkpoint.handles_rng``.

    Raises:
        UnsupportedValueError: a state cannot be encoded (a NumPy bit generator with an
            exotic state layout).
        StorageError: the write failed.
    """
    state = checkpoint.boundary_state() or snapshot(checkpoint.objects)  # a save of a step boundary: its states
    checkpoint.save_state(rank_path(STATE_KEY, checkpoint.rank), state)
    checkpoint.records.update(
        {
            "format": STATE_FORMAT,
            "world_size": checkpoint.world_size,
            "device_type": state["device_type"],
            "device_count": len(state["devices"]),
            "loaders": sorted(state["loaders"]),
        }
    )
    checkpoint.handles_rng = True


# --------------------------------------------------------------------------- load


def _check_state(state: Any, source: str) -> dict[str, Any]:
    if not isinstance(state, dict):
        raise CorruptCheckpointError(f"{source}: not a statekit-rng state", path=source)
    version = state.get("format")
    if isinstance(version, int) and version > STATE_FORMAT:
        raise FormatVersionError(
            f"{source}: statekit-rng state format {version} is newer than this plugin reads ({STATE_FORMAT}); "
            "upgrade statekit-rng"
        )
    missing = [k for k in ("format", "python", "numpy", "torch", "device_type", "devices", "loaders") if k not in state]
    if missing:
        raise CorruptCheckpointError(f"{source}: statekit-rng state lacks {', '.join(missing)}", path=source)
    return state


def restore(state: Mapping[str, Any], loaders: Mapping[str, Any] | None = None, source: str = "<memory>") -> list[str]:
    """Put back what :func:`snapshot` captured, as far as this process matches it.

    Args:
        state: a :func:`snapshot` result (decoded from a checkpoint).
        loaders: data loaders by stable key; the saved generators of those present are
            restored (a loader or sampler with ``generator=None`` gets a new one).
        source: the file the state came from, for error messages.

    Returns:
        What was not restored, one human-readable item per generator group.

    Raises:
        CorruptCheckpointError: the state lacks a field (names ``source``).
        FormatVersionError: the state was written by a newer statekit-rng.
    """
    import numpy.random  # noqa: F401 - the core's restore sets NumPy's state once it is imported

    state = _check_state(state, source)
    not_restored: list[str] = []
    restore_random_states({"python": state["python"], "numpy": state["numpy"], "torch": state["torch"], "device": None},
                          accelerator=None)
    restore_devices(discover_accelerator(), state["device_type"], state["devices"], not_restored)
    restore_loaders(state["loaders"], loaders or {}, not_restored)
    return not_restored


def _ranks_in(files: Mapping[str, Any]) -> list[int]:
    found = [parse_rank_path(rel) for rel in files if rel.endswith(".json")]
    return sorted(rank for key, rank in filter(None, found) if key == STATE_KEY)


@hookimpl(tryfirst=True)
def statekit_load_state_pre(checkpoint: Checkpoint) -> None:
    """Note the data loaders of this load before another plugin takes them (restores nothing)."""
    _loaders_at_load[checkpoint] = dict(data_loaders(checkpoint.objects))


@hookimpl(trylast=True)
def statekit_load_state_post(checkpoint: Checkpoint) -> None:
    """Restore this rank's random states, after everything else was loaded.

    Restores what matches the saved world size, device type and count, and issues one
    :class:`statekit.StatekitWarning` listing what was not (docs/plugins/rng.md). A
    checkpoint saved without statekit-rng is left alone. Sets ``checkpoint.handles_rng``
    when a state was restored.

    Raises:
        CorruptCheckpointError: this rank's file fails verification or is malformed.
        FormatVersionError: the file was written by a newer statekit-rng.
    """
    loaders = _loaders_at_load.pop(checkpoint, {})
    loaders.update(data_loaders(checkpoint.objects))
    records = checkpoint.records
    if not records:
        return
    manifest = checkpoint.manifest
    files = manifest.files if manifest is not None else {}
    rank, world_size = checkpoint.rank, checkpoint.world_size
    saved_world = records.get("world_size", manifest.world_size if manifest is not None else None)
    base = rank_path(STATE_KEY, rank)
    not_restored: list[str] = []
    if f"{base}.json" in files:
        source = f"{checkpoint.url}/{base}.json"
        not_restored += restore(checkpoint.load_state(base), loaders, source)
        checkpoint.handles_rng = True
    else:
        not_restored.append(
            f"all RNG state of rank {rank} (Python, NumPy, torch CPU, device and data-loader generators): the "
            f"checkpoint has no {base}.json (saved with world size {saved_world}, loaded with {world_size})"
        )
    if rank == 0:
        beyond = [r for r in _ranks_in(files) if r >= world_size]
        if beyond:
            names = ", ".join(str(r) for r in beyond)
            not_restored.append(
                f"RNG state of rank{'s' if len(beyond) > 1 else ''} {names} (saved with world size {saved_world}, "
                f"loaded with {world_size})"
            )
    if not_restored:
        warnings.warn(
            f"statekit-rng: {checkpoint.url}: not restored: " + "; ".join(not_restored),
            StatekitWarning,
            stacklevel=2,
        )
