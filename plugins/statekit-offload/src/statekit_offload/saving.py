"""Save a model whose weights are offloaded (Accelerate hooks) tensor by tensor, in the core's layout.

A model dispatched by ``accelerate.dispatch_model`` / ``load_checkpoint_and_dispatch`` /
``cpu_offload`` / ``disk_offload`` (or by this plugin) keeps offloaded parameters on the
meta device; each module's ``AlignDevicesHook`` (``offload=True``) holds a
``weights_map`` from which ``pre_forward`` fetches them. ``model.state_dict()`` of such
a model holds meta tensors, so the core cannot save it.

This module writes ``<key>.safetensors`` exactly as the core would (same header: the
header is built by :func:`statekit.plugin_api.build_header`, tied parameters stored once
and listed as aliases) but streams each tensor's bytes from where they live:

* a tensor of an ``OffloadedWeightsLoader`` index entry that is a ``.dat`` file, or a
  safetensors entry (``safetensors_file``/``weight_name``), is copied from that file in
  chunks of :data:`statekit.plugin_api.CHUNK_BYTES`: nothing of it is held in memory;
* any other offloaded tensor is fetched with ``weights_map[name]`` (one tensor at a time);
* a tensor that is not offloaded (on the CPU or a device) is written from its memory.

Peak memory is one chunk, or one tensor for the second case.

Incremental saves (``CheckpointManager``'s default, docs/incremental.md): the offloaded
tensors (those the model holds on the meta device) go to files of their own,
``<key>.offloaded-<nnnnn>.safetensors`` of at most :data:`OFFLOADED_FILE_BYTES` each, and
the tensors in memory stay in ``<key>.safetensors``; a model with only one of the two
kinds is one file. Before a file is written, its bytes (streamed from the same sources)
are compared with the run's last checkpoint's file of the same path by
:meth:`statekit.plugin_api.Checkpoint.reuse_if_same`, which hard-links (or server-side
copies) an unchanged file instead of writing it. Whether a file is reused is decided from
the bytes alone: an offloaded weight edited in place (in its ``.dat`` file) is written again.

Tied parameters: ``dispatch_model`` replaces offloaded parameters by per-module meta
tensors, so ``find_tied_parameters`` no longer sees ties among them. The tie groups used
are the union of ``find_tied_parameters(model)``, the groups recorded when this plugin
loaded the model, the ``tied_parameters`` save option, and names whose index entries
point at the same tensor of the same safetensors file.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from statekit.plugin_api import (
    CHUNK_BYTES,
    CorruptCheckpointError,
    StatekitError,
    StateMismatchError,
    StorageError,
    TensorHeader,
    UnsupportedDtypeError,
    WrittenFile,
    build_header,
    read_header,
    tensor_bytes,
)
from statekit_offload import offload_format
from statekit_offload._ties import merge_groups


def _align_hooks(module: torch.nn.Module) -> list[Any]:
    hook = getattr(module, "_hf_hook", None)
    if hook is None:
        return []
    from accelerate.hooks import AlignDevicesHook, SequentialHook

    hooks = list(hook.hooks) if isinstance(hook, SequentialHook) else [hook]
    return [h for h in hooks if isinstance(h, AlignDevicesHook)]


def is_offloaded(model: torch.nn.Module) -> bool:
    """True if ``model`` has Accelerate hooks that keep weights offloaded: a module whose
    ``AlignDevicesHook`` has ``offload=True`` and a ``weights_map``.

    Never imports accelerate for a model without ``_hf_hook`` attributes.
    """
    if not any(hasattr(m, "_hf_hook") for m in model.modules()):
        return False
    return any(h.offload and h.weights_map is not None for m in model.modules() for h in _align_hooks(m))


@dataclass(frozen=True)
class _FileSource:
    """Bytes of a tensor in a local file: ``nbytes`` from ``offset``."""

    path: str
    offset: int
    nbytes: int


def _weights_map_of(model: torch.nn.Module, name: str) -> tuple[Any, str] | None:
    """The ``(weights_map, key)`` an offload hook would fetch tensor ``name`` from."""
    parts = name.split(".")
    for depth in range(len(parts) - 1, -1, -1):
        try:
            module = model.get_submodule(".".join(parts[:depth]))
        except AttributeError:
            continue
        for hook in _align_hooks(module):
            if hook.offload and hook.weights_map is not None and (depth == len(parts) - 1 or hook.place_submodules):
                return hook.weights_map, ".".join(parts[depth:])
    return None


def _loader_entry(weights_map: Any, key: str) -> tuple[Any, str]:
    """Unwrap ``PrefixedDataset`` layers: the innermost mapping and the full key in it."""
    from accelerate.utils.offload import PrefixedDataset

    while isinstance(weights_map, PrefixedDataset):
        key = f"{weights_map.prefix}{key}"
        weights_map = weights_map.dataset
    return weights_map, key


class _Headers:
    """Parsed headers of safetensors files named by index entries, cached by path."""

    def __init__(self) -> None:
        self._cache: dict[str, TensorHeader] = {}

    def get(self, path: str) -> TensorHeader:
        if path not in self._cache:
            with open(path, "rb") as f:
                self._cache[path] = read_header(f, path, os.path.getsize(path))
        return self._cache[path]


def _file_source(loader: Any, key: str, target: torch.Tensor, headers: _Headers) -> tuple[_FileSource | None, Any]:
    """Where ``loader[key]``'s bytes are on disk, if they can be copied as they are.

    Returns:
        ``(source, tie_identity)``: the source (or None when the tensor must be fetched
        through the loader) and, for safetensors entries, ``(path, weight_name)``.
    """
    from accelerate.utils.offload import OffloadedWeightsLoader

    if not isinstance(loader, OffloadedWeightsLoader) or key in loader.state_dict or key not in loader.index:
        return None, None
    info = loader.index[key]
    nbytes = target.numel() * target.element_size()
    if info.get("safetensors_file") is not None:
        path = os.path.abspath(info["safetensors_file"])
        weight_name = info.get("weight_name", key)
        header = headers.get(path)
        stored = header.aliases.get(weight_name, weight_name)
        entry = next((e for e in header.entries if e.name == stored), None)
        wanted = info.get("dtype")
        if (
            entry is None
            or entry.dtype != target.dtype
            or tuple(entry.shape) != tuple(target.shape)
            or (wanted is not None and offload_format.torch_dtype_of(wanted) != target.dtype)
        ):
            return None, (path, stored)
        return _FileSource(path, header.data_start + entry.begin, nbytes), (path, stored)
    if loader.save_folder is None:
        return None, None
    path = offload_format.dat_path(loader.save_folder, key)
    if not os.path.isfile(path):
        raise StorageError(f"offloaded tensor {key!r}: its file {path} is missing from the offload folder", url=path)
    if (
        info.get("dtype") != offload_format.offload_dtype_name(target.dtype)
        or list(info.get("shape", [])) != list(target.shape)
        or os.path.getsize(path) != (nbytes or offload_format.EMPTY_DAT_BYTES)
    ):
        return None, None
    return _FileSource(path, 0, nbytes), None


OFFLOADED_FILE_BYTES = 2 * 1024**3
"""Largest ``<key>.offloaded-<nnnnn>.safetensors`` file of an incremental save, bytes (a
tensor larger than this is a file of its own): an offloaded weight edited in place
rewrites one such file. (The core's frozen-tensor files are smaller, to hash them on
several cores at once; an offloaded file is compared while it is read from disk, one
file at a time, so fewer, larger files cost nothing here.)"""

OFFLOADED_INFIX = ".offloaded-"
"""Between a model's key and the file number in the name of an offloaded-tensor file."""


def _file_pieces(source: _FileSource, name: str) -> Any:
    """The bytes of a tensor stored in a local file, in pieces of at most
    :data:`CHUNK_BYTES` (one buffer, reused: a piece is valid until the next is asked for)."""
    buffer = memoryview(bytearray(min(CHUNK_BYTES, max(source.nbytes, 1))))
    with open(source.path, "rb") as f:
        f.seek(source.offset)
        done = 0
        while done < source.nbytes:
            piece = buffer[: min(len(buffer), source.nbytes - done)]
            got = f.readinto(piece)
            if not got:
                raise CorruptCheckpointError(
                    f"{source.path}: truncated while copying offloaded tensor {name!r}", path=source.path
                )
            yield piece[:got]
            done += got


def save_model(
    checkpoint: Any,
    key: str,
    model: torch.nn.Module,
    *,
    tied_parameters: Iterable[Iterable[str]] = (),
) -> dict[str, Any]:
    """Write ``<key>.safetensors`` for an offloaded ``model``, tensor by tensor (in an
    incremental save, the offloaded tensors go to ``<key>.offloaded-<nnnnn>.safetensors``
    and each unchanged file is reused: see the module docstring).

    Args:
        checkpoint: the :class:`statekit.Checkpoint` of the save (rank 0 writes).
        key: the model's stable key.
        model: the unwrapped model with Accelerate offload hooks.
        tied_parameters: extra tie groups (lists of parameter names).

    Returns:
        The record stored for the model: ``{"file", "files", "tensors", "from_files",
        "reused", "tied"}`` (``files``: every file of the model; ``from_files``: tensors
        copied from offload files into files written; ``reused``: files reused from the
        run's last checkpoint).

    Raises:
        UnsupportedDtypeError: a tensor's dtype cannot be stored (names it).
        StateMismatchError: an offloaded tensor has no source, or its source's shape or
            dtype differs from the model's.
        CorruptCheckpointError: an offload file is shorter than its index says.
        StorageError: an offload file is missing or unreadable (names it).
    """
    from accelerate.utils import find_tied_parameters

    from statekit_offload.loading import offload_info

    rel = f"{key}.safetensors"
    state = model.state_dict(keep_vars=True)
    headers = _Headers()
    sources: dict[str, Any] = {}  # name -> _FileSource | (weights_map, key) | tensor
    same_file: dict[Any, list[str]] = {}
    missing = []
    for name, t in state.items():
        if t.device.type != "meta":
            sources[name] = t
            continue
        found = _weights_map_of(model, name)
        if found is None:
            missing.append(name)
            continue
        weights_map, local = found
        loader, full_key = _loader_entry(weights_map, local)
        source, identity = _file_source(loader, full_key, t, headers)
        if identity is not None:
            same_file.setdefault(identity, []).append(name)
        sources[name] = source if source is not None else (weights_map, local)
    if missing:
        raise StateMismatchError(
            f"model {key!r}: tensors on the meta device with no offload hook holding their values "
            "(the model is not fully dispatched)",
            missing=missing,
        )
    info = offload_info(model)
    groups = [*find_tied_parameters(model), *(info.tied_parameters if info else []), *tied_parameters, *same_file.values()]
    tied = merge_groups(groups, set(state))

    placeholders = _placeholders(state, tied, key)
    files = _files(key, placeholders, sources, tied) if checkpoint.incremental else {rel: placeholders}
    from_files, reused = 0, []
    if checkpoint.rank == 0:
        for file_rel, members in files.items():
            header, plan = build_header(members)
            size_bytes = len(header) + sum(p.nbytes for p in plan)
            taken: WrittenFile | None = checkpoint.reuse_if_same(
                file_rel, size_bytes, lambda: _file_bytes(header, plan, sources, state, key)
            )
            if taken is not None:
                reused.append(taken.path)
                continue
            with checkpoint.open(file_rel, "wb") as out:
                out.write(header)
                for p in plan:
                    from_files += _write_one(out, p, sources[p.name], state[p.name], key)
            del plan
    del placeholders
    return {"file": rel, "files": list(files), "tensors": len(state), "from_files": from_files, "reused": reused, "tied": tied}


def _files(
    key: str, placeholders: dict[str, torch.Tensor], sources: dict[str, Any], tied: list[list[str]]
) -> dict[str, dict[str, torch.Tensor]]:
    """The files of an offloaded model in an incremental save: ``relative path -> tensors``.

    Tensors held in memory (their source is the tensor itself) go to ``<key>.safetensors``;
    offloaded ones to ``<key>.offloaded-<nnnnn>.safetensors`` of at most
    :data:`OFFLOADED_FILE_BYTES`, in state-dict order. A tie group stays in one file (in
    memory when any of its names is). A model with only one kind is one file,
    ``<key>.safetensors``.
    """
    group_of = {n: tuple(g) for g in tied for n in g}
    in_memory = {n for n, src in sources.items() if isinstance(src, torch.Tensor)}
    in_memory |= {n for n in placeholders if any(m in in_memory for m in group_of.get(n, ()))}
    whole = {f"{key}.safetensors": placeholders}
    if not in_memory or len(in_memory) == len(placeholders):
        return whole
    files: dict[str, dict[str, torch.Tensor]] = {f"{key}.safetensors": {}}
    file_of_group: dict[tuple[str, ...], str] = {}
    number, filled = 0, 0
    for name, t in placeholders.items():
        if name in in_memory:
            files[f"{key}.safetensors"][name] = t
            continue
        group = group_of.get(name, (name,))
        rel = file_of_group.get(group)
        if rel is None:
            nbytes = t.numel() * t.element_size()
            if filled and filled + nbytes > OFFLOADED_FILE_BYTES:
                number, filled = number + 1, 0
            rel = file_of_group[group] = f"{key}{OFFLOADED_INFIX}{number:05d}.safetensors"
            filled += nbytes
        files.setdefault(rel, {})[name] = t
    return files


def _file_bytes(header: bytes, plan: list[Any], sources: dict[str, Any], state: dict[str, torch.Tensor], key: str) -> Any:
    """The bytes :func:`_write_one` would write after ``header``, in order, from the same
    sources (offloaded files are read, nothing is written): what ``reuse_if_same`` compares."""
    yield header
    for p in plan:
        yield from _pieces(p, sources[p.name], state[p.name], key)


def _placeholders(state: dict[str, torch.Tensor], tied: list[list[str]], key: str) -> dict[str, torch.Tensor]:
    """Stand-ins carrying shape and dtype for the header (build_header touches no data).

    One object per tie group, so the format stores the group once and lists the other
    names as aliases. Offloaded tensors get a zero-stride one-element stand-in; a real
    tensor is its own placeholder (the format's storage-identity ties apply).

    Raises:
        UnsupportedDtypeError: a dtype cannot make a stand-in (names the tensor).
    """
    placeholders: dict[str, torch.Tensor] = {}
    group_of = {n: tuple(g) for g in tied for n in g}
    by_group: dict[tuple[str, ...], torch.Tensor] = {}  # the placeholder of a group's first name met
    for name, t in state.items():
        group = group_of.get(name)
        ref = by_group.get(group) if group else None
        if ref is not None and ref.shape == t.shape and ref.dtype == t.dtype:
            placeholders[name] = ref
            continue
        try:
            placeholders[name] = t.detach() if t.device.type != "meta" else torch.empty((), dtype=t.dtype).expand(t.shape)
        except (RuntimeError, TypeError) as exc:
            raise UnsupportedDtypeError(f"tensor {name!r} of model {key!r} has dtype {t.dtype}: {exc}") from exc
        if group and group not in by_group:
            by_group[group] = placeholders[name]
    return placeholders


def _write_one(out: BinaryIO, p: Any, source: Any, target: torch.Tensor, key: str) -> int:
    """Write one planned tensor's bytes; 1 when they were copied from an offload file, else 0."""
    for piece in _pieces(p, source, target, key):
        out.write(piece)
    return 1 if isinstance(source, _FileSource) else 0


def _pieces(p: Any, source: Any, target: torch.Tensor, key: str) -> Any:
    """One planned tensor's bytes from its source, in pieces of at most :data:`CHUNK_BYTES`."""
    if isinstance(source, _FileSource):
        yield from _file_pieces(source, p.name)
        return
    if isinstance(source, tuple):
        weights_map, local = source
        try:
            value = weights_map[local]
        except OSError as exc:
            raise StorageError(f"model {key!r}: cannot read offloaded tensor {p.name!r}: {exc}",
                               url=getattr(exc, "filename", None)) from exc
        if tuple(value.shape) != tuple(target.shape) or value.dtype != target.dtype:
            raise StateMismatchError(
                f"model {key!r}: offloaded tensor {p.name!r} is {list(value.shape)} {value.dtype}, "
                f"the model expects {list(target.shape)} {target.dtype}",
                mismatched={p.name: f"offloaded {list(value.shape)} {value.dtype} vs model {list(target.shape)} {target.dtype}"},
            )
    else:
        value = source
    view = tensor_bytes(value)
    if len(view) != p.nbytes:
        raise StatekitError(f"model {key!r}: tensor {p.name!r} has {len(view)} bytes, expected {p.nbytes}")
    for start in range(0, len(view), CHUNK_BYTES):
        yield view[start : start + CHUNK_BYTES]


def load_plain(checkpoint: Any, key: str, model: torch.nn.Module, rel: str) -> None:
    """Load ``rel`` (and the model's other files of an incremental save,
    :func:`statekit_offload.loading.model_files`) into a model with real tensors, in
    place, as the core does.

    Used when a model this plugin saved is loaded without a device map.

    Raises:
        StateMismatchError: keys, shapes or dtypes differ (listed); the model is untouched.
        CorruptCheckpointError: the file is malformed or fails verification.
    """
    from statekit_offload.loading import check_shapes, model_files, read_headers

    url = f"{checkpoint.url}/{rel}"
    targets = model.state_dict()
    rels = model_files(checkpoint, key)
    check_shapes(list(read_headers(checkpoint, rels).values()), targets, f"model {key!r} ({url})")
    with torch.no_grad():
        for each in rels:  # each fills the targets it holds
            checkpoint.load_tensors(each, into=targets)
