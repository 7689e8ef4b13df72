"""Fill a model from a statekit tensor file under a device map, one tensor at a time.

The file is read once, in file order (:mod:`statekit_offload._stream`): device- and
CPU-mapped tensors are set with ``accelerate.utils.set_module_tensor_to_device`` as they
are read, ``"disk"`` ones become offload-folder entries (in place in a local checkpoint,
protected by an in-use marker, else copied to ``.dat`` files), then
``accelerate.dispatch_model`` attaches the hooks. Peak memory and the steps:
docs/plugins/offload.md (What happens).
"""

from __future__ import annotations

import functools
import os
import re
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import torch

from statekit.plugin_api import (
    CorruptCheckpointError,
    NATIVE_DTYPES,
    StatekitError,
    StatekitWarning,
    StorageError,
    TensorHeader,
    check_fit,
    mark_in_use,
    model_tensor_files,
    rank_name,
    read_header,
    release_in_use,
    warn_user,
)
from statekit_offload import _stream, offload_format
from statekit_offload._ties import merge_groups
from statekit_offload.options import LoadOptions, check_offload_folder, device_of, main_device, resolve_device_map

_SAFETENSORS_FALLBACK_CODES = frozenset({"F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL"})

# What a load did to a model, by model (see offload_info).
_INFO: weakref.WeakKeyDictionary[torch.nn.Module, OffloadInfo] = weakref.WeakKeyDictionary()

# Offload folders holding .dat copies that a live model of this process reads at every
# forward (Accelerate's loader opens <folder>/<name>.dat on each access): a second load
# into the same folder would rewrite those files under the first model.
_DAT_FOLDERS: dict[str, weakref.ref[torch.nn.Module]] = {}


@dataclass
class OffloadInfo:
    """What a load did to one model (returned by :func:`offload_info`).

    Attributes:
        checkpoint_url: the checkpoint loaded.
        model_key: the model's stable key in it.
        device_map: the device map used (module name -> device), as dispatched.
        offload_folder: the offload folder written, or None when nothing went to disk.
        in_place: tensor names read in place from the checkpoint's safetensors file.
        copied: tensor names copied to ``.dat`` files in the offload folder.
        in_memory_fallback: disk-mapped tensors kept in CPU memory (given to
            ``dispatch_model`` as its ``state_dict``) because Accelerate's offload format
            cannot hold their dtype (complex32, float4); a :class:`statekit.StatekitWarning`
            names them.
        marker: the in-use marker protecting the checkpoint, or None.
        tied_parameters: the tied parameter groups of the model before dispatch
            (``accelerate.utils.find_tied_parameters``).
    """

    checkpoint_url: str
    model_key: str
    device_map: dict[str, Any]
    offload_folder: str | None = None
    in_place: list[str] = field(default_factory=list)
    copied: list[str] = field(default_factory=list)
    in_memory_fallback: list[str] = field(default_factory=list)
    marker: str | None = None
    tied_parameters: list[list[str]] = field(default_factory=list)


def offload_info(model: torch.nn.Module) -> OffloadInfo | None:
    """What statekit-offload's last load did to ``model`` (None if it did not load it)."""
    return _INFO.get(model)


def has_meta_tensors(model: torch.nn.Module) -> bool:
    """True if a parameter or persistent buffer of ``model`` is on the meta device."""
    return any(t.device.type == "meta" for t in model.state_dict(keep_vars=True).values())


def _safetensors_codes() -> frozenset[str]:
    try:
        from safetensors.torch import _TYPES  # the dtype codes safe_open can return as torch tensors

        return frozenset(_TYPES)
    except ImportError:  # pragma: no cover - older safetensors
        return _SAFETENSORS_FALLBACK_CODES


def check_shapes(headers: list[TensorHeader], targets: Mapping[str, torch.Tensor], what: str) -> None:
    """statekit's fit check (:func:`statekit.plugin_api.check_fit`) of a model's tensors
    against the headers of all of its files (aliases included).

    Raises:
        StateMismatchError: keys, shapes or dtypes differ (listed); says the model is untouched.
    """
    saved: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for h in headers:
        saved.update((e.name, (e.shape, e.dtype)) for e in h.entries)
        saved.update((alias, saved[name]) for alias, name in h.aliases.items())
    check_fit(f"{what}; the model is untouched", targets, saved)


def model_files(checkpoint: Any, key: str) -> list[str]:
    """The relative paths of model ``key``'s tensor files: :func:`model_file`, then the
    other files of an incremental save (this plugin's ``<key>.offloaded-<nnnnn>.safetensors``,
    the core's ``<key>.frozen-<nnnnn>.safetensors``), in name order.

    Raises:
        StatekitError, CorruptCheckpointError: as :func:`model_file`.
    """
    first = model_file(checkpoint, key)
    files = list(checkpoint.manifest.files) if checkpoint.manifest is not None else []
    offloaded = re.compile(rf"^{re.escape(key)}\.offloaded-\d{{5}}\.safetensors$")
    frozen = model_tensor_files(key, files)[1:]  # the core's (plugin_api: one owner of those names)
    return [first, *sorted([rel for rel in files if offloaded.match(rel)] + frozen)]


def read_headers(checkpoint: Any, rels: list[str]) -> dict[str, TensorHeader]:
    """The safetensors header of each file (only the header is read).

    Raises:
        CorruptCheckpointError: a header is malformed, or a tensor name is in two files.
    """
    headers: dict[str, TensorHeader] = {}
    seen: dict[str, str] = {}
    for rel in rels:
        url = f"{checkpoint.url}/{rel}"
        with checkpoint.open(rel, "rb") as f:
            headers[rel] = header = read_header(f, url, checkpoint.manifest.files[rel].size_bytes if checkpoint.verify else None)
        for name in [e.name for e in header.entries] + list(header.aliases):
            if name in seen:
                raise CorruptCheckpointError(f"{url}: tensor {name!r} is also in {seen[name]}", path=url)
            seen[name] = rel
    return headers


def model_file(checkpoint: Any, key: str) -> str:
    """The relative path of model ``key``'s tensor file, checked against the manifest.

    Raises:
        StatekitError: the model was stored with extra (non-tensor) state (``<key>.json``),
            which an offloaded load cannot use.
        CorruptCheckpointError: the manifest lists no ``<key>.safetensors``.
    """
    files = checkpoint.manifest.files if checkpoint.manifest is not None else {}
    rel = f"{key}.safetensors"
    if rel not in files:
        if f"{key}.json" in files:
            raise StatekitError(
                f"{checkpoint.url}: model {key!r} was saved with extra (non-tensor) state as {key}.json; "
                "statekit-offload loads only plain tensor files (<key>.safetensors)"
            )
        raise CorruptCheckpointError(f"{checkpoint.url}/{rel}: the manifest lists no tensor file for model {key!r}",
                                     path=f"{checkpoint.url}/{rel}")
    return rel


def load_model(checkpoint: Any, key: str, model: torch.nn.Module, opts: LoadOptions) -> OffloadInfo:
    """Fill ``model`` (unwrapped, usually built under ``init_empty_weights()``) from
    ``<key>.safetensors`` of ``checkpoint`` and dispatch it; without a device map
    (``opts.places`` false) every tensor goes to the CPU and no hook is added.

    Returns:
        What was done (also available later from :func:`offload_info`).

    Raises:
        StateMismatchError: keys, shapes or dtypes differ (listed); the model is untouched.
        StorageError: disk offload is needed and ``offload_folder`` is missing or not writable.
        CorruptCheckpointError: the file is malformed, truncated, or fails verification.
        StatekitError: a bad option, or a device map that does not cover the model.
    """
    from accelerate.utils import find_tied_parameters, retie_parameters

    rels = model_files(checkpoint, key)
    url = f"{checkpoint.url}/{rels[0]}"
    targets = model.state_dict(keep_vars=True)
    device_map = resolve_device_map(model, opts) if opts.places else {"": "cpu"}
    load = _ModelLoad(model, key, url, targets, _placement(model, targets, device_map, opts, key), OffloadInfo(checkpoint.url, key, device_map))
    headers = read_headers(checkpoint, rels)
    check_shapes(list(headers.values()), targets, f"model {key!r} ({url})")
    load.prepare_folder(checkpoint, rels[0], opts)
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    names_of: dict[str, list[str]] = {}
    for header in headers.values():
        names_of.update({e.name: [e.name] for e in header.entries})
        for alias, stored in header.aliases.items():
            names_of[stored].append(alias)
    # Ties: the model's own, and the checkpoint's aliases (names saved as one storage).
    # A model built under init_empty_weights() has lost its ties (register_parameter
    # makes a new meta Parameter per name) until tie_weights() is called.
    load.info.tied_parameters = merge_groups([*find_tied_parameters(model), *names_of.values()], params)
    for rel in rels:  # each file once, in file order
        load.url = f"{checkpoint.url}/{rel}"
        if load.in_place_path is not None:
            load.in_place_path = os.path.abspath(checkpoint.storage.path_of(rel))
        with checkpoint.open(rel, "rb") as f:
            header = read_header(f, load.url, checkpoint.manifest.files[rel].size_bytes if checkpoint.verify else None)
            load.read(f, header, names_of, verify=checkpoint.verify)
    load.url = url
    with torch.no_grad():
        retie_parameters(model, load.info.tied_parameters)
    load.finish(opts, device_map)
    if load.info.copied and load.folder is not None:
        _DAT_FOLDERS[load.folder] = weakref.ref(model)
    if load.info.in_place:
        load.info.marker = mark_in_use(checkpoint.url, by="statekit-offload", model_key=key, offload_folder=load.folder)
        weakref.finalize(model, release_in_use, load.info.marker)
    _INFO[model] = load.info
    return load.info


def _placement(
    model: torch.nn.Module, targets: Mapping[str, torch.Tensor], device_map: Mapping[str, Any], opts: LoadOptions, key: str
) -> dict[str, Any]:
    """Tensor name -> device (``"disk"`` included) under ``device_map``."""
    buffers = {name for name, _ in model.named_buffers()}
    placement = {name: device_of(name, device_map, f"model {key!r}") for name in targets}
    for name, device in placement.items():
        if device == "disk" and name in buffers and not opts.offload_buffers:
            placement[name] = "cpu"  # Accelerate keeps the buffers of offloaded modules in memory
    return placement


@dataclass
class _ModelLoad:
    """The state of one :func:`load_model`: where each tensor goes, and what was done."""

    model: torch.nn.Module
    key: str
    url: str
    targets: Mapping[str, torch.Tensor]
    placement: dict[str, Any]
    info: OffloadInfo
    folder: str | None = None
    in_place_path: str | None = None  # the checkpoint's file, when disk tensors are read in place
    index: dict[str, Any] = field(default_factory=dict)  # the offload folder's index.json
    extras: dict[str, torch.Tensor] = field(default_factory=dict)  # disk-mapped names kept in memory

    def prepare_folder(self, checkpoint: Any, rel: str, opts: LoadOptions) -> None:
        """Check the offload folder (when a tensor goes to disk) and choose in place or copies.

        Raises:
            StorageError: no usable ``offload_folder``, or ``offload_copy=False`` for a
                checkpoint that is not local.
        """
        if not any(d == "disk" for d in self.placement.values()):
            return
        folder = check_offload_folder(opts.offload_folder, source=self.url)
        if checkpoint.world_size > 1:
            folder = check_offload_folder(os.path.join(folder, rank_name(checkpoint.rank)), source=self.url)
        self.folder = self.info.offload_folder = folder
        local = checkpoint.storage.local_path() is not None
        if opts.offload_copy is False and not local:
            raise StorageError(
                f"{self.url}: offload_copy=False reads offloaded weights in place, which needs a checkpoint on the "
                "local filesystem; pass offload_copy=True (or leave it unset) to copy them into offload_folder",
                url=self.url,
            )
        if local and opts.offload_copy is not True:
            self.in_place_path = os.path.abspath(checkpoint.storage.path_of(rel))

    def place(self, names: list[str], value: torch.Tensor | None) -> None:
        """Set the tensors ``names`` as soon as their bytes are read: a tensor for an
        accelerator leaves the CPU before the next one is read, so CPU memory never holds
        more than one of them."""
        from accelerate.utils import set_module_tensor_to_device

        with torch.no_grad():
            for n in names:
                if self.placement[n] == "disk":
                    if n in self.info.in_memory_fallback:
                        self.extras[n] = value  # type: ignore[assignment]
                    if self.targets[n].device.type != "meta":
                        set_module_tensor_to_device(self.model, n, "meta")
                else:
                    set_module_tensor_to_device(self.model, n, self.placement[n], value=value)

    def sink(self, e: Any, names: list[str], readable_in_place: frozenset[str]) -> _stream.Sink:
        """Where the bytes of stored tensor ``e`` (known as ``names``) go; fills the index."""
        sink = _stream.Sink()
        needs_memory = any(self.placement[n] != "disk" for n in names)
        for n in names:
            if self.placement[n] != "disk":
                continue
            if offload_format.offload_dtype_name(e.dtype) is None:
                needs_memory = True
                self.info.in_memory_fallback.append(n)
            elif self.in_place_path is not None and e.dtype in NATIVE_DTYPES and e.code in readable_in_place:
                self.index[n] = offload_format.safetensors_entry(self.in_place_path, e.name, e.dtype)
                self.info.in_place.append(n)
            else:
                self.index[n] = offload_format.dat_entry(e.dtype, e.shape)
                sink.paths.append(offload_format.dat_path(self.folder, n))  # type: ignore[arg-type]
                self.info.copied.append(n)
        if needs_memory:
            tensor, sink.memory = _stream.empty_for(e)
            sink.done = functools.partial(self.place, names, tensor)
        elif any(self.targets[n].device.type != "meta" for n in names):
            sink.done = functools.partial(self.place, names, None)  # a real tensor going to disk: free it
        return sink

    def read(self, f: BinaryIO, header: TensorHeader, names_of: Mapping[str, list[str]], verify: bool) -> None:
        """Stream the file's data into place, once, in file order; verify it when ``verify``.

        Raises:
            CorruptCheckpointError: truncated, or size or checksum differs from the manifest.
            StorageError: writing into the offload folder failed.
        """
        readable_in_place = _safetensors_codes()
        sinks: dict[str, _stream.Sink] = {}
        for e in header.entries:
            sink = self.sink(e, names_of[e.name], readable_in_place)
            if sink.memory is not None or sink.paths or sink.done is not None:
                sinks[e.name] = sink
        if self.info.copied and self.folder is not None:
            owner = _DAT_FOLDERS.get(self.folder)
            live = owner() if owner is not None else None
            if live is not None and live is not self.model:
                raise StatekitError(
                    f"{self.url}: offload_folder={self.folder!r} holds the offloaded weights of another model "
                    f"({type(live).__name__} at 0x{id(live):x}), which reads them at every forward; writing this "
                    "model's copies there would change that model's weights. Give each model its own offload_folder"
                )
        try:
            _stream.stream(f, header, self.url, sinks, read_all=verify)
        except OSError as exc:
            if isinstance(exc, StatekitError):
                raise
            raise StorageError(f"{self.url}: loading into offload_folder={self.folder!r} failed: {exc}", url=self.folder or self.url) from exc
        finally:
            sinks.clear()  # the CPU tensors (those placed on the CPU live on in the model)
        if verify:
            _stream.verify_to_end(f, "the model is partly loaded: load a good checkpoint into a fresh model")

    def finish(self, opts: LoadOptions, device_map: dict[str, Any]) -> None:
        """Warn about in-memory fallbacks, write the offload index, dispatch the model.

        Raises:
            StatekitError: ``accelerate.dispatch_model`` refused the device map.
        """
        from accelerate import dispatch_model
        from accelerate.utils.offload import extract_submodules_state_dict

        if self.info.in_memory_fallback:
            warn_user(
                f"{self.url}: {', '.join(self.info.in_memory_fallback)} mapped to 'disk' but kept in CPU memory: "
                "Accelerate's offload format has no encoding for their dtype",
                StatekitWarning,
            )
        if self.folder is not None:
            offload_format.write_index(self.folder, self.index)
        if not opts.places:
            return
        state_dict = None
        if self.extras:
            state_dict = {}
            if main_device(device_map, opts.main_device) != "cpu":
                cpu_modules = [m for m, d in device_map.items() if d == "cpu"]
                state_dict.update(extract_submodules_state_dict(self.model.state_dict(), cpu_modules))
            state_dict.update(self.extras)
        try:
            dispatch_model(
                self.model,
                device_map,
                main_device=opts.main_device,
                state_dict=state_dict,
                offload_dir=self.folder,
                offload_buffers=opts.offload_buffers,
                skip_keys=opts.skip_keys,
                preload_module_classes=opts.preload_module_classes,
            )
        except ValueError as exc:
            raise StatekitError(f"model {self.key!r} ({self.url}): accelerate.dispatch_model refused the device map: {exc}") from exc
