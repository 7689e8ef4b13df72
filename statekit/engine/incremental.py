"""Incremental saves: which file of the base checkpoint is byte for byte the file this save
would write (:class:`IncrementalReuse`), and the split of a model into trainable and frozen
files (:func:`split_model`). The design, measured: docs/design-notes.md, "Incremental
checkpoints"; the user's view: docs/incremental.md.
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
"""Largest frozen-tensor file of a split model, bytes (a larger tensor is a file of its own);
why 512 MiB: docs/design-notes.md, "Layout"."""

SPLIT_MIN_BYTES = 1024 * 1024
"""A model is split only when its frozen tensors hold at least this many bytes: below it,
rewriting them costs less than a second file."""

FROZEN_INFIX = ".frozen-"
"""Between a model's key and the file number in the name of a frozen-tensor file."""


@dataclasses.dataclass(frozen=True)
class ReuseBase:
    """The committed checkpoint an incremental save compares its tensor files with; ``name``
    is its directory name (``checkpoint-00000100``), recorded as ``reused_from``."""

    storage: Storage
    name: str
    manifest: Manifest


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, where the platform has one;
    ``os.cpu_count()`` counts the whole machine's)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


class IncrementalReuse:
    """The reuse decision of one incremental save against ``base`` (None: nothing is reused)."""

    def __init__(self, base: ReuseBase | None) -> None:
        self.base = base
        self._compared: dict[str, tuple[Mapping[str, torch.Tensor], concurrent.futures.Future[tuple[bool, str | None]]]] = {}
        self._digests: dict[str, str] = {}  # device digests computed by a comparison, for the write that follows

    def committed(self, rel: str, writer: str) -> FileEntry | None:
        """The base's file ``rel`` when ``writer`` wrote it there, else None."""
        entry = self.base.manifest.files.get(rel) if self.base is not None else None
        return entry if entry is not None and (entry.writer or "statekit") == writer else None

    @contextlib.contextmanager
    def comparing_ahead(self, files: Mapping[str, Mapping[str, torch.Tensor]], writer: str) -> Iterator[frozenset[str]]:
        """:meth:`statekit.Checkpoint.comparing_ahead`: one worker per core, at most two
        per accelerator (their digests need temporaries in device memory)."""
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
        ``tensors`` is the same (:func:`statekit.checks.files.compare_file`, or the
        comparison :meth:`comparing_ahead` started), else None; a device digest computed on
        the way is kept for the write (:meth:`digest_for`)."""
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


def frozen_names(weights: Mapping[str, torch.Tensor], model: torch.nn.Module | None, *,
                 all_frozen: bool = False) -> set[str]:
    """The names of ``weights`` whose storage only frozen parameters of ``model`` hold
    (``requires_grad=False``; a storage a trainable parameter also holds is not frozen): the
    one test of "frozen" for incremental splits and references. Empty without a model, or
    when none is frozen, or (unless ``all_frozen``: references take a wholly frozen model,
    a split does not) when none is trainable."""
    if model is None:
        return set()
    frozen_storages, trainable_storages = set(), set()
    for p in model.parameters():
        if p.device.type == "meta" or p.numel() == 0:
            continue
        (trainable_storages if p.requires_grad else frozen_storages).add(p.untyped_storage().data_ptr())
    frozen_storages -= trainable_storages
    if not frozen_storages or (not trainable_storages and not all_frozen):
        return set()
    return {name for name, t in weights.items()
            if t.device.type != "meta" and t.numel() and t.untyped_storage().data_ptr() in frozen_storages}


def split_model(key: str, weights: Mapping[str, torch.Tensor], model: torch.nn.Module | None) -> dict[str, dict[str, torch.Tensor]]:
    """The files of one model's state dict (``weights``, tensors only) in an incremental
    save: ``{relative path: {name: tensor}}``, ``<key>.safetensors`` first, state-dict order
    within each file.

    Tensors of storages only frozen parameters of ``model`` hold go to
    ``<key>.frozen-<nnnnn>.safetensors`` files of at most :data:`FROZEN_FILE_BYTES`, tied
    ones together; the rest to ``<key>.safetensors``. No ``model``, no trainable or no
    frozen parameter, or under :data:`SPLIT_MIN_BYTES` of frozen tensors: one file.
    """
    whole = {f"{key}.safetensors": dict(weights)}
    frozen = frozen_names(weights, model)
    if sum(weights[n].numel() * weights[n].element_size() for n in frozen) < SPLIT_MIN_BYTES:
        return whole
    files: dict[str, dict[str, torch.Tensor]] = {f"{key}.safetensors": {}}
    file_of_storage: dict[int, str] = {}
    number, filled = 0, 0
    for name, t in weights.items():
        if name not in frozen:
            files[f"{key}.safetensors"][name] = t
            continue
        storage = t.untyped_storage().data_ptr()
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


__all__ = ["FROZEN_FILE_BYTES", "IncrementalReuse", "ReuseBase", "frozen_names", "is_frozen_file", "split_model", "usable_cpus"]
