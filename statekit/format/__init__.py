"""The on-disk format (version 1): safetensors tensor files, checksums, the manifest schema.

Tensor files follow the safetensors specification
(https://github.com/huggingface/safetensors#format): an 8-byte little-endian header
length, a JSON header ``{name: {"dtype", "shape", "data_offsets"}, "__metadata__": {...}}``
padded with spaces to a multiple of 8 bytes, then the raw little-endian tensor bytes.
statekit writes that layout itself so that tensor memory streams straight to the file
(``memoryview`` of each tensor, in chunks) with the checksum computed in the same pass:
``safetensors.torch.save`` first builds the whole file as one ``bytes`` object.
Files written here load with ``safetensors.torch.load_file`` (``__metadata__`` carries
``{"format": "pt"}`` as transformers and diffusers expect).

Checksums are xxHash XXH3-64 (https://xxhash.com, package ``xxhash``), written as
``"xxh3_64:<16 hex digits>"``.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, BinaryIO

import torch
import xxhash

from statekit.errors import CorruptCheckpointError, FormatVersionError, UnsupportedDtypeError

FORMAT = "statekit/1"
"""The manifest's ``format`` value this version writes and reads."""

MANIFEST_NAME = "statekit.json"
"""File name of the manifest; its presence marks a committed checkpoint."""

CHUNK_BYTES = 16 * 1024 * 1024
"""Largest single write/read: big enough for sequential I/O, small enough to bound buffers."""

MAX_HEADER_BYTES = 100 * 1024 * 1024
"""Largest safetensors header accepted (the safetensors reference limit is 100 MB)."""

# safetensors dtype codes for the torch dtypes stored natively (safetensors.torch._TYPES).
_NATIVE: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint64: "U64",
    torch.uint32: "U32",
    torch.uint16: "U16",
    torch.complex64: "C64",
}
_FROM_CODE = {code: dtype for dtype, code in _NATIVE.items()}
SAFETENSORS_CODES: Mapping[torch.dtype, str] = MappingProxyType(_NATIVE)
"""torch dtype -> safetensors dtype code, for the dtypes stored natively (read-only)."""
_ITEMSIZE = {code: torch.empty((), dtype=dtype).element_size() for dtype, code in _NATIVE.items()}

# dtypes stored as byte views ("U8" with a trailing itemsize dimension), true dtype in metadata.
_BYTE_VIEW: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "complex128",
        "complex32",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
        "float4_e2m1fn_x2",
    )
    if isinstance(getattr(torch, name, None), torch.dtype)
}


def new_hasher() -> Any:
    """Return a fresh XXH3-64 hasher (``update(bytes-like)``, ``hexdigest()``)."""
    return xxhash.xxh3_64()


def checksum_string(hasher: Any) -> str:
    """Format a hasher's digest as stored in the manifest: ``"xxh3_64:<hex>"``."""
    return f"xxh3_64:{hasher.hexdigest()}"


def checksum_bytes(data: bytes) -> str:
    """Checksum of an in-memory buffer, as stored in the manifest."""
    return f"xxh3_64:{xxhash.xxh3_64_hexdigest(data)}"


# --------------------------------------------------------------------------- writing


@dataclass
class _Planned:
    name: str
    tensor: torch.Tensor
    code: str
    shape: list[int]
    nbytes: int


def _plan(tensors: Mapping[str, torch.Tensor]) -> tuple[list[_Planned], dict[str, str], dict[str, str]]:
    """Decide codes, shapes and aliases (tied weights: identical views are stored once)."""
    planned: list[_Planned] = []
    aliases: dict[str, str] = {}
    byte_views: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    for name, t in tensors.items():
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
        if t.numel() > 0 and t.layout == torch.strided:
            identity = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
            if identity in seen:
                aliases[name] = seen[identity]
                continue
            seen[identity] = name
        if t.layout != torch.strided:
            raise UnsupportedDtypeError(f"{name!r} has layout {t.layout}; only dense (strided) tensors are stored")
        shape = list(t.shape)
        if t.dtype in _NATIVE:
            code = _NATIVE[t.dtype]
        elif str(t.dtype).removeprefix("torch.") in _BYTE_VIEW:
            code = "U8"
            byte_views[name] = str(t.dtype).removeprefix("torch.")
            shape = shape + [t.element_size()]
        else:
            raise UnsupportedDtypeError(f"tensor {name!r} has dtype {t.dtype}, which statekit cannot store")
        planned.append(_Planned(name, t, code, shape, t.numel() * t.element_size()))
    return planned, aliases, byte_views


def build_header(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> tuple[bytes, list[_Planned]]:
    """Build the safetensors header for ``tensors`` (no data is touched).

    Args:
        tensors: ``name -> tensor`` (any device, any strides).
        metadata: extra ``__metadata__`` entries (str -> str).

    Returns:
        ``(header_bytes, plan)``: the 8-byte length + padded JSON, and the write plan.

    Raises:
        UnsupportedDtypeError: a tensor's dtype or layout cannot be stored; names the key.
    """
    planned, aliases, byte_views = _plan(tensors)
    header: dict[str, Any] = {}
    meta = {"format": "pt", **(metadata or {})}
    if aliases:
        meta["statekit.aliases"] = json.dumps(aliases, separators=(",", ":"))
    if byte_views:
        meta["statekit.dtypes"] = json.dumps(byte_views, separators=(",", ":"))
    header["__metadata__"] = meta
    offset = 0
    for p in planned:
        header[p.name] = {"dtype": p.code, "shape": p.shape, "data_offsets": [offset, offset + p.nbytes]}
        offset += p.nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, planned


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A read-only byte view of one tensor's data on the CPU (copies only if it must:
    another device, non-contiguous, conjugate or negative bit set)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.resolve_conj().resolve_neg().contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def write_tensors(
    f: BinaryIO,
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str] | None = None,
    hasher: Any = None,
) -> int:
    """Stream ``tensors`` to ``f`` as a safetensors file, one tensor (chunk) at a time.

    Peak extra memory is one chunk, or one tensor when it must be copied to the CPU or
    made contiguous; no serialised copy of the whole file is built.

    Args:
        f: a binary file open for writing (local file or fsspec file).
        tensors: ``name -> tensor``. Identical views of one storage (tied weights) are
            stored once and listed in ``__metadata__["statekit.aliases"]``.
        metadata: extra ``__metadata__`` entries (str -> str).
        hasher: an :func:`new_hasher` updated with every byte written, or None.

    Returns:
        The file size in bytes.

    Raises:
        UnsupportedDtypeError: a tensor cannot be stored (names the key).
    """
    header, planned = build_header(tensors, metadata)
    preallocate = getattr(f, "preallocate", None)  # statekit.storage.DirectWriter: contiguous extents
    if callable(preallocate):
        preallocate(len(header) + sum(p.nbytes for p in planned))
    f.write(header)
    if hasher is not None:
        hasher.update(header)
    size = len(header)
    for p in planned:
        view = tensor_bytes(p.tensor)
        for start in range(0, len(view), CHUNK_BYTES):
            chunk = view[start : start + CHUNK_BYTES]
            f.write(chunk)
            if hasher is not None:
                hasher.update(chunk)
        size += len(view)
    return size


# --------------------------------------------------------------------------- reading


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

    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{source}: malformed safetensors header: {why}", path=source)

    if len(prefix) != 8:
        raise bad(f"file is {len(prefix)} bytes, shorter than the 8-byte length prefix")
    (n,) = struct.unpack("<Q", prefix)
    if n > MAX_HEADER_BYTES or (file_size is not None and 8 + n > file_size):
        raise bad(f"header length {n} does not fit the file ({file_size} bytes)")
    raw = read_more(n)
    if len(raw) != n:
        raise bad(f"header truncated ({len(raw)} of {n} bytes)")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad(f"not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise bad("top level is not an object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise bad("__metadata__ is not a str -> str object")
    try:
        aliases = json.loads(metadata.get("statekit.aliases", "{}"))
        byte_views = json.loads(metadata.get("statekit.dtypes", "{}"))
    except json.JSONDecodeError as exc:
        raise bad(f"statekit metadata is not JSON ({exc})") from None
    if not isinstance(aliases, dict) or not isinstance(byte_views, dict):
        raise bad("statekit metadata is not an object")
    entries = []
    for name, info in header.items():
        try:
            code, stored_shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise bad(f"entry {name!r} lacks dtype/shape/data_offsets") from None
        if code not in _FROM_CODE:
            raise bad(f"entry {name!r} has unknown dtype {code!r}")
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in stored_shape) or not all(
            isinstance(o, int) and not isinstance(o, bool) for o in (begin, end)
        ):
            raise bad(f"entry {name!r} has a malformed shape or offsets")
        numel = 1
        for d in stored_shape:
            numel *= d
        if end - begin != numel * _ITEMSIZE[code] or begin < 0:
            raise bad(f"entry {name!r}: offsets [{begin}, {end}] do not match shape {list(stored_shape)} {code}")
        dtype, shape = _FROM_CODE[code], stored_shape
        if name in byte_views:
            dtype = _BYTE_VIEW.get(byte_views[name])  # type: ignore[assignment]
            if dtype is None or code != "U8" or not stored_shape or stored_shape[-1] != dtype.itemsize:
                raise bad(f"entry {name!r} has unknown stored dtype {byte_views[name]!r} or a wrong item size")
            shape = stored_shape[:-1]
        entries.append(TensorEntry(name, dtype, shape, code, stored_shape, begin, end))
    entries.sort(key=lambda e: (e.begin, e.end))
    position = 0
    for e in entries:
        if e.begin != position:
            raise bad(f"entry {e.name!r} starts at {e.begin}, expected {position} (gap or overlap)")
        position = e.end
    for alias, target in aliases.items():
        if not isinstance(target, str) or target not in header or alias in header:
            raise bad(f"alias {alias!r} -> {target!r} does not name a stored tensor")
    data_start = 8 + n
    if file_size is not None and data_start + position != file_size:
        raise bad(f"data section is {file_size - data_start} bytes, header describes {position}")
    return TensorHeader(tuple(entries), dict(aliases), dict(metadata), data_start, position), raw


def read_tensors(
    f: BinaryIO,
    source: str,
    file_size: int | None = None,
    *,
    into: Mapping[str, torch.Tensor] | None = None,
    names: Iterable[str] | None = None,
    hasher: Any = None,
) -> tuple[dict[str, torch.Tensor], TensorHeader]:
    """Read a safetensors file sequentially, optionally straight into existing tensors.

    Args:
        f: a binary file open for reading at offset 0.
        source: its URL, named in errors.
        file_size: its size in bytes if known (validates the data section).
        into: ``name -> tensor`` to fill in place. A CPU, contiguous target of the same
            dtype and shape receives the bytes directly (no intermediate copy); any other
            target is filled with ``copy_`` from a one-tensor buffer.
        names: read only these names (others are skipped with ``seek``); all if None.
            Ignored when ``hasher`` is given, which needs every byte.
        hasher: updated with every byte of the file (for checksum verification).

    Returns:
        ``(tensors, header)``: ``tensors`` maps every (selected) name, aliases included, to
        a CPU tensor, or to the ``into`` target that was filled.

    Raises:
        CorruptCheckpointError: malformed header or truncated data; names ``source``.
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
    wanted = None if names is None or hasher is not None else set(names)
    if wanted is not None:
        wanted |= {header.aliases[a] for a in wanted if a in header.aliases}
    out: dict[str, torch.Tensor] = {}
    position = 0
    for e in header.entries:
        if wanted is not None and e.name not in wanted:
            continue
        if e.begin != position:
            f.seek(header.data_start + e.begin)
            position = e.begin
        target = into.get(e.name) if into is not None else None
        out[e.name] = _read_one(f, e, target, source, hasher)
        position = e.end
    for alias, name in header.aliases.items():
        if name in out and (wanted is None or alias in wanted or name in wanted):
            target = into.get(alias) if into is not None else None
            if target is not None and target is not out[name]:
                with torch.no_grad():
                    target.copy_(out[name])
                out[alias] = target
            else:
                out[alias] = out[name]
    return out, header


def _read_one(f: BinaryIO, e: TensorEntry, target: torch.Tensor | None, source: str, hasher: Any) -> torch.Tensor:
    direct = (
        target is not None
        and e.dtype in _NATIVE
        and target.device.type == "cpu"
        and target.dtype == e.dtype
        and tuple(target.shape) == e.shape
        and target.is_contiguous()
    )
    buffer = target.detach() if direct and target is not None else torch.empty(e.stored_shape, dtype=_FROM_CODE[e.code])
    nbytes = e.end - e.begin
    if nbytes:
        view = memoryview(buffer.reshape(-1).view(torch.uint8).numpy())
        _readinto(f, view, source, e.name)
        if hasher is not None:
            hasher.update(view)
    if direct:
        return target  # type: ignore[return-value]
    result = buffer.view(e.dtype).reshape(e.shape) if e.dtype not in _NATIVE else buffer
    if target is not None:
        with torch.no_grad():
            target.copy_(result)
        return target
    return result


def _readinto(f: BinaryIO, view: memoryview, source: str, name: str) -> None:
    done, total = 0, len(view)
    readinto = getattr(f, "readinto", None)
    while done < total:
        want = min(CHUNK_BYTES, total - done)
        if readinto is not None:
            got = readinto(view[done : done + want])
        else:
            data = f.read(want)
            got = len(data)
            view[done : done + got] = data
        if not got:
            raise CorruptCheckpointError(f"{source}: truncated while reading tensor {name!r}", path=source)
        done += got


# --------------------------------------------------------------------------- manifest


def check_relpath(path: str, source: str = "manifest", error: type[Exception] = CorruptCheckpointError) -> str:
    """Validate a checkpoint-relative path: no scheme, no absolute path, no ``..``.

    Args:
        path: the relative path.
        source: what holds it (a manifest URL), named in the error.
        error: the error class to raise (writers pass a plain ``StatekitError``: a bad
            path given to a writer is a caller bug, not a corrupt checkpoint).

    Returns:
        ``path`` unchanged.

    Raises:
        CorruptCheckpointError: the path escapes the checkpoint or is malformed.
    """
    parts = path.split("/") if isinstance(path, str) else []
    if (
        not parts
        or "://" in path
        or path.startswith("/")
        or "\\" in path
        or any(p in ("", ".", "..") for p in parts)
    ):
        message = f"{source}: invalid relative path {path!r} (must stay inside the checkpoint)"
        raise error(message, path=source) if error is CorruptCheckpointError else error(message)
    return path


def validate_manifest(manifest: Any, source: str) -> dict[str, Any]:
    """Check a parsed manifest against format version 1 (see ``docs/format.md``).

    Args:
        manifest: the parsed JSON.
        source: the manifest's URL, named in errors.

    Returns:
        The manifest, unchanged.

    Raises:
        FormatVersionError: ``format`` is not ``statekit/1`` (a newer or foreign format).
        CorruptCheckpointError: a required field is missing or has the wrong type.
    """
    if not isinstance(manifest, dict):
        raise CorruptCheckpointError(f"{source}: manifest is not a JSON object", path=source)
    fmt = manifest.get("format")
    if fmt != FORMAT:
        if isinstance(fmt, str) and fmt.startswith("statekit/"):
            raise FormatVersionError(
                f"{source}: checkpoint format {fmt!r} is not supported by this statekit (reads {FORMAT!r}); upgrade statekit"
            )
        raise CorruptCheckpointError(f"{source}: not a statekit manifest (format={fmt!r})", path=source)
    expected = {
        "statekit_version": str,
        "created": str,
        "world_size": int,
        "plugins": dict,
        "objects": dict,
        "files": dict,
        "metadata": dict,
        "records": dict,
    }
    for key, typ in expected.items():
        if not isinstance(manifest.get(key), typ) or isinstance(manifest.get(key), bool):
            raise CorruptCheckpointError(f"{source}: manifest field {key!r} missing or not {typ.__name__}", path=source)
    if manifest.get("step") is not None and (not isinstance(manifest["step"], int) or isinstance(manifest["step"], bool)):
        raise CorruptCheckpointError(f"{source}: manifest field 'step' is not an integer", path=source)
    for path, entry in manifest["files"].items():
        check_relpath(path, source)
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("size_bytes"), int)
            or not isinstance(entry.get("checksum"), str)
            or not isinstance(entry.get("rank"), int)
        ):
            raise CorruptCheckpointError(f"{source}: manifest entry for file {path!r} is malformed", path=source)
    for key, obj in manifest["objects"].items():
        if not isinstance(obj, dict) or not isinstance(obj.get("kind"), str) or not isinstance(obj.get("owner"), str):
            raise CorruptCheckpointError(f"{source}: manifest entry for object {key!r} is malformed", path=source)
    return manifest
