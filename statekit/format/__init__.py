"""The on-disk format (``statekit/1``; ``statekit/2`` where a model spans several tensor files), as one facade: safetensors tensor files, checksums, the manifest.

Tensor files follow the safetensors specification
(https://github.com/huggingface/safetensors#format): an 8-byte little-endian header
length, a JSON header ``{name: {"dtype", "shape", "data_offsets"}, "__metadata__": {...}}``
padded with spaces, then the raw little-endian tensor bytes (statekit's additions:
``docs/format.md``). statekit writes and reads that layout itself, the checksum in the same
pass; the suite checks its files against the ``safetensors`` library both ways
(``docs/design-notes.md``, Format).

Checksums are xxHash XXH3-64 (https://xxhash.com, package ``xxhash``), written as
``"xxh3_64:<16 hex digits>"``; the hasher is owned by :mod:`statekit.storage.hashing`
and re-exported here (:func:`new_hasher`, :func:`checksum_string`, :func:`checksum_bytes`).

Submodules, one responsibility each (this package re-exports their public names, so
``from statekit import format as fmt; fmt.read_tensors(...)`` keeps working):

- :mod:`statekit.format.dtypes`: torch dtype <-> safetensors code tables, byte-view dtypes.
- :mod:`statekit.format.header`: building headers, and :func:`parse_header` /
  :func:`read_header`, the one safetensors header reader.
- :mod:`statekit.format.tensors`: streaming tensor data to and from files.
- :mod:`statekit.format.manifest_types`: the manifest's dataclasses (:class:`Manifest`,
  :class:`FileEntry`, :class:`ObjectEntry`, :class:`Fingerprint`, :class:`ResumeAudit`),
  parsed and validated in one place (``Manifest.from_json``), written in canonical order by ``to_json``.
- :mod:`statekit.format.manifest`: the manifest file's name, bytes and reading.
- :mod:`statekit.format.layout`: the per-rank path ``<key>/rank-<r:05d>`` (:func:`rank_path`), the
  next-batch record's path (:func:`next_batch_path`), what a relative path may be (:func:`check_relpath`).
- :mod:`statekit.format.codec`: state trees <-> (tensors, JSON skeleton).
- :mod:`statekit.format.codec_types`: the codec's type rules.

Not here: whether two states or files are the same (:mod:`statekit.checks`), where the bytes go (:mod:`statekit.storage`, which this layer writes to and reads
from as file objects), which files a checkpoint holds (:mod:`statekit.engine`).

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
from statekit.format.manifest_types import FORMAT, FORMAT_SPLIT, MANIFEST_CHECKSUM, READ_FORMATS, FileEntry, Fingerprint, LoaderSettings, Manifest, ObjectEntry, Lineage, ResumeAudit, StateDigest
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
    "ResumeAudit",
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
