"""torch.distributed.checkpoint storage over a statekit checkpoint: safetensors shards, JSON metadata.

The storage half of DCP (the interface of ``torch/distributed/checkpoint/storage.py``):
:class:`StatekitStorageWriter` writes each rank's chunks to ``<prefix>/rank-<rank:05d>.safetensors``
(frozen chunks of an incremental save to ``.frozen.safetensors``) and the coordinator
``metadata.json``; :class:`StatekitStorageReader` reads them back, verified. Non-tensor
(``BYTE_IO``) items are refused: DCP would pickle them. Files: docs/plugins/fsdp.md#files.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any

import torch
from torch.distributed.checkpoint import StorageReader, StorageWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from statekit.plugin_api import CorruptCheckpointError, StatekitError, rank_name
from statekit_fsdp.dcp_metadata import METADATA_NAME, metadata_to_json, read_metadata


FROZEN_SUFFIX = ".frozen"
"""Between the rank name and ``.safetensors`` in the name of a rank's frozen-chunk file."""


def shard_file(rank: int, frozen: bool = False) -> str:
    """``"rank-00001.safetensors"`` (relative to the model's directory), or
    ``"rank-00001.frozen.safetensors"`` for the rank's frozen-parameter chunks."""
    return f"{rank_name(rank)}{FROZEN_SUFFIX if frozen else ''}.safetensors"


def chunk_name(fqn: str, offsets: Any) -> str:
    """Tensor name of a chunk inside a shard file: the FQN, plus ``@o1,o2`` when the chunk
    does not start at the origin (two chunks of one tensor in one file stay distinct)."""
    offsets = [int(o) for o in (offsets or ())]
    return fqn if not any(offsets) else f"{fqn}@{','.join(map(str, offsets))}"


def narrow(t: torch.Tensor, offsets: Any, lengths: Any) -> torch.Tensor:
    """The region ``offsets[d] : offsets[d] + lengths[d]`` of every dimension ``d`` (a view)."""
    for dim, (start, length) in enumerate(zip(offsets, lengths)):
        if start != 0 or length != t.size(dim):
            t = t.narrow(dim, int(start), int(length))
    return t


def _done(value: Any) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut


# --------------------------------------------------------------------------- writer


class StatekitStorageWriter(StorageWriter):
    """DCP storage writer that writes into a statekit checkpoint.

    Each rank writes its chunks through ``checkpoint.save_tensors`` (tensor names from
    :func:`chunk_name`); the chunks of the flat keys in ``frozen`` go to the rank's
    ``.frozen`` file (when it also has other chunks). A rank with nothing to write writes no file.

    Args:
        checkpoint: the :class:`statekit.Checkpoint` of the save (open for writing).
        prefix: directory inside the checkpoint (the model's stable key, ``model_0``).
        frozen: flat keys (``model.<fqn>``) of frozen parameters; empty: one file per rank.
            It decides only which file a chunk goes to, never whether a file is reused
            (the core compares bytes): a wrong guess costs bytes, not exactness.
    """

    def __init__(self, checkpoint: Any, prefix: str, frozen: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.checkpoint = checkpoint
        self.prefix = prefix
        self.frozen = frozenset(frozen)
        self.is_coordinator = False

    def reset(self, checkpoint_id: Any = None) -> None:
        """Start a new write (``checkpoint_id`` is ignored: the location is the checkpoint's)."""

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Remember whether this rank coordinates (writes the metadata)."""
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Return the plan unchanged (file names follow from the rank)."""
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Return the plans unchanged."""
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        """Write this rank's chunks as one safetensors file (two with frozen chunks).

        Returns:
            A completed future holding one ``WriteResult`` per item, whose
            ``storage_data`` is ``{"file", "name", "size_bytes"}``.

        Raises:
            StatekitError: a non-tensor item reached the writer (it would be pickled).
        """
        rank = self.checkpoint.rank
        split = any(item.index.fqn in self.frozen for item in plan.items) and any(
            item.index.fqn not in self.frozen for item in plan.items
        )
        files: dict[str, dict[str, torch.Tensor]] = {shard_file(rank): {}, shard_file(rank, frozen=True): {}}
        names: set[str] = set()
        results = []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                raise StatekitError(
                    f"{self.checkpoint.url}/{self.prefix}: {item.index.fqn!r} is not a tensor; statekit-fsdp "
                    "stores non-tensor state as JSON and never lets DCP pickle it"
                )
            data = planner.resolve_data(item)
            if not isinstance(data, torch.Tensor):
                raise StatekitError(f"{self.checkpoint.url}/{self.prefix}: {item.index.fqn!r} resolved to {type(data).__name__}, not a tensor")
            name = chunk_name(item.index.fqn, item.index.offset)
            if name in names:
                raise StatekitError(f"{self.checkpoint.url}/{self.prefix}: chunk {name!r} planned twice on rank {rank}")
            names.add(name)
            rel_file = shard_file(rank, frozen=split and item.index.fqn in self.frozen)
            files[rel_file][name] = data.detach()
            size_bytes = data.numel() * data.element_size()
            results.append(WriteResult(index=item.index, size_in_bytes=size_bytes, storage_data={"file": rel_file, "name": name, "size_bytes": size_bytes}))
        for rel_file, tensors in files.items():
            if tensors:
                self.checkpoint.save_tensors(
                    f"{self.prefix}/{rel_file}",
                    tensors,
                    metadata={"statekit_fsdp.rank": str(rank), "statekit_fsdp.key": self.prefix},
                )
        return _done(results)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: write the global metadata (with every rank's chunk locations) as JSON."""
        storage = {}
        for rank_results in results:
            for r in rank_results:
                storage[r.index] = r.storage_data
        metadata = dataclasses.replace(metadata, storage_data=storage)
        self.checkpoint.save_json(f"{self.prefix}/{METADATA_NAME}", metadata_to_json(metadata))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        """Never chosen automatically by DCP (always passed explicitly)."""
        return False


# --------------------------------------------------------------------------- reader


class StatekitStorageReader(StorageReader):
    """DCP storage reader over a statekit checkpoint written by :class:`StatekitStorageWriter`.

    Args:
        checkpoint: the :class:`statekit.Checkpoint` of the load (files are verified
            against its manifest when ``checkpoint.verify`` is on).
        prefix: the model's directory inside the checkpoint.
        metadata: the already parsed metadata (see :func:`read_metadata`), or None to
            read ``<prefix>/metadata.json`` when DCP asks for it.
    """

    def __init__(self, checkpoint: Any, prefix: str, metadata: Metadata | None = None) -> None:
        super().__init__()
        self.checkpoint = checkpoint
        self.prefix = prefix
        self.metadata = metadata
        self.storage_data: dict[MetadataIndex, dict[str, Any]] = {}

    def reset(self, checkpoint_id: Any = None) -> None:
        """Start a new read (``checkpoint_id`` is ignored)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Return the checkpoint's DCP metadata (read from ``metadata.json`` once)."""
        if self.metadata is None:
            self.metadata = read_metadata(self.checkpoint, self.prefix)
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Index the chunk locations of ``metadata``."""
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Return the plan unchanged."""
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Return the plans unchanged."""
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        """Read every chunk this rank needs into the planner's targets, each shard file once
        (verified when ``checkpoint.verify`` is on); returns a completed future.

        Raises:
            CorruptCheckpointError: a file is missing, fails verification, or lacks a chunk.
            StatekitError: a non-tensor read item (never written by statekit-fsdp).
        """
        by_file: dict[str, list[tuple[Any, str]]] = defaultdict(list)
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                raise StatekitError(f"{self.checkpoint.url}/{self.prefix}: {item.storage_index.fqn!r} is stored as bytes, which statekit-fsdp never writes")
            info = self.storage_data.get(item.storage_index)
            if info is None:
                raise CorruptCheckpointError(
                    f"{self.checkpoint.url}/{self.prefix}/{METADATA_NAME}: no storage entry for chunk of "
                    f"{item.storage_index.fqn!r} at offsets {list(item.storage_index.offset or [])}",
                    path=f"{self.checkpoint.url}/{self.prefix}/{METADATA_NAME}",
                )
            by_file[info["file"]].append((item, info["name"]))
        for rel_file in sorted(by_file):
            items = by_file[rel_file]
            rel = f"{self.prefix}/{rel_file}"
            names = sorted({name for _, name in items})
            tensors = self.checkpoint.load_tensors(rel, names=names)
            for item, name in items:
                if name not in tensors:
                    raise CorruptCheckpointError(f"{self.checkpoint.url}/{rel}: tensor {name!r} is missing", path=f"{self.checkpoint.url}/{rel}")
                source = narrow(tensors[name], item.storage_offsets, item.lengths)
                target = planner.resolve_tensor(item).detach()
                if target.size() != source.size():
                    raise CorruptCheckpointError(
                        f"{self.checkpoint.url}/{rel}: chunk {name!r} region has shape {list(source.size())}, "
                        f"the target expects {list(target.size())}",
                        path=f"{self.checkpoint.url}/{rel}",
                    )
                with torch.no_grad():
                    target.copy_(source)
                planner.commit_tensor(item, target)
            del tensors
        return _done(None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        """Never chosen automatically by DCP (always passed explicitly)."""
        return False
