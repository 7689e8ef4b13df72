"""The generators of data loaders, by role (its own and its sampler's): saving and restoring them by key.

The sampler is found with statekit's one sampler lookup, :func:`statekit.plugin_api.sampler_of`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from statekit.plugin_api import sampler_of

LOADER_ROLE = "loader"
"""Key of a data loader's own generator (``loader.generator``: seeds the worker processes)."""

SAMPLER_ROLE = "sampler"
"""Key of the generator of a data loader's sampler (draws the shuffling permutation)."""

def data_loaders(objects: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """The data loaders among ``objects``, as ``(stable key, loader)``."""
    from torch.utils.data import DataLoader

    for key, obj in objects.items():
        # Accelerate's DataLoaderShard / DataLoaderDispatcher pass this check: their
        # ``__class__`` property reports the wrapped DataLoader's class.
        if isinstance(obj, DataLoader):
            yield key, obj


def _loader_core(loader: Any) -> Any:
    """The torch DataLoader whose ``__iter__`` runs: Accelerate's adapters wrap one as
    ``base_dataloader`` and delegate reads to it, but an attribute set on the adapter would
    not reach it."""
    base = vars(loader).get("base_dataloader")
    return base if base is not None else loader


def generator_holders(loader: Any) -> dict[str, Any]:
    """``role -> object with a ``generator`` attribute`` for a data loader."""
    holders = {LOADER_ROLE: _loader_core(loader)}
    sampler = sampler_of(loader)
    if sampler is not None and hasattr(sampler, "generator"):
        holders[SAMPLER_ROLE] = sampler
    return holders


def generator_entry(generator: torch.Generator) -> dict[str, Any]:
    """What is saved of one generator: its device and state."""
    return {"device": str(generator.device), "state": generator.get_state()}


def restore_loaders(saved: Mapping[str, Any], loaders: Mapping[str, Any], not_restored: list[str]) -> None:
    """Set the generators of ``loaders`` to the ``saved`` states (``key -> role -> entry``).

    A loader or sampler with ``generator=None`` gets a new generator; what cannot be
    restored is appended to ``not_restored``, one item per generator.
    """
    for key, roles in saved.items():
        loader = loaders.get(key)
        if loader is None:
            continue  # not part of this load
        holders = generator_holders(loader)
        for role, entry in roles.items():
            what = f"data loader {key!r}: {role} generator"
            holder = holders.get(role)
            if holder is None:
                not_restored.append(f"{what} (the loader has no {role} with a 'generator' attribute now)")
                continue
            generator = getattr(holder, "generator", None)
            created = not isinstance(generator, torch.Generator)
            if created:
                generator = torch.Generator(device=entry["device"])
            try:
                generator.set_state(entry["state"])
            except (RuntimeError, TypeError, ValueError) as exc:
                not_restored.append(f"{what} (saved on {entry['device']}, now on {generator.device}: {exc})")
                continue
            if created:
                holder.generator = generator
