"""A pretrained folder (``save_pretrained``'s: ``*.safetensors`` files and their index) as
statekit reads it for references: which folder a model comes from (:func:`reference_pretrained`,
:func:`source_of`), its files' headers and header checksums (:class:`SourceFolder`), the
checksums of its tensors' bytes, and of a live tensor's (:func:`live_checksum`). The
references themselves: :mod:`statekit.engine.references`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import xxhash

from statekit import format as fmt
from statekit.errors import ChangedBaseError, InvalidOptionError, MissingBaseError, StorageError
from statekit.format.manifest_types import SourceFile
from statekit.storage import Storage

INDEX_NAMES = ("model.safetensors.index.json", "diffusion_pytorch_model.safetensors.index.json")
"""The sharded-folder indexes of transformers and diffusers (``weight_map``: name -> file)."""

_HASH_CHUNK = 64 * 1024**2  # bytes read at a time when checksumming a source tensor


@dataclasses.dataclass(frozen=True)
class Source:
    """Where a model's pretrained tensors are: a folder URL and its fsspec options."""

    url: str
    storage_options: dict[str, Any] | None = None
    declared: bool = False  # named by reference_pretrained (not learned): a folder that matches nothing warns


_NOT_REFERENCED = Source("")  # a model the user opted out (reference_pretrained(model, None))
_declared: weakref.WeakKeyDictionary[torch.nn.Module, Source] = weakref.WeakKeyDictionary()


def reference_pretrained(
    model: torch.nn.Module, source: str | os.PathLike[str] | None, *, storage_options: dict[str, Any] | None = None
) -> None:
    """Declare the pretrained folder ``model``'s frozen tensors come from, so that every save
    references them there instead of writing them (docs/export.md, "A frozen base is
    referenced"); None: never reference this model's tensors (opt out of what statekit
    learns from ``from_pretrained``).

    Only tensors that are frozen (``requires_grad=False`` parameters, and what shares their
    storage) and equal a tensor of the folder byte for byte, with the same dtype and shape,
    are referenced; anything else is written as usual. A model built by ``from_pretrained``
    from a local folder needs no declaration (its ``config._name_or_path`` names the folder).

    Args:
        model: the ``nn.Module`` as passed to the save (a peft or compiled wrapper is fine).
        source: a folder with ``*.safetensors`` files (and ``model.safetensors.index.json``
            when sharded): a local path or an fsspec URL (``s3://bucket/llama``); None: opt out.
        storage_options: fsspec options of ``source``'s filesystem (also used by the load).

    Raises:
        InvalidOptionError: ``model`` is not an ``nn.Module``, ``source`` an empty string, or
            a local path that is not a folder (a relative path is recorded absolute).
    """
    if not isinstance(model, torch.nn.Module):
        raise InvalidOptionError(f"reference_pretrained: model must be an nn.Module, not {type(model).__name__}")
    if source is None:
        _declared[model] = _NOT_REFERENCED
        return
    url = os.fspath(source)
    if not url:
        raise InvalidOptionError("reference_pretrained: source is an empty string; pass a folder, or None to opt out")
    if "://" not in url:  # a local path: recorded absolute, so a load from another directory finds it
        url = os.path.abspath(url)
        if not os.path.isdir(url):
            raise InvalidOptionError(f"reference_pretrained: {url} is not a folder (a pretrained folder holds "
                                     "*.safetensors files and their index)")
    _declared[model] = Source(url, storage_options, declared=True)


def source_of(models: Iterable[torch.nn.Module]) -> Source | None:
    """The pretrained folder of the first of ``models`` (the model as passed, then what it
    wraps) that declares or learned one: :func:`reference_pretrained`, else the local
    folder ``from_pretrained`` recorded in ``config._name_or_path`` (transformers,
    diffusers, peft's base model) when it holds safetensors files, or its one subfolder whose
    config names the model's class (a pipeline's ``unet``, ``text_encoder``); None when none
    does."""
    for m in models:
        declared = _declared.get(m)
        if declared is not None:
            return None if declared is _NOT_REFERENCED else declared
    for m in models:
        for inner in (m, getattr(m, "base_model", None), getattr(getattr(m, "base_model", None), "model", None)):
            path = getattr(getattr(inner, "config", None), "_name_or_path", None)
            if not (isinstance(path, str) and path and os.path.isdir(path)):
                continue
            if _has_safetensors(path):
                return Source(os.path.abspath(path))
            sub = _component_folder(path, type(inner).__name__)
            if sub is not None:
                return Source(os.path.abspath(sub))
    return None


def _component_folder(root: str, class_name: str) -> str | None:
    """The subfolder of a pipeline folder (``from_pretrained(root, subfolder="unet")``
    records ``root``) whose ``config.json`` names ``class_name`` (diffusers' ``_class_name``,
    transformers' ``architectures``) and holds safetensors files; None when there is none
    or several."""
    found = []
    try:
        subs = sorted(os.listdir(root))
    except OSError:
        return None
    for sub in subs:
        folder = os.path.join(root, sub)
        try:
            with open(os.path.join(folder, "config.json")) as f:
                config = json.load(f)
        except (OSError, ValueError):
            continue
        names = {config.get("_class_name"), *(config.get("architectures") or [])} if isinstance(config, dict) else set()
        if class_name in names and _has_safetensors(folder):
            found.append(folder)
    return found[0] if len(found) == 1 else None


def _has_safetensors(path: str) -> bool:
    try:
        return any(n.endswith(".safetensors") for n in os.listdir(path))
    except OSError:
        return False


# ---------------------------------------------------------------------- the folder


@dataclasses.dataclass(frozen=True)
class _SourceEntry:
    file: str
    entry: fmt.TensorEntry


class SourceFolder:
    """A pretrained folder's safetensors files, their headers parsed once: ``files`` (name ->
    :class:`SourceFile`) and ``tensors`` (a name in the files -> where it is).

    Raises (from the constructor):
        MissingBaseError: the folder or a file the index names does not exist.
        CorruptCheckpointError: a header is malformed (names the file).
        StorageError: the storage failed.
    """

    def __init__(self, storage: Storage, only: Iterable[str] | None = None) -> None:
        self.storage = storage
        self.url = storage.url
        self.files: dict[str, SourceFile] = {}
        self.headers: dict[str, fmt.TensorHeader] = {}
        self.tensors: dict[str, _SourceEntry] = {}
        for name in sorted(set(only) if only is not None else self._listed()):
            self._read_header(name)

    def _listed(self) -> list[str]:
        try:
            names = self.storage.listdir()
        except (FileNotFoundError, StorageError) as exc:
            raise MissingBaseError(f"pretrained folder {self.url} does not exist or cannot be listed ({exc})", self.url) from None
        for index in INDEX_NAMES:
            if index in names:
                weight_map = json.loads(self.storage.read_bytes(index)).get("weight_map") or {}
                return sorted(set(weight_map.values()))
        found = [n for n in names if n.endswith(".safetensors")]
        if not found and not self.storage.exists():
            raise MissingBaseError(f"pretrained folder {self.url} does not exist", self.url)
        return found

    def _read_header(self, name: str) -> None:
        url = self.storage.url_of(name)
        try:
            size = self.storage.size(name)
            hasher = fmt.new_hasher()
            with self.storage.open_read(name) as f:
                header = fmt.read_header(f, url, size, hasher=hasher)
        except FileNotFoundError:
            raise MissingBaseError(f"pretrained file {url} does not exist", url) from None
        self.files[name] = SourceFile(size, fmt.checksum_string(hasher))
        self.headers[name] = header
        for e in header.entries:
            self.tensors.setdefault(e.name, _SourceEntry(name, e))
        for alias, stored in header.aliases.items():
            self.tensors.setdefault(alias, _SourceEntry(name, next(e for e in header.entries if e.name == stored)))

    def checksum(self, name: str) -> str:
        """XXH3-64 of tensor ``name``'s stored bytes, read from the file (cached per folder
        state: :func:`folder_for`)."""
        where = self.tensors[name]
        header, hasher = self.headers[where.file], xxhash.xxh3_64()
        left = where.entry.end - where.entry.begin
        with self.storage.open_read(where.file) as f:
            f.seek(header.data_start + where.entry.begin)
            while left:
                chunk = f.read(min(left, _HASH_CHUNK))
                if not chunk:
                    raise ChangedBaseError(f"{self.storage.url_of(where.file)}: tensor {name!r} is truncated", self.url)
                hasher.update(chunk)
                left -= len(chunk)
        return f"xxh3_64:{hasher.hexdigest()}"


_folders: dict[tuple[str, tuple[tuple[str, int, Any], ...]], tuple[SourceFolder, dict[str, str]]] = {}
_folders_lock = threading.Lock()


def folder_for(source: Source) -> tuple[SourceFolder, dict[str, str]]:
    """The :class:`SourceFolder` of ``source`` and its cache of tensor checksums (name ->
    checksum), kept while its files' sizes and modification times stay the same: a second
    save does not read the base again."""
    storage = Storage.of(source.url, source.storage_options)
    folder = SourceFolder(storage)
    state = tuple(sorted((n, f.size_bytes, f.header_checksum) for n, f in folder.files.items()))
    key = (storage.url, state + tuple(_mtimes(storage, folder.files)))
    with _folders_lock:
        if key not in _folders:
            _folders.clear()  # one base per run is the common case; a changed folder is a new key
            _folders[key] = (folder, {})
        return _folders[key]


def _mtimes(storage: Storage, files: Mapping[str, SourceFile]) -> list[tuple[str, int, Any]]:
    out = []
    for name in files:
        try:
            info = storage.fs.info(storage.path_of(name))
        except OSError:
            info = {}
        out.append((name, 0, info.get("mtime") or info.get("LastModified") or info.get("ETag")))
    return out


def base_id(files: Mapping[str, SourceFile]) -> str:
    """:attr:`Reference.base_id`: XXH3-64 hex of the files' names, sizes and header checksums."""
    text = "\n".join(f"{n}\t{f.size_bytes}\t{f.header_checksum}" for n, f in sorted(files.items()))
    return xxhash.xxh3_64_hexdigest(text.encode("utf-8"))


def live_checksum(t: torch.Tensor) -> str:
    """XXH3-64 of a tensor's bytes as safetensors stores them (row-major, little-endian)."""
    flat = t.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    data = flat.contiguous().view(torch.uint8).numpy() if flat.numel() else b""
    return f"xxh3_64:{xxhash.xxh3_64_hexdigest(data)}"


__all__ = ["INDEX_NAMES", "Source", "SourceFolder", "base_id", "folder_for", "live_checksum", "reference_pretrained",
           "source_of"]
