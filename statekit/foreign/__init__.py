"""Read-only access to checkpoints of several formats, for inspection and diffs.

Formats (detected automatically by :func:`detect_format`):

- ``statekit``: a directory with ``statekit.json`` (the manifest); tensors are listed
  from the safetensors headers of every file in the manifest.
- ``accelerate``: a directory written by ``Accelerator.save_state`` (file names as in
  :mod:`statekit.foreign.accelerate`); ``model*.safetensors`` headers are read directly,
  the pickle files (``optimizer.bin``, ``pytorch_model.bin``...) only with ``allow_pickle``
  (without it they are listed in :attr:`CheckpointReader.skipped`).
- ``dcp``: a ``torch.distributed.checkpoint`` directory (``.metadata`` + ``*.distcp``).
  ``.metadata`` is a pickle: it is read only with ``allow_pickle`` (locally through
  ``torch.distributed.checkpoint.FileSystemReader(path).read_metadata()``); tensor
  chunks are read with ranged reads at the offsets the metadata gives and assembled.
- ``safetensors``: one safetensors file (https://github.com/huggingface/safetensors#format);
  the header gives the listing, one tensor is read by seeking to its offsets.
- ``torch``: one ``torch.save`` file (``.pt``/``.bin``/``.pth``), pickle: only with
  ``allow_pickle`` (``torch.load(weights_only=True, mmap=True)`` locally, the full
  unpickler only where the restricted one refuses the file).

Any location is an fsspec URL (local path, ``memory://``, ``s3://``...). Listing reads
metadata only; :meth:`CheckpointReader.load_tensor` reads one tensor.
"""

from __future__ import annotations

import io
import math
import pickle
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch

from statekit import format as fmt
from statekit.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    PickleNotAllowedError,
    StatekitError,
)
from statekit.storage import Storage

FORMATS = ("statekit", "accelerate", "dcp", "safetensors", "torch")
"""Names returned by :func:`detect_format`."""

_ACCELERATE_FILE = re.compile(
    r"^(model(_\d+)?\.safetensors|pytorch_model(_\d+)?\.bin|optimizer(_\d+)?\.bin|scheduler(_\d+)?\.bin|"
    r"sampler(_\d+)?\.bin|dl_state_dict(_\d+)?\.bin|scaler\.pt|random_states_\d+\.pkl|custom_checkpoint_\d+\.pkl)$"
)
_DCP_METADATA = ".metadata"


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a checkpoint, as listed from metadata (no data read).

    Attributes:
        name: the tensor's name inside its file (``"fc1.weight"``, ``"state.0.exp_avg"``).
        dtype: the torch dtype name (``"float32"``).
        shape: the shape.
        size_bytes: ``numel * itemsize``, bytes.
        file: the file holding it, relative to the checkpoint (for a single-file
            checkpoint, the file name; for DCP, the ``.distcp`` file(s), comma-separated).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    size_bytes: int
    file: str

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict (``shape`` as a list)."""
        out = asdict(self)
        out["shape"] = list(self.shape)
        return out


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class CheckpointReader:
    """A checkpoint opened for inspection. Build one with :func:`open_checkpoint`.

    Attributes:
        url: the checkpoint's URL.
        format: one of :data:`FORMATS`.
        keyed_by_file: True for directory formats with several tensor files
            (statekit, accelerate): keys are ``"file:tensor"``; else keys are tensor names.
        skipped: files that were not read (pickle files without ``allow_pickle``).
        metadata: format-specific facts (the statekit manifest, the DCP step...), JSON-able.
    """

    format = ""
    keyed_by_file = False

    def __init__(self, storage: Storage, allow_pickle: bool) -> None:
        self.storage = storage
        self.url = storage.url
        self.allow_pickle = allow_pickle
        self.skipped: list[str] = []
        self.metadata: dict[str, Any] = {}
        self._tensors: dict[str, TensorInfo] | None = None

    def key(self, info: TensorInfo) -> str:
        """The key of a tensor in :meth:`tensors` (``"file:tensor"`` or ``"tensor"``)."""
        return f"{info.file}:{info.name}" if self.keyed_by_file else info.name

    def tensors(self) -> dict[str, TensorInfo]:
        """Every tensor, keyed as :meth:`key`, in file then data order (metadata only).

        Raises:
            CorruptCheckpointError: a header or metadata file is malformed (names it).
        """
        if self._tensors is None:
            self._tensors = {self.key(i): i for i in self._list()}
        return self._tensors

    def files(self) -> dict[str, int]:
        """``relative path -> size in bytes`` of the checkpoint's files."""
        return {rel: self.storage.size(rel) for rel in self.storage.find()}

    def total_bytes(self) -> int:
        """Sum of :meth:`files` sizes, bytes."""
        return sum(self.files().values())

    def load_tensor(self, key: str) -> torch.Tensor:
        """Read one tensor (CPU), and only it where the format allows ranged reads.

        Args:
            key: a key of :meth:`tensors`; a bare tensor name is accepted when unique.

        Returns:
            The tensor.

        Raises:
            KeyError: no such tensor.
            PickleNotAllowedError: the tensor lives in a pickle file and not ``allow_pickle``.
        """
        return self._load(self._info(key))

    def _info(self, key: str) -> TensorInfo:
        tensors = self.tensors()
        if key in tensors:
            return tensors[key]
        matches = [i for i in tensors.values() if i.name == key]
        if len(matches) == 1:
            return matches[0]
        raise KeyError(f"{self.url}: no tensor {key!r}" + (" (ambiguous: give file:tensor)" if matches else ""))

    def _list(self) -> list[TensorInfo]:  # pragma: no cover - abstract
        raise NotImplementedError

    def _load(self, info: TensorInfo) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def summary(self) -> dict[str, Any]:
        """A JSON-able description: url, format, files, tensor count and bytes, skipped files."""
        tensors = self.tensors()
        files = self.files()
        return {
            "url": self.url,
            "format": self.format,
            "files": files,
            "size_bytes": sum(files.values()),
            "tensor_count": len(tensors),
            "tensor_bytes": sum(i.size_bytes for i in tensors.values()),
            "skipped": list(self.skipped),
            "metadata": self.metadata,
        }

    # --------------------------------------------------------- shared helpers

    def _header(self, rel: str) -> fmt.TensorHeader:
        """The parsed header of a safetensors file (cached: a diff reads many tensors of one file)."""
        cache = self.__dict__.setdefault("_headers", {})
        if rel not in cache:
            cache[rel] = _read_header(self.storage, rel)
        return cache[rel]

    def _safetensors_infos(self, rel: str) -> list[TensorInfo]:
        header = self._header(rel)
        infos = [TensorInfo(e.name, _dtype_name(e.dtype), tuple(e.shape), e.end - e.begin, rel or _basename(self.url))
                 for e in header.entries]
        by_name = {e.name: e for e in header.entries}
        for alias, target in header.aliases.items():
            e = by_name[target]
            infos.append(TensorInfo(alias, _dtype_name(e.dtype), tuple(e.shape), e.end - e.begin, rel or _basename(self.url)))
        return infos

    def _safetensors_load(self, rel: str, name: str) -> torch.Tensor:
        """Read one tensor: seek to its offsets and read only its bytes (a ranged read remotely)."""
        header = self._header(rel)
        name = header.aliases.get(name, name)
        entry = next(e for e in header.entries if e.name == name)
        stored = entry.dtype if tuple(entry.shape) == tuple(entry.stored_shape) else torch.uint8  # byte views: U8
        buffer = torch.empty(entry.stored_shape, dtype=stored)
        nbytes = entry.end - entry.begin
        if nbytes:
            url = self.storage.url_of(rel)
            with self.storage.open_read(rel) as f:
                f.seek(header.data_start + entry.begin)
                view = memoryview(buffer.reshape(-1).view(torch.uint8).numpy())
                done = 0
                while done < nbytes:
                    data = f.read(min(fmt.CHUNK_BYTES, nbytes - done))
                    if not data:
                        raise CorruptCheckpointError(f"{url}: truncated while reading tensor {name!r}", path=url)
                    view[done : done + len(data)] = data
                    done += len(data)
        return buffer if stored == entry.dtype else buffer.view(entry.dtype).reshape(entry.shape)


def _basename(url: str) -> str:
    return url.rstrip("/").rsplit("/", 1)[-1]


def _read_header(storage: Storage, rel: str) -> fmt.TensorHeader:
    with storage.open_read(rel) as f:
        header, _ = fmt.parse_header(f.read(8), f.read, storage.size(rel), storage.url_of(rel))
    return header


# --------------------------------------------------------------------------- torch pickles


def _flatten(value: Any, prefix: str, out: dict[str, torch.Tensor]) -> None:
    """Collect the tensors of a nested state, named by dotted paths (``state.0.exp_avg``)."""
    if isinstance(value, torch.Tensor):
        out[prefix or "tensor"] = value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _flatten(v, f"{prefix}.{i}" if prefix else str(i), out)


def _load_pickle(storage: Storage, rel: str, allow_pickle: bool) -> Any:
    url = storage.url_of(rel)
    if not allow_pickle:
        raise PickleNotAllowedError(
            f"{url} is a pickle file; pickle can run arbitrary code on load, so statekit reads it only with "
            "allow_pickle=True (--allow-pickle)"
        )
    if storage.is_local:
        path = storage.path_of(rel)
        for kwargs in ({"weights_only": True, "mmap": True}, {"weights_only": True}, {"weights_only": False}):
            try:
                return torch.load(path, map_location="cpu", **kwargs)
            except (pickle.UnpicklingError, RuntimeError, ValueError):
                if kwargs["weights_only"] is False:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover
    data = storage.read_bytes(rel)
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


class _PickleFiles:
    """Lazily unpickled torch files, flattened to ``name -> tensor`` (one cache per reader)."""

    def __init__(self, storage: Storage, allow_pickle: bool) -> None:
        self.storage = storage
        self.allow_pickle = allow_pickle
        self._cache: dict[str, dict[str, torch.Tensor]] = {}

    def tensors(self, rel: str) -> dict[str, torch.Tensor]:
        if rel not in self._cache:
            flat: dict[str, torch.Tensor] = {}
            _flatten(_load_pickle(self.storage, rel, self.allow_pickle), "", flat)
            self._cache[rel] = flat
        return self._cache[rel]

    def infos(self, rel: str, file_label: str) -> list[TensorInfo]:
        return [TensorInfo(n, _dtype_name(t.dtype), tuple(t.shape), t.numel() * t.element_size(), file_label)
                for n, t in self.tensors(rel).items()]


# --------------------------------------------------------------------------- readers


class StatekitReader(CheckpointReader):
    """A committed statekit checkpoint (``statekit.json``); metadata is the manifest."""

    format = "statekit"
    keyed_by_file = True

    def __init__(self, storage: Storage, allow_pickle: bool) -> None:
        from statekit.api.saveload import read_manifest

        super().__init__(storage, allow_pickle)
        self.manifest = read_manifest(storage)
        self.metadata = self.manifest

    def files(self) -> dict[str, int]:
        """Files as listed in the manifest (plus the manifest itself is not counted)."""
        return {rel: e["size_bytes"] for rel, e in sorted(self.manifest["files"].items())}

    def _list(self) -> list[TensorInfo]:
        out: list[TensorInfo] = []
        for rel in sorted(self.manifest["files"]):
            if rel.endswith(".safetensors"):
                out += self._safetensors_infos(rel)
        return out

    def _load(self, info: TensorInfo) -> torch.Tensor:
        return self._safetensors_load(info.file, info.name)


class AccelerateReader(CheckpointReader):
    """A directory written by ``Accelerator.save_state``."""

    format = "accelerate"
    keyed_by_file = True

    def __init__(self, storage: Storage, allow_pickle: bool) -> None:
        super().__init__(storage, allow_pickle)
        self._names = [n for n in storage.listdir() if _ACCELERATE_FILE.match(n)]
        self._pickles = _PickleFiles(storage, allow_pickle)
        if not allow_pickle:
            self.skipped = [n for n in self._names if not n.endswith(".safetensors")]

    def _list(self) -> list[TensorInfo]:
        out: list[TensorInfo] = []
        for rel in self._names:
            if rel.endswith(".safetensors"):
                out += self._safetensors_infos(rel)
            elif self.allow_pickle:
                out += self._pickles.infos(rel, rel)
        return out

    def _load(self, info: TensorInfo) -> torch.Tensor:
        if info.file.endswith(".safetensors"):
            return self._safetensors_load(info.file, info.name)
        return self._pickles.tensors(info.file)[info.name]


class SafetensorsReader(CheckpointReader):
    """One safetensors file; metadata is its ``__metadata__``."""

    format = "safetensors"

    def __init__(self, storage: Storage, allow_pickle: bool) -> None:
        super().__init__(storage, allow_pickle)
        self.metadata = dict(self._header("").metadata)

    def files(self) -> dict[str, int]:
        """The file itself."""
        return {_basename(self.url): self.storage.size("")}

    def _list(self) -> list[TensorInfo]:
        return self._safetensors_infos("")

    def _load(self, info: TensorInfo) -> torch.Tensor:
        return self._safetensors_load("", info.name)


class TorchReader(CheckpointReader):
    """One ``torch.save`` file (pickle: only with ``allow_pickle``)."""

    format = "torch"

    def __init__(self, storage: Storage, allow_pickle: bool) -> None:
        super().__init__(storage, allow_pickle)
        self._pickles = _PickleFiles(storage, allow_pickle)
        self._pickles.tensors("")  # raises PickleNotAllowedError before anything else

    def files(self) -> dict[str, int]:
        """The file itself."""
        return {_basename(self.url): self.storage.size("")}

    def _list(self) -> list[TensorInfo]:
        return self._pickles.infos("", _basename(self.url))

    def _load(self, info: TensorInfo) -> torch.Tensor:
        return self._pickles.tensors("")[info.name]


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
        url = storage.url_of(_DCP_METADATA)
        if not allow_pickle:
            raise PickleNotAllowedError(
                f"{url} is a pickle file (DCP metadata); pickle can run arbitrary code on load, so statekit reads it "
                "only with allow_pickle=True (--allow-pickle)"
            )
        try:
            if storage.is_local:
                from torch.distributed.checkpoint import FileSystemReader

                self._md = FileSystemReader(storage.path).read_metadata()
            else:  # what FileSystemReader.read_metadata does: pickle.load of the file
                self._md = pickle.loads(storage.read_bytes(_DCP_METADATA))  # noqa: S301 - allowed by the caller
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
            out.append(TensorInfo(fqn, _dtype_name(dtype), shape, math.prod(shape) * _itemsize(dtype), files))
        return out

    def _load(self, info: TensorInfo) -> torch.Tensor:
        meta = self._md.state_dict_metadata[info.name]
        dtype = meta.properties.dtype
        out = torch.empty(tuple(meta.size), dtype=dtype)
        for idx, stored in self._chunks(info.name):
            # the chunk is the one at the index's offsets (MetadataIndex.index is only a lookup hint)
            chunk_meta = next((c for c in meta.chunks if tuple(c.offsets) == tuple(idx.offset or ())), None)
            if chunk_meta is None:
                url = self.storage.url_of(_DCP_METADATA)
                raise CorruptCheckpointError(f"{url}: no chunk of {info.name!r} at offsets {idx.offset}", path=url)
            sizes, offsets = tuple(chunk_meta.sizes), tuple(chunk_meta.offsets)
            if getattr(stored, "transform_descriptors", None):
                raise StatekitError(
                    f"{self.storage.url_of(stored.relative_path)}: tensor {info.name!r} is stored with transforms "
                    f"{stored.transform_descriptors}, which statekit does not read"
                )
            with self.storage.open_read(stored.relative_path) as f:
                f.seek(stored.offset)
                data = f.read(stored.length)
            raw = math.prod(sizes) * _itemsize(dtype)
            if len(data) != stored.length:
                url = self.storage.url_of(stored.relative_path)
                raise CorruptCheckpointError(f"{url}: truncated while reading tensor {info.name!r}", path=url)
            if stored.length == raw and data[:2] != b"PK":
                chunk = torch.frombuffer(bytearray(data), dtype=dtype).reshape(sizes) if raw else torch.empty(sizes, dtype=dtype)
            else:
                chunk = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            region = out
            for dim, (o, s) in enumerate(zip(offsets, sizes)):
                region = region.narrow(dim, o, s)
            region.copy_(chunk.reshape(sizes))
        return out


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


_READERS: dict[str, type[CheckpointReader]] = {
    "statekit": StatekitReader,
    "accelerate": AccelerateReader,
    "dcp": DCPReader,
    "safetensors": SafetensorsReader,
    "torch": TorchReader,
}


# --------------------------------------------------------------------------- detection


def _is_file(storage: Storage) -> bool:
    try:
        return bool(storage.fs.isfile(storage.path))
    except Exception:  # noqa: BLE001 - a backend that cannot tell is treated as a directory
        return False


def _sniff_file(storage: Storage) -> str:
    with storage.open_read("") as f:
        head = f.read(16)
    if len(head) >= 9 and head[8:9] == b"{":  # before the pickle check: a header length may start with 0x80
        return "safetensors"
    if head[:4] == b"PK\x03\x04" or (head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")):
        return "torch"
    name = _basename(storage.url).lower()
    if name.endswith(".safetensors"):
        return "safetensors"
    if name.endswith((".pt", ".pth", ".bin", ".ckpt")):
        return "torch"
    raise StatekitError(f"{storage.url}: not a safetensors or torch file (unrecognized content)")


def detect_format(url: str, storage_options: dict[str, Any] | None = None) -> str:
    """Name the format of the checkpoint at ``url`` (one of :data:`FORMATS`).

    A file is sniffed by content (zip or pickle magic: ``torch``; an 8-byte length then
    ``{``: ``safetensors``), then by extension. A directory is ``statekit`` if it has
    ``statekit.json``, ``dcp`` if it has ``.metadata``, ``accelerate`` if it has files
    named as ``Accelerator.save_state`` names them. Nothing is unpickled.

    Args:
        url: file or directory URL.
        storage_options: fsspec options.

    Returns:
        The format name.

    Raises:
        CheckpointNotFoundError: nothing exists at ``url``.
        IncompleteCheckpointError: a directory of statekit files without a manifest.
        StatekitError: the location is not a checkpoint of a known format.
    """
    return _detect(Storage(url, storage_options))


def _detect(storage: Storage) -> str:
    storage.invalidate()
    if _is_file(storage):
        return _sniff_file(storage)
    names = storage.listdir()
    if not names:
        if storage.exists():
            raise IncompleteCheckpointError(
                f"{storage.url} is an empty directory: no {fmt.MANIFEST_NAME} (a save that never committed), not a checkpoint"
            )
        raise CheckpointNotFoundError(f"no checkpoint at {storage.url}")
    if fmt.MANIFEST_NAME in names:
        return "statekit"
    if _DCP_METADATA in names:
        return "dcp"
    accelerate = [n for n in names if _ACCELERATE_FILE.match(n)]
    # save_state always writes random_states_<rank>.pkl; a lone model.safetensors next to
    # statekit's .json files is an uncommitted statekit save, not an Accelerate directory
    if any(not n.endswith(".safetensors") for n in accelerate) or (accelerate and not any(n.endswith(".json") for n in names)):
        return "accelerate"
    if any(n.endswith((".safetensors", ".json")) for n in names):
        raise IncompleteCheckpointError(
            f"{storage.url} has no {fmt.MANIFEST_NAME}: an incomplete statekit save (never committed), "
            "or not a checkpoint"
        )
    if any(re.match(r"^checkpoint-\d+$", n) for n in names):
        raise StatekitError(f"{storage.url} is a checkpoint root, not a checkpoint: list it with `statekit ls`")
    raise StatekitError(
        f"{storage.url} is not a checkpoint statekit can read (no statekit.json, DCP .metadata, "
        "Accelerate files; not a safetensors or torch file)"
    )


def open_checkpoint(
    url: str, *, allow_pickle: bool = False, storage_options: dict[str, Any] | None = None, format: str | None = None
) -> CheckpointReader:
    """Open a checkpoint of any supported format for inspection (metadata first).

    Args:
        url: file or directory URL (any fsspec URL).
        allow_pickle: permit unpickling (DCP ``.metadata``, torch files, Accelerate
            ``.bin``/``.pkl`` files). Pickle can run arbitrary code: only for trusted files.
        storage_options: fsspec options.
        format: skip detection and use this format (one of :data:`FORMATS`).

    Returns:
        A :class:`CheckpointReader`.

    Raises:
        PickleNotAllowedError: the format needs pickle (DCP, torch file) and not
            ``allow_pickle``; names the file.
        CheckpointNotFoundError, IncompleteCheckpointError, StatekitError: as
            :func:`detect_format`.
        CorruptCheckpointError: malformed metadata (names the file).
    """
    storage = Storage(url, storage_options)
    name = format or _detect(storage)
    if name not in _READERS:
        raise StatekitError(f"unknown checkpoint format {name!r}; known: {', '.join(FORMATS)}")
    return _READERS[name](storage, allow_pickle)


# --------------------------------------------------------------------------- diff


def diff(a: CheckpointReader, b: CheckpointReader, *, advance: Any = None) -> dict[str, Any]:
    """Compare two checkpoints tensor by tensor.

    Tensors are matched by key (:meth:`CheckpointReader.key`; ``file:tensor`` for
    statekit and Accelerate directories). For every key in both with the same shape,
    the maximum absolute difference is computed from one pair of tensors at a time (in
    float64; ``inf`` where infinities differ, ``nan`` where only one side is NaN; equal
    infinities and NaN against NaN count as no difference); the two checkpoints are
    never in memory whole.

    Args:
        a: the old checkpoint.
        b: the new checkpoint.
        advance: ``callable(n_bytes)`` called after each compared pair (progress).

    Returns:
        A JSON-able dict: ``a``/``b`` (url, format, size_bytes, tensor_bytes,
        skipped), ``added``/``removed`` (lists of keys), ``changed`` (shape or dtype
        changes: ``{key, a: {dtype, shape}, b: {...}}``), ``tensors`` (per compared key:
        ``{key, dtype, shape, max_abs_diff, equal}``), ``files`` (for two directories of one
        format: files whose size differs, or whose manifest checksum differs for statekit:
        ``{file, a_bytes, b_bytes, checksum_equal}``; a missing side is None), ``size_delta_bytes``
        (``b.size_bytes - a.size_bytes``), ``identical`` (no key added, removed,
        changed, or differing in value).
    """
    ta, tb = a.tensors(), b.tensors()
    added = [k for k in tb if k not in ta]
    removed = [k for k in ta if k not in tb]
    changed, compared = [], []
    for key, ia in ta.items():
        ib = tb.get(key)
        if ib is None:
            continue
        if ia.shape != ib.shape or ia.dtype != ib.dtype:
            changed.append({"key": key, "a": {"dtype": ia.dtype, "shape": list(ia.shape)},
                            "b": {"dtype": ib.dtype, "shape": list(ib.shape)}})
        if ia.shape != ib.shape:
            continue
        x, y = a.load_tensor(key), b.load_tensor(key)
        max_abs = _max_abs_diff(x, y)
        equal = ia.dtype == ib.dtype and (torch.equal(x, y) or max_abs == 0.0)
        del x, y
        compared.append({"key": key, "dtype": ib.dtype, "shape": list(ib.shape), "max_abs_diff": max_abs, "equal": equal})
        if advance is not None:
            advance(ia.size_bytes + ib.size_bytes)
    sa, sb = a.summary(), b.summary()
    side = ("url", "format", "size_bytes", "tensor_count", "tensor_bytes", "skipped")
    sums_a = {rel: e["checksum"] for rel, e in a.metadata.get("files", {}).items()} if a.format == "statekit" else {}
    sums_b = {rel: e["checksum"] for rel, e in b.metadata.get("files", {}).items()} if b.format == "statekit" else {}
    files = []
    directories = a.format == b.format and a.format in ("statekit", "accelerate", "dcp")
    for rel in sorted(set(sa["files"]) | set(sb["files"])) if directories else []:
        size_a, size_b = sa["files"].get(rel), sb["files"].get(rel)
        same = sums_a.get(rel) == sums_b.get(rel) if rel in sums_a and rel in sums_b else None
        if size_a != size_b or same is False:
            files.append({"file": rel, "a_bytes": size_a, "b_bytes": size_b, "checksum_equal": same})
    return {
        "a": {k: sa[k] for k in side},
        "b": {k: sb[k] for k in side},
        "added": added,
        "removed": removed,
        "changed": changed,
        "tensors": compared,
        "files": files,
        "size_delta_bytes": sb["size_bytes"] - sa["size_bytes"],
        "identical": not (added or removed or changed or files or any(not t["equal"] for t in compared)),
    }


def _max_abs_diff(x: torch.Tensor, y: torch.Tensor) -> float | None:
    """max |x - y| in float64 (None for empty tensors; bool/int compared as numbers)."""
    if x.numel() == 0:
        return None
    if x.is_complex() or y.is_complex():
        d = (x.to(torch.complex128) - y.to(torch.complex128)).abs()
    else:
        xd, yd = x.to(torch.float64), y.to(torch.float64)
        d = (xd - yd).abs()
        same = (xd == yd) | (torch.isnan(xd) & torch.isnan(yd))  # inf == inf and NaN at NaN: no difference
        d = torch.where(same, torch.zeros((), dtype=torch.float64), d)
    return float(d.max().item())


__all__ = [
    "FORMATS",
    "CheckpointReader",
    "TensorInfo",
    "detect_format",
    "diff",
    "open_checkpoint",
]
