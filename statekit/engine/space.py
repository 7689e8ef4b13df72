"""The free-space check before a local save: compare the bytes about to be written with
the free space, and fail before the first byte (a save that fails half-way on a full disk
wastes the time it took and leaves a half-written directory behind)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from statekit.engine.entries import Entry
from statekit.errors import StorageError
from statekit.storage import Storage

RESERVE_BYTES = 1024 * 1024
"""Added to the tensor bytes for what the estimate does not count: safetensors headers,
JSON state files, the manifest, RNG state (a few KiB each)."""


def tensor_bytes(entries: Iterable[Entry], rank: int) -> int:
    """Estimated bytes of tensor data this rank writes for ``entries`` (its per-rank ones, on
    rank 0 the replicated ones too): model parameters and buffers (local shards; no ``meta``),
    optimizer state, tensor entries, shared storages once. Other objects are left to
    :data:`RESERVE_BYTES`."""
    seen: set[tuple[Any, int]] = set()
    total = 0
    for e in entries:
        if rank != 0 and not e.per_rank:
            continue
        for t in _tensors_of(e):
            t = getattr(t, "_local_tensor", t)  # DTensor: this rank's shard
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            key = (t.device, t.data_ptr())  # not untyped_storage(): 8 us a tensor (header.view_identity)
            if key in seen:
                continue
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def _tensors_of(e: Entry) -> Iterable[Any]:
    if e.kind == "model":  # parameters, not state_dict(): FSDP1's gathers the full model
        return [*e.obj.parameters(), *e.obj.buffers()]
    if e.kind == "optimizer":
        return [v for state in e.obj.state.values() for v in state.values()]
    if e.kind == "tensor":
        return [e.obj]
    return []


def check_free_space(storage: Storage, entries: Iterable[Entry], rank: int, overwrite: bool = False) -> None:
    """Raise before anything is written when this rank's share of the save does not fit.

    Remote storage is not checked; with ``overwrite`` the directory's files count as free.

    Raises:
        StorageError: needed bytes (tensor bytes + :data:`RESERVE_BYTES`) exceed the free
            bytes; the message names the checkpoint URL, the path measured, both numbers.
    """
    free = storage.free_bytes()
    if free is None:
        return
    available, measured = free
    reclaimable = sum(storage.size(rel) for rel in storage.find()) if overwrite and storage.exists() else 0
    needed = tensor_bytes(entries, rank) + RESERVE_BYTES
    if needed > available + reclaimable:
        raise StorageError(
            f"{storage.url}: No space left for this save: it needs about {needed:,} bytes "
            f"and {measured} has {available:,} bytes free"
            + (f" (+{reclaimable:,} bytes of the checkpoint it overwrites)" if reclaimable else "")
            + "; nothing was written (free space, or save elsewhere)",
            url=storage.url,
        )
