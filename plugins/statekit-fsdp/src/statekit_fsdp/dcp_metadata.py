"""DCP's global metadata as JSON: ``<key>/metadata.json`` of a model saved by statekit-fsdp.

DCP's own ``FileSystemWriter``/``FsspecWriter`` pickle the metadata (and torch 2.13
reads it back with ``pickle.load``); here it is JSON (:func:`metadata_to_json`), so
loading never unpickles.

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

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from statekit.plugin_api import CorruptCheckpointError, StatekitError

METADATA_FORMAT = "statekit-fsdp/1"
"""``format`` value of ``metadata.json``."""

METADATA_NAME = "metadata.json"
"""File name of DCP's global metadata inside a model's directory."""

_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)
}


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
        sdm = {fqn: _entry_from_json(fqn, md, bad) for fqn, md in doc["state_dict_metadata"].items()}
        storage = _storage_from_json(doc["storage_data"], bad)
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


def _entry_from_json(fqn: str, md: Any, bad: Any) -> BytesStorageMetadata | TensorStorageMetadata:
    """One ``state_dict_metadata`` entry; ``bad(why)`` builds the error to raise."""
    if md["type"] == "bytes":
        return BytesStorageMetadata()
    if md["type"] != "tensor":
        raise bad(f"entry {fqn!r} has unknown type {md['type']!r}")
    dtype = _DTYPES.get(md["dtype"])
    if dtype is None:
        raise bad(f"entry {fqn!r} has unknown dtype {md['dtype']!r}")
    return TensorStorageMetadata(
        properties=TensorProperties(dtype=dtype),
        size=torch.Size(int(s) for s in md["size"]),
        chunks=[
            ChunkStorageMetadata(offsets=torch.Size(int(o) for o in c["offsets"]), sizes=torch.Size(int(s) for s in c["sizes"]))
            for c in md["chunks"]
        ],
    )


def _storage_from_json(rows: Any, bad: Any) -> dict[MetadataIndex, dict[str, Any]]:
    """The ``storage_data`` rows: ``MetadataIndex -> {"file", "name", "size_bytes"}``."""
    storage: dict[MetadataIndex, dict[str, Any]] = {}
    for row in rows:
        if not isinstance(row["file"], str) or not isinstance(row["name"], str):
            raise bad(f"storage row for {row.get('fqn')!r} is malformed")
        storage[MetadataIndex(row["fqn"], row["offset"])] = {
            "file": row["file"], "name": row["name"], "size_bytes": int(row["size_bytes"]),
        }
    return storage


def read_metadata(checkpoint: Any, prefix: str) -> Metadata:
    """Read and parse ``<prefix>/metadata.json`` of a checkpoint (verified by the manifest).

    Raises:
        CorruptCheckpointError: missing, failing verification, or malformed (names the file).
    """
    rel = f"{prefix}/{METADATA_NAME}"
    return metadata_from_json(checkpoint.load_json(rel), f"{checkpoint.url}/{rel}")
