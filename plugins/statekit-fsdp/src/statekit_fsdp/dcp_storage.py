"""torch.distributed.checkpoint storage over a statekit checkpoint: safetensors shards, JSON metadata.

DCP (``torch.distributed.checkpoint``) splits a save into planning (which rank writes
which tensor chunk, done by :class:`~torch.distributed.checkpoint.DefaultSavePlanner`) and
storage (a :class:`~torch.distributed.checkpoint.StorageWriter` that puts bytes
somewhere, and a :class:`~torch.distributed.checkpoint.StorageReader` that gets them
back). This module is the storage half, written against the interface documented in
``torch/distributed/checkpoint/storage.py``:

* :class:`StatekitStorageWriter` writes every chunk a rank was assigned into one
  safetensors file, ``<prefix>/rank-<rank:05d>.safetensors``, through
  :meth:`statekit.Checkpoint.save_tensors` (streamed, checksummed in the same pass, and
  recorded in statekit's manifest with the rank). The coordinator writes DCP's global
  :class:`~torch.distributed.checkpoint.metadata.Metadata` as ``<prefix>/metadata.json``.
* :class:`StatekitStorageReader` reads the chunks a rank needs, file by file, verified
  against the manifest.

DCP's own ``FileSystemWriter``/``FsspecWriter`` pickle the metadata (and torch 2.13
reads it back with ``pickle.load``); here it is JSON (:func:`metadata_to_json`), so
loading never unpickles. Non-tensor values (DCP's ``BYTE_IO`` items, which DCP pickles
with ``torch.save``) are refused: the plugin stores non-tensor state as JSON itself and
hands DCP tensors only.

``metadata.json`` layout (``"format": "statekit-fsdp/1"``)::

    {"format": "statekit-fsdp/1",
     "version": <DCP metadata version or null>,
     "state_dict_metadata": {fqn: {"type": "tensor", "dtype": "float32", "size": [7, 5],
                                   "chunks": [{"offsets": [0, 0], "sizes": [4, 5]}, ...]}
                             | {"type": "bytes"}},
     "storage_data": [{"fqn": ..., "offset": [0, 0], "file": "rank-00000.safetensors",
                       "name": "model.0.weight", "size_bytes": 80}, ...],
     "planner_data": {fqn: [path, parts, ...]}}

Each ``storage_data`` row maps one saved chunk (DCP's ``MetadataIndex``: FQN plus chunk
offsets) to the file (relative to the prefix) and tensor name that hold it.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any

import torch
from torch.distributed.checkpoint import StorageReader, StorageWriter
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from statekit import CorruptCheckpointError, StatekitError

METADATA_FORMAT = "statekit-fsdp/1"
"""``format`` value of ``metadata.json``."""

METADATA_NAME = "metadata.json"
"""File name of DCP's global metadata inside a model's directory."""

_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)
}


def shard_file(rank: int) -> str:
    """File name (relative to the model's directory) of one rank's shards."""
    return f"rank-{rank:05d}.safetensors"


def chunk_name(fqn: str, offsets: Any) -> str:
    """Tensor name of a chunk inside a shard file: the FQN, plus ``@o1,o2`` when the chunk
    does not start at the origin (two chunks of one tensor in one file stay distinct)."""
    offsets = [int(o) for o in (offsets or ())]
    return fqn if not any(offsets) else f"{fqn}@{','.join(map(str, offsets))}"


# --------------------------------------------------------------------------- metadata <-> JSON


def metadata_to_json(metadata: Metadata) -> dict[str, Any]:
    """Serialise DCP's global metadata as a JSON-able dict (layout in the module docstring).

    Args:
        metadata: the ``Metadata`` DCP hands to ``StorageWriter.finish``, with
            ``storage_data`` set to ``{MetadataIndex: {"file", "name", "size_bytes"}}``.

    Returns:
        A dict that :func:`metadata_from_json` turns back into an equivalent ``Metadata``.

    Raises:
        StatekitError: a value the format does not cover (an unknown storage type or a
            non-JSON planner path).
    """
    sdm: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            sdm[fqn] = {
                "type": "tensor",
                "dtype": str(md.properties.dtype).removeprefix("torch."),
                "size": [int(s) for s in md.size],
                "chunks": [{"offsets": [int(o) for o in c.offsets], "sizes": [int(s) for s in c.sizes]} for c in md.chunks],
            }
        elif isinstance(md, BytesStorageMetadata):
            sdm[fqn] = {"type": "bytes"}
        else:
            raise StatekitError(f"DCP metadata for {fqn!r} has unsupported type {type(md).__name__}")
    rows = []
    for index, info in (metadata.storage_data or {}).items():
        rows.append(
            {
                "fqn": index.fqn,
                "offset": None if index.offset is None else [int(o) for o in index.offset],
                "file": info["file"],
                "name": info["name"],
                "size_bytes": int(info["size_bytes"]),
            }
        )
    planner: dict[str, Any] = {}
    for fqn, path in (metadata.planner_data or {}).items():
        parts = list(path) if isinstance(path, (tuple, list)) else [path]
        if not all(isinstance(p, (str, int)) and not isinstance(p, bool) for p in parts):
            raise StatekitError(f"DCP planner path of {fqn!r} is not made of str/int parts: {path!r}")
        planner[fqn] = parts
    return {
        "format": METADATA_FORMAT,
        "version": metadata.version,
        "state_dict_metadata": sdm,
        "storage_data": rows,
        "planner_data": planner,
    }


def metadata_from_json(doc: Any, source: str) -> Metadata:
    """Rebuild DCP's ``Metadata`` from :func:`metadata_to_json`'s output.

    Args:
        doc: the parsed ``metadata.json``.
        source: its URL, named in errors.

    Returns:
        ``Metadata`` whose ``storage_data`` maps ``MetadataIndex`` to
        ``{"file", "name", "size_bytes"}``.

    Raises:
        CorruptCheckpointError: the document is not statekit-fsdp metadata or is malformed.
    """

    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{source}: {why}", path=source)

    if not isinstance(doc, dict) or doc.get("format") != METADATA_FORMAT:
        raise bad(f"not statekit-fsdp metadata (format={doc.get('format') if isinstance(doc, dict) else None!r}, expected {METADATA_FORMAT!r})")
    try:
        sdm: dict[str, Any] = {}
        for fqn, md in doc["state_dict_metadata"].items():
            if md["type"] == "bytes":
                sdm[fqn] = BytesStorageMetadata()
                continue
            if md["type"] != "tensor":
                raise bad(f"entry {fqn!r} has unknown type {md['type']!r}")
            dtype = _DTYPES.get(md["dtype"])
            if dtype is None:
                raise bad(f"entry {fqn!r} has unknown dtype {md['dtype']!r}")
            sdm[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=dtype),
                size=torch.Size(int(s) for s in md["size"]),
                chunks=[
                    ChunkStorageMetadata(offsets=torch.Size(int(o) for o in c["offsets"]), sizes=torch.Size(int(s) for s in c["sizes"]))
                    for c in md["chunks"]
                ],
            )
        storage: dict[MetadataIndex, dict[str, Any]] = {}
        for row in doc["storage_data"]:
            if not isinstance(row["file"], str) or not isinstance(row["name"], str):
                raise bad(f"storage row for {row.get('fqn')!r} is malformed")
            storage[MetadataIndex(row["fqn"], row["offset"])] = {
                "file": row["file"],
                "name": row["name"],
                "size_bytes": int(row["size_bytes"]),
            }
        planner = {fqn: tuple(path) for fqn, path in doc["planner_data"].items()}
    except CorruptCheckpointError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise bad(f"malformed metadata: {type(exc).__name__}: {exc}") from None
    for fqn, md in sdm.items():
        if isinstance(md, TensorStorageMetadata):
            for c in md.chunks:
                if MetadataIndex(fqn, c.offsets) not in storage:
                    raise bad(f"chunk of {fqn!r} at offsets {list(c.offsets)} has no storage entry")
    return Metadata(state_dict_metadata=sdm, planner_data=planner, storage_data=storage, version=doc.get("version"))


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

    Each rank writes the chunks DCP's planner assigned to it as one safetensors file
    (``<prefix>/rank-<rank:05d>.safetensors``, tensor names from :func:`chunk_name`)
    through ``checkpoint.save_tensors``; the coordinator writes ``<prefix>/metadata.json``.
    A rank with nothing to write writes no file.

    Args:
        checkpoint: the :class:`statekit.Checkpoint` of the save (open for writing).
        prefix: directory inside the checkpoint (the model's stable key, ``model_0``).
    """

    def __init__(self, checkpoint: Any, prefix: str) -> None:
        super().__init__()
        self.checkpoint = checkpoint
        self.prefix = prefix
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
        """Write this rank's chunks as one safetensors file.

        Args:
            plan: the final local plan (its ``items`` are ``WriteItem`` s).
            planner: resolves each item to its tensor (a local shard or a whole tensor).

        Returns:
            A completed future holding one ``WriteResult`` per item, whose
            ``storage_data`` is ``{"file", "name", "size_bytes"}``.

        Raises:
            StatekitError: a non-tensor item reached the writer (it would be pickled).
        """
        rel_file = shard_file(self.checkpoint.rank)
        tensors: dict[str, torch.Tensor] = {}
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
            if name in tensors:
                raise StatekitError(f"{self.checkpoint.url}/{self.prefix}: chunk {name!r} planned twice on rank {self.checkpoint.rank}")
            tensors[name] = data.detach()
            size_bytes = data.numel() * data.element_size()
            results.append(WriteResult(index=item.index, size_in_bytes=size_bytes, storage_data={"file": rel_file, "name": name, "size_bytes": size_bytes}))
        if tensors:
            self.checkpoint.save_tensors(
                f"{self.prefix}/{rel_file}",
                tensors,
                metadata={"statekit_fsdp.rank": str(self.checkpoint.rank), "statekit_fsdp.key": self.prefix},
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
        """Read every chunk this rank needs, one shard file at a time.

        Each file is read once (verified against the manifest when verification is on)
        and the requested regions are copied into the planner's target tensors.

        Returns:
            A completed future.

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


def read_metadata(checkpoint: Any, prefix: str) -> Metadata:
    """Read and parse ``<prefix>/metadata.json`` of a checkpoint (verified by the manifest).

    Raises:
        CorruptCheckpointError: missing, failing verification, or malformed (names the file).
    """
    rel = f"{prefix}/{METADATA_NAME}"
    return metadata_from_json(checkpoint.load_json(rel), f"{checkpoint.url}/{rel}")
