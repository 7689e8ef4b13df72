"""Consolidate a checkpoint's models into plain safetensors files (``statekit convert --to safetensors``).

Tensors are assembled one at a time from their chunks (peak memory: one full tensor plus
one chunk); the output layout and names: docs/plugins/fsdp.md (Consolidation).
Format: the safetensors specification (https://github.com/huggingface/safetensors#format).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any, BinaryIO

import torch

from statekit.plugin_api import (
    CHUNK_BYTES,
    CORE,
    SAFETENSORS_CODES,
    Checkpoint,
    CorruptCheckpointError,
    ExportTensor,
    Manifest,
    ModelSource,
    StatekitError,
    Storage,
    UnsupportedDtypeError,
    encode_header,
    model_tensor_files,
    read_header,
    read_manifest,
    read_tensors,
    tensor_bytes,
)

logger = logging.getLogger("statekit_fsdp")

PLUGIN_NAME = "fsdp"
"""Entry-point name of the plugin; the manifest names it as owner of the models it saved
(those :func:`consolidate` assembles from shards)."""

MAX_OPEN_FILES = 64
"""Shard files kept open at once while assembling (least recently used are closed)."""


def consolidate(
    src_url: str, out_url: str, *, storage_options: dict[str, Any] | None = None, verify: bool = True
) -> list[str]:
    """Write the full weights of every model of a committed checkpoint as safetensors.

    Args:
        src_url: the checkpoint (any fsspec URL).
        out_url: output directory (created if needed; existing files of the same name are
            replaced).
        storage_options: fsspec options for both URLs.
        verify: check each shard file's size and checksum against the manifest first
            (one streaming pass per file through statekit's verifying reader, in 16 MiB reads).

    Returns:
        The URLs of the files written.

    Raises:
        CheckpointNotFoundError, IncompleteCheckpointError: no committed checkpoint.
        CorruptCheckpointError: a file fails verification, or chunks are missing or
            do not cover a tensor (names the file).
        UnsupportedDtypeError: a tensor has a dtype safetensors cannot store natively.
        StatekitError: the checkpoint holds no model this converter can read.
    """
    storage = Storage(src_url, storage_options)
    manifest = read_manifest(storage)
    models = [(k, o) for k, o in manifest.objects.items() if o.kind == "model"]
    readable = [(k, o) for k, o in models if o.owner in (PLUGIN_NAME, CORE)]
    for key, obj in models:
        if (key, obj) not in readable:
            logger.warning("statekit-fsdp: %s: model %r was saved by plugin %r; not consolidated", src_url, key, obj.owner)
    if not readable:
        raise StatekitError(
            f"{src_url}: no model to consolidate (models: {[k for k, _ in models] or 'none'}; "
            f"only models saved by statekit-fsdp or the core are read)"
        )
    out = Storage(out_url, storage_options)
    written = []
    for key, obj in readable:
        name = "model.safetensors" if len(readable) == 1 else f"{key}.safetensors"
        if obj.owner == PLUGIN_NAME:
            _consolidate_sharded(storage, manifest, key, out, name, verify)
        else:
            _copy_replicated(storage, manifest, key, out, name, verify)
        written.append(out.url_of(name))
    return written


# --------------------------------------------------------------------------- sharded models


def _consolidate_sharded(storage: Storage, manifest: Manifest, key: str, out: Storage, out_name: str, verify: bool) -> None:
    verified = Checkpoint(storage, mode="load", manifest=manifest, verify=True)
    assembler = _Assembler(verified, key)
    try:
        if verify:
            assembler.verify()
        header = _header([(fqn, md.properties.dtype, tuple(md.size)) for fqn, _, md in assembler.entries], f"{storage.url}/{key}")
        with out.open_write(out_name) as f:
            f.write(header)
            for fqn, _, _ in assembler.entries:
                full = assembler.read(fqn)
                _write_tensor(f, full)
                del full
    finally:
        assembler.close()


def export_source(checkpoint: Checkpoint, key: str) -> ModelSource | None:
    """The ``STATEKIT_EXPORT_SOURCE`` of this plugin (``statekit.export_pretrained``): model
    ``key``'s full tensors, each assembled from its shards when read (peak: one full
    tensor plus one shard's chunk); :meth:`ModelSource.verify` checks every shard file.
    None for a model this plugin did not save sharded (the core reads it)."""
    manifest = checkpoint.manifest
    if manifest is None or manifest.objects[key].owner != PLUGIN_NAME:
        return None
    assembler = _Assembler(checkpoint, key)
    return ModelSource(
        tensors=[ExportTensor(fqn, md.properties.dtype, tuple(md.size)) for fqn, _, md in assembler.entries],
        read=assembler.read, verify=assembler.verify, close=assembler.close,
    )


class _Assembler:
    """Model ``key``'s full tensors from DCP's metadata and shard files, one at a time."""

    def __init__(self, checkpoint: Checkpoint, key: str) -> None:
        from statekit_fsdp.dcp_metadata import read_metadata
        from statekit_fsdp.state import REF

        storage = checkpoint.storage
        self.checkpoint, self.key, self.url = checkpoint, key, storage.url
        self.metadata = read_metadata(checkpoint, key)
        skeleton = checkpoint.load_state(f"{key}/state")
        model_part = skeleton.get("model") if isinstance(skeleton, dict) else None
        if not isinstance(model_part, dict):
            raise CorruptCheckpointError(f"{storage.url}/{key}/state.json: no model state", path=f"{storage.url}/{key}/state.json")
        self.entries: list[tuple[str, str, Any]] = []
        for fqn, leaf in model_part.items():
            if not (isinstance(leaf, dict) and REF in leaf):
                logger.warning("statekit-fsdp: %s: %r of model %r is not a tensor; not written", storage.url, fqn, key)
                continue
            md = self.metadata.state_dict_metadata.get(leaf[REF])
            if md is None or not hasattr(md, "chunks"):
                raise CorruptCheckpointError(f"{storage.url}/{key}/metadata.json: no tensor entry for {leaf[REF]!r}", path=f"{storage.url}/{key}/metadata.json")
            self.entries.append((str(fqn), leaf[REF], md))
        self.by_fqn = {fqn: (flat, md) for fqn, flat, md in self.entries}
        self.reader = _ShardReader(storage, key)

    def verify(self) -> None:
        """Read every shard file of the model through the verifying reader (size, checksum)."""
        from torch.distributed.checkpoint.metadata import MetadataIndex

        files = sorted(
            {self.metadata.storage_data[MetadataIndex(flat, c.offsets)]["file"] for _, flat, md in self.entries for c in md.chunks}
        )
        for rel_file in files:
            _verify_file(self.checkpoint, f"{self.key}/{rel_file}")

    def read(self, fqn: str) -> torch.Tensor:
        """The full tensor ``fqn``, assembled from its chunks.

        Raises:
            CorruptCheckpointError: a chunk has another shape or dtype than the metadata
                says, or the chunks do not cover the tensor (names the file).
        """
        from torch.distributed.checkpoint.metadata import MetadataIndex

        from statekit_fsdp.dcp_storage import narrow

        flat, md = self.by_fqn[fqn]
        full = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        covered = 0
        for chunk in md.chunks:
            info = self.metadata.storage_data[MetadataIndex(flat, chunk.offsets)]
            target = narrow(full, chunk.offsets, chunk.sizes)
            part = self.reader.read(info["file"], info["name"], into=target if target.is_contiguous() else None)
            if part is target:  # read in place (a dim-0 shard: no second copy of the chunk)
                covered += part.numel()
                continue
            if tuple(part.shape) != tuple(chunk.sizes) or part.dtype != full.dtype:
                raise CorruptCheckpointError(
                    f"{self.url}/{self.key}/{info['file']}: {info['name']!r} is {list(part.shape)} {part.dtype}, "
                    f"metadata says {list(chunk.sizes)} {full.dtype}",
                    path=f"{self.url}/{self.key}/{info['file']}",
                )
            target.copy_(part)
            covered += part.numel()
            del part
        if covered != full.numel():
            raise CorruptCheckpointError(
                f"{self.url}/{self.key}/metadata.json: chunks of {flat!r} cover {covered} of {full.numel()} elements",
                path=f"{self.url}/{self.key}/metadata.json",
            )
        return full

    def close(self) -> None:
        self.reader.close()


class _ShardReader:
    """Reads single named tensors from shard files, keeping a few files open."""

    def __init__(self, storage: Storage, key: str) -> None:
        self.storage = storage
        self.key = key
        self.files: OrderedDict[str, BinaryIO] = OrderedDict()

    def read(self, rel_file: str, name: str, into: torch.Tensor | None = None) -> torch.Tensor:
        """Tensor ``name`` of shard file ``rel_file``; read straight into ``into`` (a CPU,
        contiguous view of the full tensor) when its stored shape and dtype are those of
        ``into``, else into a new buffer (the caller checks shape and dtype)."""
        rel = f"{self.key}/{rel_file}"
        f = self.files.get(rel)
        if f is None:
            try:
                f = self.storage.open_read(rel)
            except FileNotFoundError:
                raise CorruptCheckpointError(f"{self.storage.url}/{rel}: file is missing", path=f"{self.storage.url}/{rel}") from None
            self.files[rel] = f
            while len(self.files) > MAX_OPEN_FILES:
                self.files.popitem(last=False)[1].close()
        self.files.move_to_end(rel)
        f.seek(0)
        url = self.storage.url_of(rel)
        header = read_header(f, url)
        entry = next((e for e in header.entries if e.name == name), None)
        if into is not None and (entry is None or tuple(entry.shape) != tuple(into.shape) or entry.dtype != into.dtype):
            into = None
        tensors, _ = read_tensors(f, url, None, names=[name], into={name: into} if into is not None else None, header=header)
        if name not in tensors:
            raise CorruptCheckpointError(f"{url}: tensor {name!r} is missing", path=url)
        return tensors[name]

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        self.files.clear()


def _verify_file(checkpoint: Checkpoint, rel: str) -> None:
    """Read one file to its end through the checkpoint's verifying reader, which compares
    its size and checksum with the manifest (in reads of :data:`CHUNK_BYTES`)."""
    with checkpoint.open(rel, "rb") as f:
        while f.read(CHUNK_BYTES):
            pass


# --------------------------------------------------------------------------- replicated (core) models


def _copy_replicated(storage: Storage, manifest: Manifest, key: str, out: Storage, out_name: str, verify: bool) -> None:
    files = manifest.objects[key].files or ()
    rel = f"{key}.safetensors"
    if f"{key}.json" in files or rel not in manifest.files:
        raise StatekitError(f"{storage.url}: model {key!r} is not stored as plain tensors ({rel}); cannot consolidate it")
    checkpoint = Checkpoint(storage, mode="load", manifest=manifest, verify=verify)
    tensors = checkpoint.load_tensors(rel)  # the core's replicated file: one copy, aliases expanded
    # an incremental save puts the frozen parameters in files of their own
    for frozen in model_tensor_files(key, files)[1:]:
        more = checkpoint.load_tensors(frozen)
        twice = sorted(set(more) & set(tensors))
        if twice:
            raise CorruptCheckpointError(f"{storage.url}/{frozen}: {twice} also in another file of model {key!r}", path=f"{storage.url}/{frozen}")
        tensors.update(more)
    header = _header([(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()], f"{storage.url}/{rel}")
    with out.open_write(out_name) as f:
        f.write(header)
        for t in tensors.values():
            _write_tensor(f, t)


# --------------------------------------------------------------------------- safetensors output


def _header(entries: list[tuple[str, torch.dtype, tuple[int, ...]]], source: str) -> bytes:
    """The safetensors header for tensors written in order, by the core's one header writer
    (``encode_header``); ``__metadata__`` is ``{"format": "pt"}`` only (the output is a plain
    safetensors file for any tool), and only native safetensors dtypes are accepted."""
    specs = []
    seen: set[str] = set()
    for name, dtype, shape in entries:
        code = SAFETENSORS_CODES.get(dtype)
        if code is None:
            raise UnsupportedDtypeError(f"{source}: tensor {name!r} has dtype {dtype}, which safetensors cannot store natively")
        if name in seen or name == "__metadata__":
            raise StatekitError(f"{source}: tensor name {name!r} appears twice")
        seen.add(name)
        specs.append((name, code, shape, torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()))
    return encode_header(specs, {"format": "pt"})


def _write_tensor(f: BinaryIO, t: torch.Tensor) -> None:
    view = tensor_bytes(t)
    for start in range(0, len(view), CHUNK_BYTES):
        f.write(view[start : start + CHUNK_BYTES])
