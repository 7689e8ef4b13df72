"""The reader of ``torch.distributed.checkpoint`` (DCP) directories: ``.metadata`` (a pickle,
only with ``allow_pickle``) plus ``*.distcp`` files, tensor chunks read by ranged reads."""

from __future__ import annotations

import io
import math
import pickle
from typing import Any

import torch

from statekit import format as fmt
from statekit.errors import CorruptCheckpointError, StatekitError
from statekit.foreign.base import CheckpointReader, TensorInfo
from statekit.foreign.pickles import refuse_pickle
from statekit.storage import Storage

DCP_METADATA = ".metadata"
"""The file that marks a DCP directory (a pickled ``Metadata``)."""


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class DCPReader(CheckpointReader):
    """A ``torch.distributed.checkpoint`` directory; ``.metadata`` needs ``allow_pickle``.

    Tensors are listed from ``Metadata.state_dict_metadata`` (``TensorStorageMetadata``:
    dtype, size, chunks); non-tensor entries (``BytesStorageMetadata``) are listed in
    ``metadata["objects"]``. One tensor is read chunk by chunk: each chunk's bytes are at
    ``storage_data[MetadataIndex].relative_path/offset/length``, written by
    ``torch.distributed.checkpoint.filesystem._write_item`` either with ``torch.save``
    (loaded here with ``weights_only=True``) or as raw bytes.
    """

    format = "dcp"

    def __init__(self, storage: Storage, allow_pickle: bool) -> None:
        super().__init__(storage, allow_pickle)
        url = storage.url_of(DCP_METADATA)
        refuse_pickle(url, allow_pickle, "DCP metadata")
        try:
            local = storage.local_path()
            if local is not None:
                # imported here, not at the top: torch.distributed.checkpoint takes about a
                # second to import, and `import statekit` (which imports this module) must stay light
                from torch.distributed.checkpoint import FileSystemReader

                self._md = FileSystemReader(local).read_metadata()
            else:  # what FileSystemReader.read_metadata does: pickle.load of the file
                self._md = pickle.loads(storage.read_bytes(DCP_METADATA))  # noqa: S301 - allowed by the caller
        except (pickle.UnpicklingError, EOFError, AttributeError, ImportError) as exc:
            raise CorruptCheckpointError(f"{url}: cannot read DCP metadata: {exc}", path=url) from exc
        objects = [k for k, v in self._md.state_dict_metadata.items() if not hasattr(v, "chunks")]
        self.metadata = {"objects": objects}

    def _chunks(self, fqn: str) -> list[tuple[Any, Any]]:
        return [(idx, info) for idx, info in self._md.storage_data.items() if idx.fqn == fqn]

    def _list(self) -> list[TensorInfo]:
        out = []
        for fqn, meta in self._md.state_dict_metadata.items():
            if not hasattr(meta, "chunks"):
                continue
            dtype = meta.properties.dtype
            shape = tuple(meta.size)
            files = ",".join(sorted({info.relative_path for _, info in self._chunks(fqn)}))
            out.append(TensorInfo(fqn, fmt.dtype_name(dtype), shape, math.prod(shape) * _itemsize(dtype), files))
        return out

    def _load(self, info: TensorInfo) -> torch.Tensor:
        meta = self._md.state_dict_metadata[info.name]
        out = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        for idx, stored in self._chunks(info.name):
            # the chunk is the one at the index's offsets (MetadataIndex.index is only a lookup hint)
            chunk_meta = next((c for c in meta.chunks if tuple(c.offsets) == tuple(idx.offset or ())), None)
            if chunk_meta is None:
                url = self.storage.url_of(DCP_METADATA)
                raise CorruptCheckpointError(f"{url}: no chunk of {info.name!r} at offsets {idx.offset}", path=url)
            sizes, offsets = tuple(chunk_meta.sizes), tuple(chunk_meta.offsets)
            chunk = self._read_chunk(info.name, stored, sizes, meta.properties.dtype)
            region = out
            for dim, (o, s) in enumerate(zip(offsets, sizes)):
                region = region.narrow(dim, o, s)
            region.copy_(chunk.reshape(sizes))
        return out

    def _read_chunk(self, name: str, stored: Any, sizes: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """One chunk's bytes (``stored``: its ``_StorageInfo``), as raw data or a ``torch.save`` blob."""
        if getattr(stored, "transform_descriptors", None):
            raise StatekitError(
                f"{self.storage.url_of(stored.relative_path)}: tensor {name!r} is stored with transforms "
                f"{stored.transform_descriptors}, which statekit does not read"
            )
        with self.storage.open_read(stored.relative_path) as f:
            f.seek(stored.offset)
            data = f.read(stored.length)
        raw = math.prod(sizes) * _itemsize(dtype)
        if len(data) != stored.length:
            url = self.storage.url_of(stored.relative_path)
            raise CorruptCheckpointError(f"{url}: truncated while reading tensor {name!r}", path=url)
        if stored.length == raw and data[:2] != b"PK":
            return torch.frombuffer(bytearray(data), dtype=dtype).reshape(sizes) if raw else torch.empty(sizes, dtype=dtype)
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
