"""The on-disk format (``statekit/1``; ``statekit/2`` where a model spans several tensor files), as one facade: safetensors tensor files, checksums, the manifest.

Tensor files follow https://github.com/huggingface/safetensors#format (statekit's additions:
docs/format.md), written and read by statekit itself with the checksum in the same pass (why:
docs/design-notes.md, "Format"). Checksums are XXH3-64 (https://xxhash.com), written
``"xxh3_64:<16 hex digits>"``, owned by :mod:`statekit.storage.hashing` and re-exported here.
Submodules (their public names re-exported): ``dtypes``, ``header`` (the one header reader),
``tensors``, ``manifest_types`` and ``manifest``, ``layout`` (per-rank and relative paths),
``codec`` and ``codec_types`` (state trees <-> tensors and a JSON skeleton).
Call sequences: docs/design-notes.md, "The map: layers, one save, one load".
"""

from __future__ import annotations

# The XXH3-64 hasher is owned by the storage layer (statekit.storage.hashing: its hashing
# writer and verifying reader sit below the format); the format re-exports it.
from statekit.storage.hashing import checksum_bytes, checksum_string, new_hasher
from statekit.format.dtypes import (
    BYTE_VIEW_DTYPES,
    CODE_ITEMSIZE,
    DTYPE_FROM_CODE,
    NATIVE_DTYPES,
    SAFETENSORS_CODES,
    dtype_name,
)
from statekit.format.header import MAX_HEADER_BYTES, WRITER, WRITER_KEY, TensorEntry, TensorHeader, build_header, encode_header, parse_header, read_header
from statekit.format.layout import check_relpath, next_batch_path, parse_rank_path, rank_name, rank_path
from statekit.format.manifest_types import FORMAT, FORMAT_REFERENCED, FORMAT_SPLIT, MANIFEST_CHECKSUM, READ_FORMATS, FileEntry, Fingerprint, LoaderSettings, Manifest, ObjectEntry, Lineage, Reference, ResumeAudit, SourceFile, SourceTensor, StateDigest
from statekit.format.manifest import (
    CHECKPOINT_DIR_NAME,
    MANIFEST_NAME,
    checkpoint_dirs,
    manifest_bytes,
    read_manifest,
    validate_manifest,
)
from statekit.format.tensors import (
    CHUNK_BYTES,
    fresh_buffers,
    read_exactly_into,
    read_tensors,
    tensor_bytes,
    write_tensors,
)

# Former private names, kept as aliases because the tests use them (test_format, test_codec).
_NATIVE = NATIVE_DTYPES
_BYTE_VIEW = BYTE_VIEW_DTYPES

__all__ = [
    "WRITER",
    "WRITER_KEY",
    "BYTE_VIEW_DTYPES",
    "CHUNK_BYTES",
    "CODE_ITEMSIZE",
    "DTYPE_FROM_CODE",
    "FORMAT",
    "FORMAT_REFERENCED",
    "FORMAT_SPLIT",
    "READ_FORMATS",
    "CHECKPOINT_DIR_NAME",
    "FileEntry",
    "Fingerprint",
    "StateDigest",
    "Lineage",
    "LoaderSettings",
    "Manifest",
    "ObjectEntry",
    "Reference",
    "ResumeAudit",
    "SourceFile",
    "SourceTensor",
    "MANIFEST_CHECKSUM",
    "MANIFEST_NAME",
    "MAX_HEADER_BYTES",
    "NATIVE_DTYPES",
    "SAFETENSORS_CODES",
    "TensorEntry",
    "TensorHeader",
    "build_header",
    "encode_header",
    "check_relpath",
    "checksum_bytes",
    "checksum_string",
    "dtype_name",
    "fresh_buffers",
    "new_hasher",
    "checkpoint_dirs",
    "manifest_bytes",
    "parse_header",
    "next_batch_path",
    "parse_rank_path",
    "rank_name",
    "rank_path",
    "read_header",
    "read_manifest",
    "read_exactly_into",
    "read_tensors",
    "tensor_bytes",
    "validate_manifest",
    "write_tensors",
]
