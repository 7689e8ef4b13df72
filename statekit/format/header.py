"""safetensors headers: building one for tensors to write, and the one header parser every
reader uses (https://github.com/huggingface/safetensors#format). statekit's
``__metadata__`` additions (:data:`WRITER_KEY`, ``statekit.aliases``, ``statekit.dtypes``):
docs/format.md, "Tensor files".
"""

from __future__ import annotations

import contextlib
import gc
import json
import struct
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable

import torch

from statekit.errors import CorruptCheckpointError, UnsupportedDtypeError
from statekit.format.dtypes import BYTE_VIEW_DTYPES, CODE_ITEMSIZE, DTYPE_FROM_CODE, NATIVE_DTYPES, dtype_name

MAX_HEADER_BYTES = 100 * 1024 * 1024
"""Largest safetensors header accepted (the safetensors reference limit is 100 MB)."""


# --------------------------------------------------------------------------- building


@dataclass
class _Planned:
    name: str
    tensor: torch.Tensor
    code: str
    shape: list[int]
    nbytes: int


def _check_storable(name: Any, t: Any) -> None:
    """Refuse what no safetensors file can hold (names the key)."""
    if not isinstance(name, str) or not name:
        raise UnsupportedDtypeError(f"tensor names must be non-empty strings, got {name!r}")
    if not isinstance(t, torch.Tensor):
        raise UnsupportedDtypeError(f"{name!r} is a {type(t).__name__}, not a torch.Tensor")
    if type(t).__name__ == "DTensor":
        raise UnsupportedDtypeError(
            f"{name!r} is a DTensor shard: sharded models are saved by statekit-fsdp, never as a whole tensor"
        )
    if t.device.type == "meta":
        raise UnsupportedDtypeError(f"{name!r} is on the meta device and has no data to save")


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector for the block (why: docs/design-notes.md,
    "Performance"); it runs again after if it was on.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def view_identity(t: torch.Tensor) -> tuple[Any, ...] | None:
    """``(device, data_ptr(), shape, strides, dtype)``: what makes two tensors the same view (tied
    weights), or None for an empty, non-strided or ``meta`` tensor. The one test of aliases.
    """
    if t.numel() == 0 or t.layout != torch.strided or t.device.type == "meta":
        return None
    return (t.device, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


def _plan(tensors: Mapping[str, torch.Tensor]) -> tuple[list[_Planned], dict[str, str], dict[str, str]]:
    """Decide codes, shapes and aliases (tied weights: identical views are stored once)."""
    planned: list[_Planned] = []
    aliases: dict[str, str] = {}
    byte_views: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    for name, t in tensors.items():
        _check_storable(name, t)
        identity = view_identity(t)
        if identity is not None:
            if identity in seen:
                aliases[name] = seen[identity]
                continue
            seen[identity] = name
        if t.layout != torch.strided:
            raise UnsupportedDtypeError(f"{name!r} has layout {t.layout}; only dense (strided) tensors are stored")
        shape = list(t.shape)
        if t.dtype in NATIVE_DTYPES:
            code = NATIVE_DTYPES[t.dtype]
        elif dtype_name(t.dtype) in BYTE_VIEW_DTYPES:
            code = "U8"
            byte_views[name] = dtype_name(t.dtype)
            shape = shape + [t.element_size()]
        else:
            raise UnsupportedDtypeError(f"tensor {name!r} has dtype {t.dtype}, which statekit cannot store")
        planned.append(_Planned(name, t, code, shape, t.numel() * t.element_size()))
    return planned, aliases, byte_views


WRITER_KEY = "statekit.writer"
"""``__metadata__`` key every tensor file statekit writes carries (value :data:`WRITER`): it tells
a statekit file from another tool's of the same name (``docs/format.md``, Tensor files)."""

WRITER = "statekit"


def build_header(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None, *, data_align: int = 8
) -> tuple[bytes, list[_Planned]]:
    """Build the safetensors header for ``tensors`` (no data is touched).

    Args:
        tensors: ``name -> tensor`` (any device, any strides).
        metadata: extra ``__metadata__`` entries (str -> str).
        data_align: the JSON is padded with spaces so that the data starts at a multiple
            of this many bytes (8, safetensors' own; :data:`statekit.format.tensors.PAGE_BYTES`).

    Returns:
        ``(header_bytes, plan)``: the 8-byte length + padded JSON, and the write plan.

    Raises:
        UnsupportedDtypeError: a tensor's dtype or layout cannot be stored; names the key.
    """
    planned, aliases, byte_views = _plan(tensors)
    meta = {"format": "pt", WRITER_KEY: WRITER, **(metadata or {})}
    if aliases:
        meta["statekit.aliases"] = json.dumps(aliases, separators=(",", ":"))
    if byte_views:
        meta["statekit.dtypes"] = json.dumps(byte_views, separators=(",", ":"))
    return encode_header(((p.name, p.code, p.shape, p.nbytes) for p in planned), meta, data_align=data_align), planned


def encode_header(
    entries: Iterable[tuple[str, str, Sequence[int], int]], metadata: Mapping[str, str], *, data_align: int = 8
) -> bytes:
    """The one safetensors header writer: 8-byte little-endian length, then the JSON header
    (``__metadata__`` first, then each tensor back to back in the order given), padded with spaces.
    For writers that know only names, dtypes and shapes (statekit-fsdp's consolidation).

    Args:
        entries: ``(name, safetensors dtype code, stored shape, size in bytes)`` per tensor,
            in the order their bytes follow the header.
        metadata: the ``__metadata__`` entries (str -> str), as written (nothing added).
        data_align: as for :func:`build_header`.

    Returns:
        The header bytes: length prefix + padded JSON.

    Raises:
        UnsupportedDtypeError: two entries have the same name, or one is named
            ``__metadata__`` (names it).
    """
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for name, code, shape, nbytes in entries:
        if name in header:
            what = "is reserved for the metadata" if name == "__metadata__" else "appears twice"
            raise UnsupportedDtypeError(f"tensor name {name!r} {what} in one safetensors header")
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    with gc_paused():
        raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-(8 + len(raw)) % data_align)
    return struct.pack("<Q", len(raw)) + raw


# --------------------------------------------------------------------------- parsing


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors header.

    Attributes:
        name: the key.
        dtype: the true torch dtype (byte views resolved).
        shape: the true shape.
        code: the safetensors dtype code as stored.
        stored_shape: the shape as stored (byte views have a trailing itemsize dimension).
        begin: first data byte, relative to the data section.
        end: one past the last data byte.
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    code: str
    stored_shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class TensorHeader:
    """A parsed and validated safetensors header.

    Attributes:
        entries: the stored tensors in data order.
        aliases: ``alias name -> stored name`` (tied weights).
        metadata: the ``__metadata__`` mapping.
        data_start: offset of the data section in the file, bytes.
        data_bytes: length of the data section, bytes.
    """

    entries: tuple[TensorEntry, ...]
    aliases: dict[str, str]
    metadata: dict[str, str]
    data_start: int
    data_bytes: int

    def names(self) -> list[str]:
        """Every tensor name, aliases included."""
        return [e.name for e in self.entries] + list(self.aliases)


def _malformed(source: str, why: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{source}: malformed safetensors header: {why}", path=source)


def _read_json(prefix: bytes, read_more: Callable[[int], bytes], file_size: int | None, source: str) -> tuple[dict[str, Any], bytes]:
    """The length prefix and the JSON object after it: ``(object, raw bytes)``."""
    if len(prefix) != 8:
        raise _malformed(source, f"file is {len(prefix)} bytes, shorter than the 8-byte length prefix")
    (n,) = struct.unpack("<Q", prefix)
    if n > MAX_HEADER_BYTES or (file_size is not None and 8 + n > file_size):
        raise _malformed(source, f"header length {n} does not fit the file ({file_size} bytes)")
    raw = read_more(n)
    if len(raw) != n:
        raise _malformed(source, f"header truncated ({len(raw)} of {n} bytes)")
    try:
        with gc_paused():
            header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _malformed(source, f"not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise _malformed(source, "top level is not an object")
    return header, raw


def _split_metadata(header: dict[str, Any], source: str) -> tuple[dict[str, str], dict[str, Any], dict[str, Any]]:
    """Pop ``__metadata__`` off ``header``: ``(metadata, aliases, byte-view dtypes)``."""
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _malformed(source, "__metadata__ is not a str -> str object")
    try:
        aliases = json.loads(metadata.get("statekit.aliases", "{}"))
        byte_views = json.loads(metadata.get("statekit.dtypes", "{}"))
    except json.JSONDecodeError as exc:
        raise _malformed(source, f"statekit metadata is not JSON ({exc})") from None
    if not isinstance(aliases, dict) or not isinstance(byte_views, dict):
        raise _malformed(source, "statekit metadata is not an object")
    return metadata, aliases, byte_views


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_entry(name: str, info: Any, byte_views: dict[str, Any], source: str) -> TensorEntry:
    """One validated header entry (byte views resolved to their true dtype and shape)."""
    try:
        code, stored_shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
    except (KeyError, TypeError, ValueError):
        raise _malformed(source, f"entry {name!r} lacks dtype/shape/data_offsets") from None
    if code not in DTYPE_FROM_CODE:
        raise _malformed(source, f"entry {name!r} has unknown dtype {code!r}")
    if not all(_is_count(d) and d >= 0 for d in stored_shape) or not all(_is_count(o) for o in (begin, end)):
        raise _malformed(source, f"entry {name!r} has a malformed shape or offsets")
    numel = 1
    for d in stored_shape:
        numel *= d
    if end - begin != numel * CODE_ITEMSIZE[code] or begin < 0:
        raise _malformed(source, f"entry {name!r}: offsets [{begin}, {end}] do not match shape {list(stored_shape)} {code}")
    dtype, shape = DTYPE_FROM_CODE[code], stored_shape
    if name in byte_views:
        dtype = BYTE_VIEW_DTYPES.get(byte_views[name])  # type: ignore[assignment]
        if dtype is None or code != "U8" or not stored_shape or stored_shape[-1] != dtype.itemsize:
            raise _malformed(source, f"entry {name!r} has unknown stored dtype {byte_views[name]!r} or a wrong item size")
        shape = stored_shape[:-1]
    return TensorEntry(name, dtype, shape, code, stored_shape, begin, end)


def _data_bytes(entries: list[TensorEntry], source: str) -> int:
    """The data section's length; the entries (sorted by offset) must tile it without gaps."""
    position = 0
    for e in entries:
        if e.begin != position:
            raise _malformed(source, f"entry {e.name!r} starts at {e.begin}, expected {position} (gap or overlap)")
        position = e.end
    return position


def parse_header(prefix: bytes, read_more: Any, file_size: int | None, source: str) -> tuple[TensorHeader, bytes]:
    """Parse and validate a safetensors header.

    Args:
        prefix: the first 8 bytes of the file.
        read_more: ``callable(n) -> bytes`` reading the next ``n`` bytes.
        file_size: the file size in bytes, to check the data section (None: unchecked).
        source: the file's URL, named in errors.

    Returns:
        ``(header, raw_header_bytes)``.

    Raises:
        CorruptCheckpointError: truncated file, bad length, bad JSON, unknown dtype,
            offsets that do not tile the data section; names ``source``.
    """
    header, raw = _read_json(prefix, read_more, file_size, source)
    metadata, aliases, byte_views = _split_metadata(header, source)
    entries = sorted(
        (_parse_entry(name, info, byte_views, source) for name, info in header.items()), key=lambda e: (e.begin, e.end)
    )
    data_bytes = _data_bytes(entries, source)
    for alias, target in aliases.items():
        if not isinstance(target, str) or target not in header or alias in header:
            raise _malformed(source, f"alias {alias!r} -> {target!r} does not name a stored tensor")
    data_start = 8 + len(raw)
    if file_size is not None and data_start + data_bytes != file_size:
        raise _malformed(source, f"data section is {file_size - data_start} bytes, header describes {data_bytes}")
    return TensorHeader(tuple(entries), dict(aliases), dict(metadata), data_start, data_bytes), raw


def read_header(f: BinaryIO, source: str, file_size: int | None = None, hasher: Any = None) -> TensorHeader:
    """Read and validate the header of a safetensors file open at offset 0 (through
    :func:`parse_header`), leaving it at the start of the data section.

    Args:
        f: a binary file open for reading at offset 0 (local or fsspec file).
        source: its URL, named in errors.
        file_size: its size in bytes if known (validates the data section).
        hasher: updated with every header byte read (for checksum verification), or None.

    Returns:
        The parsed header.

    Raises:
        CorruptCheckpointError: malformed or truncated header; names ``source``.
    """
    prefix = f.read(8)
    if hasher is not None:
        hasher.update(prefix)

    def read_more(n: int) -> bytes:
        data = f.read(n)
        if hasher is not None:
            hasher.update(data)
        return data

    header, _ = parse_header(prefix, read_more, file_size, source)
    return header
