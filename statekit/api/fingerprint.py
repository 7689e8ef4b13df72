"""The resume fingerprint of the live run: the settings an exact resume depends on (world
size, accumulation, precision, RNG kinds, each loader's batching and sampler, the objects,
versions), read at save (:func:`compute`) and compared at a resume (:func:`check`: a
:class:`ResumeFingerprintWarning` per difference, or :class:`ResumeMismatchError` with
``strict_resume``; versions only warn). The comparison is :mod:`statekit.checks.fingerprint`'s.
What users see: ``docs/concepts.md`` (Resume fingerprint); the fields: ``docs/format.md``.
The loader settings follow Accelerate's ``prepare_data_loader`` and ``BatchSamplerShard``
(https://github.com/huggingface/accelerate/blob/main/src/accelerate/data_loader.py).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import platform
from collections.abc import Mapping
from typing import Any

import torch

from statekit import distributed
from statekit._version import __version__
from statekit.checks.fingerprint import Difference, compare, describe  # compare, describe: re-exported
from statekit.devices import current_accelerator_type
from statekit.engine import gradients
from statekit.loaders import data, samplers
from statekit.engine.entries import Entry
from statekit.errors import ResumeFingerprintWarning, ResumeMismatchError, warn_user
from statekit.format.manifest_types import Fingerprint, LoaderSettings, Manifest
from statekit.hooks.registry import get_plugin_manager

CPU_RNG_KINDS = ("numpy", "python", "torch")
"""The host generators statekit-rng (and Accelerate's ``save_state``) save."""

UNCOMPARED_OBJECTS = frozenset({"accelerator", "gradients", "accelerate_rng"})
"""Saved objects every run has or that statekit restores by itself (the accelerator's
counters, accumulated gradients, a converted checkpoint's random states): never reported
as left unrestored."""


# --------------------------------------------------------------------------- compute


def compute(entries: list[Entry], accelerator: Any = None, rng: list[str] | None = None) -> Fingerprint:
    """The fingerprint of the live run.

    Args:
        entries: the objects saved or loaded (their data loaders are described by key).
        accelerator: the run's ``accelerate.Accelerator``, or None (the mapping API:
            gradient accumulation and mixed precision are then null, not compared).
        rng: the RNG kinds; None: those the installed plugins restore (:func:`rng_live`).

    Returns:
        The fingerprint (its JSON form: the module docstring).
    """
    world_size = distributed.rank_and_world_size()[1]
    steps = getattr(accelerator, "gradient_accumulation_steps", None) if accelerator is not None else None
    precision = getattr(accelerator, "mixed_precision", None) if accelerator is not None else None
    return Fingerprint(
        world_size=world_size,
        gradient_accumulation_steps=int(steps) if steps is not None else None,
        accumulating=gradients.accumulating(accelerator) if accelerator is not None else None,
        mixed_precision=str(precision) if precision is not None else None,
        rng=tuple(sorted(rng) if rng is not None else rng_live()),
        dataloaders={e.key: loader_fingerprint(e.obj, accelerator, world_size) for e in entries if data.is_loader(e.obj)},
        objects={e.key: e.kind for e in entries if not e.optional and e.key not in UNCOMPARED_OBJECTS},
        versions=versions(),
    )


def loader_fingerprint(loader: Any, accelerator: Any = None, world_size: int = 1) -> LoaderSettings:
    """What a data loader's position depends on.

    Args:
        loader: a ``torch.utils.data.DataLoader`` or an Accelerate-prepared one.
        accelerator: its Accelerator (``even_batches`` when the batch sampler has none).
        world_size: processes sharing the loader's epoch (Accelerate's ``total_batch_size``
            spans them all).

    Returns:
        Its settings (``batch_size`` per device, ``sampler`` the class name); None where
        the loader does not say.
    """
    batch_sampler = _get(loader, "batch_sampler")
    sampler = samplers.sampler_of(loader)
    total = _get(loader, "total_batch_size")  # Accelerate's: every process's batches together
    if isinstance(total, int) and _get(loader, "_is_accelerate_prepared"):
        batch_size = total // max(int(getattr(accelerator, "num_processes", world_size) or 1), 1)
    else:
        batch_size = _get(loader, "batch_size") or _get(batch_sampler, "batch_size")
    even = _get(batch_sampler, "even_batches")
    if even is None and accelerator is not None and _get(loader, "_is_accelerate_prepared"):
        even = getattr(accelerator, "even_batches", None)
    drop_last = _get(batch_sampler, "drop_last")
    return LoaderSettings(
        batch_size=_int(batch_size),
        dataset_length=samplers.dataset_length(loader),
        drop_last=bool(drop_last if drop_last is not None else _get(loader, "drop_last")),
        even_batches=bool(even) if even is not None else None,
        num_workers=_int(_get(loader, "num_workers")),
        sampler=type(sampler).__name__ if sampler is not None else None,
        shuffle=_shuffles(sampler),
        seed=_int(_get(sampler, "seed", _get(sampler, "initial_seed"))),
    )


def _get(obj: Any, name: str, default: Any = None) -> Any:
    """An attribute, or ``default`` where reading it fails (adapters delegate lazily)."""
    try:
        return getattr(obj, name, default)
    except Exception:  # a property of a half-built or iterable-dataset loader
        return default


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def _shuffles(sampler: Any) -> bool | None:
    if isinstance(sampler, torch.utils.data.RandomSampler):  # Accelerate's SeedableRandomSampler too
        return True
    if isinstance(sampler, torch.utils.data.SequentialSampler):
        return False
    shuffle = _get(sampler, "shuffle")  # DistributedSampler
    return shuffle if isinstance(shuffle, bool) else None


@functools.lru_cache(maxsize=1)
def versions() -> dict[str, str]:
    """``{"python", "torch", "statekit"}`` and ``"accelerate"`` when installed (read from
    its distribution metadata: accelerate is not imported)."""
    found = {"python": platform.python_version(), "torch": torch.__version__, "statekit": __version__}
    try:
        found["accelerate"] = importlib.metadata.version("accelerate")
    except importlib.metadata.PackageNotFoundError:
        pass
    return found


def rng_live() -> list[str]:
    """The RNG kinds this process restores: the host generators and the accelerator's
    device type when a plugin manages RNG state (statekit-rng), else none."""
    if not get_plugin_manager().manages_rng():
        return []
    device_type = current_accelerator_type()  # the device statekit-rng saves (the same function)
    return sorted([*CPU_RNG_KINDS, *([device_type] if device_type else [])])


def rng_saved(records: Mapping[str, Any], files: Mapping[str, Any]) -> list[str]:
    """The RNG kinds a checkpoint holds, from statekit-rng's records (``records["rng"]``:
    host generators and ``device_type``) or Accelerate's ``random_states_<i>.pkl`` files.

    Args:
        records: the manifest's records (plugin name -> records).
        files: the manifest's files (relative path -> entry).

    Returns:
        Sorted kind names; empty when no random state was saved.
    """
    rng = records.get("rng")
    if isinstance(rng, Mapping):
        return sorted([*CPU_RNG_KINDS, *([rng["device_type"]] if rng.get("device_type") else [])])
    if any(p.startswith("random_states_") for p in files):  # Accelerate's own (attach mode)
        return list(CPU_RNG_KINDS)
    return []


# --------------------------------------------------------------------------- check


def check(manifest: Manifest, live: Fingerprint, url: str, *, strict_resume: bool = False) -> list[Difference]:
    """Compare a checkpoint's fingerprint with the live run: warn, or raise.

    Args:
        manifest: the checkpoint's manifest; without ``fingerprint`` (written before it
            existed, or by Accelerate itself) nothing is compared.
        live: :func:`compute` of the resuming run.
        url: the checkpoint URL, for messages.
        strict_resume: raise instead of warning for every difference but versions.

    Returns:
        The differences found (each warned, unless raised).

    Raises:
        ResumeMismatchError: ``strict_resume`` and a setting other than a version
            differs, or gradients saved mid-accumulation meet another
            ``gradient_accumulation_steps`` (always); lists every non-version difference.
            Version differences are warned first.
    """
    if manifest.fingerprint is None:
        return []
    saved = manifest.fingerprint
    if any(p.startswith("random_states_") for p in manifest.files):
        # Accelerate's own random states: its loader restores them whatever is installed
        live = dataclasses.replace(live, rng=tuple(sorted(set(live.rng or ()) | set(CPU_RNG_KINDS))))
    if not isinstance(saved.objects, Mapping):  # written before "objects" existed: the manifest's list
        saved = dataclasses.replace(
            saved, objects={k: o.kind for k, o in manifest.objects.items() if k not in UNCOMPARED_OBJECTS})
    differences = compare(saved, live)
    refused = [d for d in differences if d.level == "error" or (strict_resume and d.level == "warning")]
    for d in differences:
        if not refused or d.level == "info":
            warn_user(f"{url}: resume fingerprint: {d.message}", ResumeFingerprintWarning)
    if refused:
        raise ResumeMismatchError(url, [d.message for d in differences if d.level != "info"])
    return differences
