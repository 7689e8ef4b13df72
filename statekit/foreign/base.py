"""What every checkpoint reader shares: :class:`TensorInfo`, :class:`CheckpointReader`,
safetensors access (one header read per file through :func:`statekit.format.read_header`,
one tensor by a ranged read); and what a load of a foreign folder returns (:class:`ForeignSummary`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch

from statekit import format as fmt
from statekit.engine.entries import strip_wrapper_prefixes
from statekit.errors import CorruptCheckpointError
from statekit.storage import Storage


@dataclass(frozen=True)
class ForeignObject:
    """One object a load of a folder statekit did not write restored.

    Attributes:
        kind: ``"model"``, ``"optimizer"``, ``"scheduler"``, ``"dataloader"``...
        file: the file it was read from, relative to the folder; None when a plugin loaded it.
        owner: the plugin whose load pre-hook took it, or None.
    """

    kind: str
    file: str | None = None
    owner: str | None = None


@dataclass(frozen=True)
class ForeignSummary:
    """What :func:`statekit.load`/:func:`statekit.load_state` return for a folder statekit
    did not write (``Accelerator.save_state``'s), in place of a :class:`~statekit.Manifest`.

    Attributes:
        format: the folder's format (``"accelerate"``).
        step: Accelerate's ``step`` counter from its random states (optimizer steps under
            ``accumulate()``, else 0; not the ``checkpoint_<n>`` number); None without them.
        objects: the caller's key -> :class:`ForeignObject`, for every object restored.
    """

    format: str
    step: int | None
    objects: Mapping[str, ForeignObject]


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a checkpoint, as listed from metadata (no data read).

    Attributes:
        name: the tensor's name inside its file (``"fc1.weight"``).
        dtype: the torch dtype name (``"float32"``).
        shape: the shape.
        size_bytes: ``numel * itemsize``, bytes.
        file: the file holding it, relative to the checkpoint (a single file: its name; DCP:
            the ``.distcp`` files, comma-separated).
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


def tensor_infos(tensors: Mapping[str, torch.Tensor], file: str) -> list[TensorInfo]:
    """:class:`TensorInfo` of in-memory ``name -> tensor`` (unpickled files) held in ``file``, in mapping order."""
    return [TensorInfo(n, fmt.dtype_name(t.dtype), tuple(t.shape), t.numel() * t.element_size(), file)
            for n, t in tensors.items()]


_DESCRIPTIONS = {
    "statekit": "a statekit checkpoint",
    "incomplete": "an incomplete statekit save (never committed)",
    "trainer": "a transformers Trainer checkpoint",
    "accelerate": "an Accelerate save_state folder",
    "dcp": "a torch.distributed.checkpoint (DCP) directory",
    "safetensors": "a safetensors file",
    "torch": "a torch.save file",
    "unknown": "a folder statekit cannot name",
}


def describe_kind(kind: str) -> str:
    """A format (:data:`statekit.foreign.FORMATS`) or folder kind (:data:`statekit.foreign.detect.FOLDER_KINDS`)
    in words (``"a transformers Trainer checkpoint"``); an unknown name is returned as it is."""
    return _DESCRIPTIONS.get(kind, kind)


def basename(url: str) -> str:
    """The last component of a URL or path (``"m.safetensors"``)."""
    return url.rstrip("/").rsplit("/", 1)[-1]


def _stripped_names(names: Iterable[str]) -> dict[str, str]:
    """``listed name -> stored name``, the model wrapper prefixes removed from the listed names."""
    stored = list(names)
    return dict(zip(strip_wrapper_prefixes(dict.fromkeys(stored)), stored))


class CheckpointReader:
    """A checkpoint opened for inspection. Build one with :func:`statekit.foreign.open_checkpoint`.

    Attributes:
        url: the checkpoint's URL.
        format: one of :data:`statekit.foreign.FORMATS`.
        keyed_by_file: directory formats with several tensor files (statekit, accelerate) key
            tensors ``"file:tensor"``; others by tensor name.
        skipped: files not read (pickle files without ``allow_pickle``).
        superseded: files not read because a load takes their state from another file (an
            attach-mode directory's ``random_states_<r>.pkl`` next to statekit-rng's ``rng/``).
        layout: ``"accelerate"`` for a directory an attached accelerator wrote, else the format.
        metadata: format-specific facts (the statekit manifest, the DCP step...), JSON-able.
    """

    format = ""
    keyed_by_file = False

    def __init__(self, storage: Storage, allow_pickle: bool) -> None:
        self.storage = storage
        self.url = storage.url
        self.allow_pickle = allow_pickle
        self.skipped: list[str] = []
        self.superseded: list[str] = []
        self.layout = self.format
        self.metadata: dict[str, Any] = {}
        self._tensors: dict[str, TensorInfo] | None = None
        self._headers: dict[str, fmt.TensorHeader] = {}
        self._renamed: dict[str, dict[str, str]] = {}  # rel -> {listed name: stored name}

    def key(self, info: TensorInfo) -> str:
        """The key of a tensor in :meth:`tensors` (``"file:tensor"`` or ``"tensor"``)."""
        return f"{info.file}:{info.name}" if self.keyed_by_file else info.name

    def match_key(self, key: str) -> str:
        """The key :func:`statekit.foreign.diff` matches ``key`` on against a checkpoint of another
        format (the key itself here; an Accelerate directory names its files as statekit does)."""
        return key

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
        """A JSON-able description: url, format, description (the format in words), layout, files,
        tensor count and bytes, skipped and superseded files."""
        tensors = self.tensors()
        files = self.files()
        return {
            "url": self.url,
            "format": self.format,
            "description": describe_kind(self.format),
            "files": files,
            "size_bytes": sum(files.values()),
            "tensor_count": len(tensors),
            "tensor_bytes": sum(i.size_bytes for i in tensors.values()),
            "skipped": list(self.skipped),
            "superseded": list(self.superseded),
            "layout": self.layout,
            "metadata": self.metadata,
        }

    # --------------------------------------------------------- safetensors files

    def header(self, rel: str) -> fmt.TensorHeader:
        """The parsed header of one safetensors file ``rel`` (``""`` for a single file), cached.

        Raises:
            CorruptCheckpointError: the header is malformed (names the file).
        """
        if rel not in self._headers:
            with self.storage.open_read(rel) as f:
                self._headers[rel] = fmt.read_header(f, self.storage.url_of(rel), self.storage.size(rel))
        return self._headers[rel]

    def _safetensors_infos(self, rel: str, model: bool = False) -> list[TensorInfo]:
        """The tensors of one safetensors file; for a model state dict (``model``), named
        without the wrapper prefixes (``_orig_mod.``, ``module.``) Accelerate keeps."""
        header = self.header(rel)
        label = rel or basename(self.url)
        by_name = {e.name: e for e in header.entries}
        stored = [(e.name, e) for e in header.entries] + [(a, by_name[t]) for a, t in header.aliases.items()]
        listed = list(_stripped_names(n for n, _ in stored)) if model else [n for n, _ in stored]
        if model:
            self._renamed[rel] = dict(zip(listed, (n for n, _ in stored)))
        return [TensorInfo(name, fmt.dtype_name(e.dtype), tuple(e.shape), e.end - e.begin, label)
                for name, (_, e) in zip(listed, stored)]

    def _safetensors_load(self, rel: str, name: str) -> torch.Tensor:
        """Read one tensor: seek to its offsets and read only its bytes (a ranged read remotely)."""
        header = self.header(rel)
        name = self._renamed.get(rel, {}).get(name, name)
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
