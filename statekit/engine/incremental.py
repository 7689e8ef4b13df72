"""Incremental saves: a tensor file that did not change since the run's last committed
checkpoint is reused from it (hard link, server-side copy) instead of written again.

The decision is made from the bytes, never from ``requires_grad`` or a flag: a file is
reused only when :func:`statekit.checks.files.compare_file` finds that every byte the
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

This module owns the reuse decision (:class:`IncrementalReuse`: which file of the base is
byte for byte the file this save would write); the save's
:class:`~statekit.engine.file_writer.FileWriter` asks it before each tensor file, and
links (or writes) and records the file. The save path is drawn in ``docs/design-notes.md``
("Where a save and a load live").
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from statekit import devices
from statekit import format as fmt
from statekit.checks.files import compare_file, same_stream_bytes
from statekit.format.manifest_types import FileEntry, Manifest
from statekit.format.tensors import is_accelerator
from statekit.storage import Storage

FROZEN_FILE_BYTES = 512 * 1024**2
"""Largest frozen-tensor file of a split model, bytes (a tensor larger than this is a file
of its own): a frozen weight edited in place rewrites one such file, not the whole base,
and the files of a base are compared with the committed ones in parallel, one per core
(:meth:`IncrementalReuse.comparing_ahead`): a 1 GiB base is two files,
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


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, where the platform has one;
    ``os.cpu_count()`` counts the whole machine's)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


class IncrementalReuse:
    """The reuse decision of one incremental save: which of its files the base checkpoint
    holds byte for byte (compared from the bytes, never from a flag).

    Args:
        base: the committed checkpoint to compare with; None: nothing is reused.
    """

    def __init__(self, base: ReuseBase | None) -> None:
        self.base = base
        self._compared: dict[str, tuple[Mapping[str, torch.Tensor], concurrent.futures.Future[tuple[bool, str | None]]]] = {}
        self._digests: dict[str, str] = {}  # device digests computed by a comparison, for the write that follows

    def committed(self, rel: str, writer: str) -> FileEntry | None:
        """The base's file ``rel`` when ``writer`` wrote it there, else None."""
        return self.base.entry_for(rel, writer) if self.base is not None else None

    @contextlib.contextmanager
    def comparing_ahead(self, files: Mapping[str, Mapping[str, torch.Tensor]], writer: str) -> Iterator[frozenset[str]]:
        """Compare those of ``files`` the base holds with their committed files on worker
        threads, all at once (one file per core; at most two per accelerator, whose digests
        need temporaries in device memory), after the work queued on the caller's current
        streams (:func:`statekit.devices.wait_for_current_streams`). :meth:`unchanged` of
        such a path with the same mapping and no metadata waits for its comparison.
        Comparisons not waited for are cancelled (or finish unread) at the block's end,
        which returns only once no worker reads a tensor any more.

        Args:
            files: ``relative path -> {name: tensor}`` that the block saves.
            writer: the writer those files are saved by.

        Yields:
            The paths compared ahead.
        """
        committed = {rel: self.committed(rel, writer) for rel in files}
        candidates = {rel: entry for rel, entry in committed.items() if entry is not None}
        if not candidates:
            yield frozenset()
            return
        on_devices = {t.device for rel in candidates for t in files[rel].values()
                      if isinstance(t, torch.Tensor) and is_accelerator(t.device)}
        devices.wait_for_current_streams(on_devices)
        workers = min(len(candidates), 2 * len(on_devices) if on_devices else usable_cpus())
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="statekit-compare") as pool:
            for rel, entry in candidates.items():
                self._compared[rel] = (files[rel], pool.submit(
                    compare_file, files[rel], None, entry.size_bytes, entry.checksum, entry.prefixes or (), entry.digest
                ))
            try:
                yield frozenset(candidates)
            finally:
                for _, future in self._compared.values():
                    future.cancel()
                self._compared.clear()

    def unchanged(
        self, rel: str, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None, writer: str
    ) -> FileEntry | None:
        """The base's entry of ``rel`` when every byte this save would write for
        ``tensors`` is the same (:func:`statekit.checks.files.compare_file`: the
        comparison started by :meth:`comparing_ahead`, or one made now), else None. A
        device digest computed on the way is kept for the write of a changed file
        (:meth:`digest_for`)."""
        committed = self.committed(rel, writer)
        if committed is None:
            return None
        ahead = self._compared.pop(rel, None)
        if ahead is not None and ahead[0] is tensors and not metadata:
            same, digest = ahead[1].result()
        else:  # (a file of a full save has no prefixes: compared whole, by its checksum)
            same, digest = compare_file(
                tensors, metadata, committed.size_bytes, committed.checksum, committed.prefixes or (), committed.digest
            )
        if digest is not None and not same:
            self._digests[rel] = digest
        return committed if same else None

    def same_stream(self, rel: str, size_bytes: int, chunks: Callable[[], Iterable[Any]], writer: str) -> FileEntry | None:
        """The base's entry of ``rel`` when the bytes ``chunks()`` yields are exactly its
        bytes (compared with its running checksums, stopping at the first difference),
        else None; ``chunks`` is called only when the base has a file of that size."""
        committed = self.committed(rel, writer)
        if committed is None or committed.size_bytes != size_bytes:
            return None
        if not same_stream_bytes(chunks(), committed.size_bytes, committed.checksum, committed.prefixes or ()):
            return None
        return committed

    def digest_for(self, rel: str) -> str | None:
        """The device digest a comparison computed for ``rel`` (taken: asked once), or None."""
        return self._digests.pop(rel, None)

    def reused_entry(self, committed: FileEntry, rank: int, writer: str) -> FileEntry:
        """This save's entry of a file taken from the base."""
        return FileEntry(
            size_bytes=committed.size_bytes, checksum=committed.checksum, rank=rank, writer=writer,
            prefixes=committed.prefixes or None, reused_from=self.base.name if self.base is not None else None,
            digest=committed.digest,
        )


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


__all__ = ["FROZEN_FILE_BYTES", "IncrementalReuse", "ReuseBase", "is_frozen_file", "split_model", "usable_cpus"]
