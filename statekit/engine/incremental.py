"""Incremental saves: a tensor file that did not change since the run's last committed
checkpoint is reused from it (hard link, server-side copy) instead of written again.

The decision is made from the bytes, never from ``requires_grad`` or a flag: a file is
reused only when :func:`statekit.format.tensors.compare_file` finds that every byte the
save would write equals the committed file's (its running checksums, recorded by the
writer at the end of the header, 1 MiB later and then every 64 MiB, and its checksum), so a frozen weight
edited in place is written again. Every checkpoint directory stays complete on its own:
retention and ``statekit gc`` delete directories as before, and a hard link keeps the
bytes alive for every checkpoint that lists them.

What the run's layout does for it (:func:`split_model`): a model whose state dict
interleaves parameters that do not require gradients (a frozen base) and ones that do
(adapters) is written as two kinds of files, the trainable tensors in ``<key>.safetensors``
and the rest in ``<key>.frozen-<nnnnn>.safetensors`` of at most
:data:`FROZEN_FILE_BYTES` each, so the frozen files can be reused. ``requires_grad``
decides only this placement; a wrong guess costs bytes, never exactness.

The call sequence: ``CheckpointManager.save`` passes the run's last committed checkpoint
(:class:`ReuseBase`) to the save; :meth:`statekit.engine.context.Checkpoint.save_tensors`
asks :meth:`ReuseBase.entry_for` for the committed file of the same path, compares, and
reuses it through :meth:`statekit.storage.Storage.reuse` or writes it with a
:class:`~statekit.storage.hashing.PrefixHasher` (the records the next save compares with).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from statekit.format.manifest_types import FileEntry, Manifest
from statekit.storage import Storage

FROZEN_FILE_BYTES = 512 * 1024**2
"""Largest frozen-tensor file of a split model, bytes (a tensor larger than this is a file
of its own): a frozen weight edited in place rewrites one such file, not the whole base,
and the files of a base are compared with the committed ones in parallel, one per core
(:meth:`statekit.engine.context.Checkpoint.comparing_ahead`): a 1 GiB base is two files,
hashed on two cores. 2 GiB files (issue 29's first version) hashed a 1 GiB base on one."""

SPLIT_MIN_BYTES = 1024 * 1024
"""A model is split only when its frozen tensors hold at least this many bytes: below it,
rewriting them costs less than a second file."""

FROZEN_INFIX = ".frozen-"
"""Between a model's key and the file number in the name of a frozen-tensor file."""


@dataclasses.dataclass(frozen=True)
class ReuseBase:
    """The committed checkpoint an incremental save compares its tensor files with.

    Attributes:
        storage: that checkpoint's directory.
        name: its directory name (``checkpoint-00000100``), recorded in the new
            checkpoint's entries of the files it reuses (``reused_from``).
        manifest: its committed manifest.
    """

    storage: Storage
    name: str
    manifest: Manifest

    def entry_for(self, rel: str, writer: str) -> FileEntry | None:
        """The committed file ``rel`` when the same writer wrote it, else None."""
        entry = self.manifest.files.get(rel)
        if entry is None or (entry.writer or "statekit") != writer:
            return None
        return entry


def split_model(key: str, weights: Mapping[str, torch.Tensor], model: torch.nn.Module | None) -> dict[str, dict[str, torch.Tensor]]:
    """The files of one model's state dict in an incremental save: ``relative path ->
    tensors``, in state-dict order within each file.

    Tensors whose storage belongs to a parameter with ``requires_grad=False`` (and to no
    parameter that requires gradients) go to ``<key>.frozen-<nnnnn>.safetensors`` files of
    at most :data:`FROZEN_FILE_BYTES`; the rest (trainable parameters, buffers) to
    ``<key>.safetensors``. Tensors sharing one storage (tied weights) stay in one file. A
    model with no trainable parameter, no frozen one, or under :data:`SPLIT_MIN_BYTES` of
    frozen tensors is one file, ``<key>.safetensors``, as in a full save.

    Args:
        key: the model's stable key.
        weights: its state dict (tensors only).
        model: the unwrapped model (its parameters say what requires gradients); None: one file.

    Returns:
        ``{relative path: {name: tensor}}``, ``<key>.safetensors`` first.
    """
    whole = {f"{key}.safetensors": dict(weights)}
    if model is None:
        return whole
    frozen_storages, trainable_storages = set(), set()
    for p in model.parameters():
        if p.device.type == "meta" or p.numel() == 0:
            continue
        (trainable_storages if p.requires_grad else frozen_storages).add(p.untyped_storage().data_ptr())
    frozen_storages -= trainable_storages
    if not frozen_storages or not trainable_storages:
        return whole

    def storage_of(t: torch.Tensor) -> int | None:
        if t.device.type == "meta" or t.numel() == 0:
            return None
        return t.untyped_storage().data_ptr()

    frozen = {name for name, t in weights.items() if storage_of(t) in frozen_storages}
    if sum(weights[n].numel() * weights[n].element_size() for n in frozen) < SPLIT_MIN_BYTES:
        return whole
    files: dict[str, dict[str, torch.Tensor]] = {f"{key}.safetensors": {}}
    file_of_storage: dict[int, str] = {}
    number, filled = 0, 0
    for name, t in weights.items():
        if name not in frozen:
            files[f"{key}.safetensors"][name] = t
            continue
        storage = storage_of(t)
        rel = file_of_storage.get(storage)
        if rel is None:
            nbytes = t.numel() * t.element_size()
            if filled and filled + nbytes > FROZEN_FILE_BYTES:
                number, filled = number + 1, 0
            rel = f"{key}{FROZEN_INFIX}{number:05d}.safetensors"
            file_of_storage[storage] = rel
            filled += nbytes
        files.setdefault(rel, {})[name] = t
    return files


def is_frozen_file(key: str, rel: str) -> bool:
    """Whether ``rel`` is one of model ``key``'s frozen-tensor files (:func:`split_model`)."""
    return rel.startswith(f"{key}{FROZEN_INFIX}") and rel.endswith(".safetensors")


__all__ = ["FROZEN_FILE_BYTES", "ReuseBase", "is_frozen_file", "split_model"]
