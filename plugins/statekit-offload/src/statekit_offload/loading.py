"""Fill a model from a statekit tensor file under a device map, one tensor at a time.

The model is usually built under ``accelerate.init_empty_weights()`` (parameters on the
meta device). Its stored tensor file (``<key>.safetensors``, the core's layout) is read
once, sequentially, in file order (:mod:`statekit_offload._stream`):

* a tensor whose module is mapped to ``"cpu"`` or an accelerator is read straight into
  a fresh CPU tensor and set on the module with
  ``accelerate.utils.set_module_tensor_to_device`` as soon as it is read (moved to the
  device when it is one, before the next tensor is read);
* a tensor mapped to ``"disk"`` becomes an entry of an Accelerate offload folder
  (:mod:`statekit_offload.offload_format`): by default, when the checkpoint is on the
  local filesystem, an entry that points into the checkpoint's own safetensors file (no
  copy, and an in-use marker protects the checkpoint, :mod:`statekit_offload.in_use`);
  otherwise, or with ``offload_copy=True``, a ``<name>.dat`` file the bytes are copied
  into in bounded chunks;
* with ``verify`` on (statekit's default) every byte passes through the checksum in the
  same pass, and a mismatch raises :class:`statekit.CorruptCheckpointError`.

Then ``accelerate.dispatch_model`` attaches the hooks (``AlignDevicesHook``) that bring
each module's weights in before its forward, so ``model(x)`` runs. Peak CPU memory: the
tensors placed on the CPU, one tensor bound for an accelerator, and one chunk buffer;
nothing else of the file is held.

The device map follows ``accelerate.load_checkpoint_and_dispatch`` (Accelerate 1.x,
``big_modeling.py``): a string (``"auto"``, ``"balanced"``, ``"balanced_low_0"``,
``"sequential"``) is resolved with ``get_balanced_memory`` and ``infer_auto_device_map``
from ``max_memory`` and ``no_split_module_classes``.
"""

from __future__ import annotations

import functools
import os
import tempfile
import warnings
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from statekit import format as fmt
from statekit.errors import CorruptCheckpointError, StatekitError, StatekitWarning, StateMismatchError, StorageError
from statekit_offload import _stream, in_use, offload_format
from statekit_offload._ties import merge_groups

DEVICE_MAP_STRINGS = ("auto", "balanced", "balanced_low_0", "sequential")
"""The string device maps accepted (as ``accelerate.load_checkpoint_and_dispatch``)."""

OPTION_NAMES = (
    "device_map",
    "max_memory",
    "no_split_module_classes",
    "offload_folder",
    "offload_buffers",
    "offload_copy",
    "main_device",
    "skip_keys",
    "preload_module_classes",
)
"""The ``statekit.load`` keyword options this plugin reads from ``checkpoint.options``."""

_SAFETENSORS_FALLBACK_CODES = frozenset({"F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL"})

# What a load did to a model, by model (see offload_info).
_INFO: weakref.WeakKeyDictionary[torch.nn.Module, OffloadInfo] = weakref.WeakKeyDictionary()


@dataclass
class LoadOptions:
    """The options of one load, validated (see :data:`OPTION_NAMES` and ``docs/plugins/offload.md``)."""

    device_map: Any = None
    max_memory: Any = None
    no_split_module_classes: list[str] | None = None
    offload_folder: str | None = None
    offload_buffers: bool = False
    offload_copy: bool | None = None
    main_device: Any = None
    skip_keys: Any = None
    preload_module_classes: list[str] | None = None

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> LoadOptions:
        """Read and check the options of ``statekit.load``.

        Raises:
            StatekitError: an option has the wrong type (names it).
        """
        opts = cls(**{k: options[k] for k in OPTION_NAMES if k in options})
        dm = opts.device_map
        if dm is not None and not isinstance(dm, Mapping) and dm not in DEVICE_MAP_STRINGS:
            raise StatekitError(
                f"device_map={dm!r}: give a dict (module name -> device, 'cpu' or 'disk') or one of "
                + ", ".join(repr(s) for s in DEVICE_MAP_STRINGS)
            )
        if opts.max_memory is not None and not isinstance(opts.max_memory, Mapping):
            raise StatekitError(f"max_memory={opts.max_memory!r}: give a dict such as {{'cpu': '1GiB'}}")
        if opts.offload_copy not in (None, True, False):
            raise StatekitError(f"offload_copy={opts.offload_copy!r}: give True, False or None")
        if not isinstance(opts.offload_buffers, bool):
            raise StatekitError(f"offload_buffers={opts.offload_buffers!r}: give True or False")
        if opts.offload_folder is not None:
            opts.offload_folder = os.fspath(opts.offload_folder)
        return opts

    @property
    def places(self) -> bool:
        """True when a device map was asked for (``device_map`` or ``max_memory`` given)."""
        return self.device_map is not None or self.max_memory is not None


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


def check_offload_folder(folder: str | os.PathLike[str] | None, *, source: str = "offload_folder") -> str:
    """Make sure ``folder`` can hold offloaded tensors: create it and write a probe file.

    Args:
        folder: the ``offload_folder`` option.
        source: what is being loaded, named in errors.

    Returns:
        The folder's absolute path.

    Raises:
        StorageError: ``folder`` is None, not a directory, or not writable; the message
            names the ``offload_folder`` option and the path.
    """
    if folder is None:
        raise StorageError(
            f"{source}: the device map sends weights to 'disk', which needs offload_folder=<a writable "
            "local directory>; none was given",
            url=source,
        )
    path = os.path.abspath(os.fspath(folder))
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".statekit-offload-probe-"):
            pass
    except OSError as exc:
        raise StorageError(
            f"offload_folder={os.fspath(folder)!r} is not a writable directory ({path}): "
            f"{type(exc).__name__}: {exc.strerror or exc}",
            url=path,
        ) from exc
    return path


def _safetensors_codes() -> frozenset[str]:
    try:
        from safetensors.torch import _TYPES  # the dtype codes safe_open can return as torch tensors

        return frozenset(_TYPES)
    except ImportError:  # pragma: no cover - older safetensors
        return _SAFETENSORS_FALLBACK_CODES


def _device_of(name: str, device_map: Mapping[str, Any], source: str) -> Any:
    module = name
    while True:
        if module in device_map:
            return device_map[module]
        if not module:
            raise StatekitError(f"{source}: device_map gives no device for {name!r} (nor for a module containing it)")
        module = module.rsplit(".", 1)[0] if "." in module else ""


def _resolve_device_map(model: torch.nn.Module, opts: LoadOptions) -> dict[str, Any]:
    from accelerate import infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    device_map = opts.device_map if opts.device_map is not None else "auto"
    if isinstance(device_map, str):
        max_memory = opts.max_memory
        if device_map != "sequential":
            max_memory = get_balanced_memory(
                model,
                max_memory=max_memory,
                no_split_module_classes=opts.no_split_module_classes,
                low_zero=(device_map == "balanced_low_0"),
            )
        device_map = infer_auto_device_map(
            model,
            max_memory=max_memory,
            no_split_module_classes=opts.no_split_module_classes,
            offload_buffers=opts.offload_buffers,
        )
    return dict(device_map)


def _main_device(device_map: Mapping[str, Any], main_device: Any) -> Any:
    if main_device is not None:
        return main_device
    others = [d for d in device_map.values() if d not in ("cpu", "disk")]
    return others[0] if others else "cpu"


def _check_shapes(header: fmt.TensorHeader, targets: Mapping[str, torch.Tensor], what: str) -> None:
    saved = {e.name: (e.shape, e.dtype) for e in header.entries}
    for alias, name in header.aliases.items():
        saved[alias] = saved[name]
    mismatched = {
        k: f"saved {list(saved[k][0])} {saved[k][1]} vs model {list(t.shape)} {t.dtype}"
        for k, t in targets.items()
        if k in saved and (tuple(t.shape) != saved[k][0] or t.dtype != saved[k][1])
    }
    missing = set(targets) - set(saved)
    unexpected = set(saved) - set(targets)
    if missing or unexpected or mismatched:
        raise StateMismatchError(f"{what}; the model is untouched", missing, unexpected, mismatched)


def model_file(checkpoint: Any, key: str) -> str:
    """The relative path of model ``key``'s tensor file, checked against the manifest.

    Raises:
        StatekitError: the model was stored with extra (non-tensor) state (``<key>.json``),
            which an offloaded load cannot use.
        CorruptCheckpointError: the manifest lists no ``<key>.safetensors``.
    """
    files = (checkpoint.manifest or {}).get("files", {})
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
    """Fill ``model`` from ``<key>.safetensors`` of ``checkpoint`` and dispatch it.

    Without a device map (``opts.places`` false) every tensor is loaded on the CPU in
    place of the model's own (meta or real), one tensor at a time, and no hook is added.

    Args:
        checkpoint: the :class:`statekit.Checkpoint` of the load.
        key: the model's stable key.
        model: the (unwrapped) model, usually built under ``init_empty_weights()``.
        opts: the load options.

    Returns:
        What was done (also available later from :func:`offload_info`).

    Raises:
        StateMismatchError: keys, shapes or dtypes differ (listed); the model is untouched.
        StorageError: disk offload is needed and ``offload_folder`` is missing or not writable.
        CorruptCheckpointError: the file is malformed, truncated, or fails verification.
        StatekitError: a bad option, or a device map that does not cover the model.
    """
    from accelerate import dispatch_model
    from accelerate.utils import find_tied_parameters, retie_parameters, set_module_tensor_to_device
    from accelerate.utils.offload import extract_submodules_state_dict

    rel = model_file(checkpoint, key)
    url = f"{checkpoint.url}/{rel}"
    expected = checkpoint.manifest["files"][rel] if checkpoint.verify else None
    targets = model.state_dict(keep_vars=True)
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    device_map = _resolve_device_map(model, opts) if opts.places else {"": "cpu"}
    buffers = {name for name, _ in model.named_buffers()}
    placement = {name: _device_of(name, device_map, f"model {key!r}") for name in targets}
    for name, device in placement.items():
        if device == "disk" and name in buffers and not opts.offload_buffers:
            placement[name] = "cpu"  # Accelerate keeps the buffers of offloaded modules in memory
    info = OffloadInfo(checkpoint.url, key, device_map)
    disk = any(d == "disk" for d in placement.values())
    folder = None
    if disk:
        folder = check_offload_folder(opts.offload_folder, source=url)
        if checkpoint.world_size > 1:
            folder = check_offload_folder(os.path.join(folder, f"rank-{checkpoint.rank:05d}"), source=url)
        info.offload_folder = folder
    local = bool(getattr(checkpoint.storage, "is_local", False))
    if opts.offload_copy is False and disk and not local:
        raise StorageError(
            f"{url}: offload_copy=False reads offloaded weights in place, which needs a checkpoint on the "
            "local filesystem; pass offload_copy=True (or leave it unset) to copy them into offload_folder",
            url=url,
        )
    in_place_ok = disk and local and opts.offload_copy is not True
    file_path = os.path.abspath(checkpoint.storage.path_of(rel)) if in_place_ok else None
    readable_in_place = _safetensors_codes()

    hasher = fmt.new_hasher() if expected is not None else None
    index: dict[str, Any] = {}
    extras: dict[str, torch.Tensor] = {}  # disk-mapped names kept in memory (dtype not offloadable)

    def place(names: list[str], value: torch.Tensor | None) -> None:
        # Called as soon as a tensor is read: a tensor for an accelerator leaves the CPU
        # before the next one is read, so CPU memory never holds more than one of them.
        with torch.no_grad():
            for n in names:
                if placement[n] == "disk":
                    if n in info.in_memory_fallback:
                        extras[n] = value  # type: ignore[assignment]
                    if targets[n].device.type != "meta":
                        set_module_tensor_to_device(model, n, "meta")
                else:
                    set_module_tensor_to_device(model, n, placement[n], value=value)

    with checkpoint.open(rel, "rb") as f:
        header = _stream.read_header(f, url, expected["size_bytes"] if expected else None, hasher)
        _check_shapes(header, targets, f"model {key!r} ({url})")
        names_of: dict[str, list[str]] = {e.name: [e.name] for e in header.entries}
        for alias, stored in header.aliases.items():
            names_of[stored].append(alias)
        # Ties: the model's own, and the checkpoint's aliases (names saved as one storage).
        # A model built under init_empty_weights() has lost its ties (register_parameter
        # makes a new meta Parameter per name) until tie_weights() is called.
        tied = merge_groups([*find_tied_parameters(model), *names_of.values()], params)
        info.tied_parameters = tied
        sinks: dict[str, _stream.Sink] = {}
        for e in header.entries:
            sink = _stream.Sink()
            names = names_of[e.name]
            needs_memory = any(placement[n] != "disk" for n in names)
            for n in names:
                if placement[n] != "disk":
                    continue
                if offload_format.offload_dtype_name(e.dtype) is None:
                    needs_memory = True
                    info.in_memory_fallback.append(n)
                elif in_place_ok and e.dtype in fmt._NATIVE and e.code in readable_in_place:
                    index[n] = offload_format.safetensors_entry(file_path, e.name, e.dtype)  # type: ignore[arg-type]
                    info.in_place.append(n)
                else:
                    index[n] = offload_format.dat_entry(e.dtype, e.shape)
                    sink.paths.append(offload_format.dat_path(folder, n))  # type: ignore[arg-type]
                    info.copied.append(n)
            if needs_memory:
                tensor, sink.memory = _stream.empty_for(e)
                sink.done = functools.partial(place, names, tensor)
                del tensor
            elif any(targets[n].device.type != "meta" for n in names):
                sink.done = functools.partial(place, names, None)  # a real tensor going to disk: free it
            if sink.memory is not None or sink.paths or sink.done is not None:
                sinks[e.name] = sink
        try:
            _stream.stream(f, header, url, sinks, hasher)
        except OSError as exc:
            if isinstance(exc, StatekitError):
                raise
            raise StorageError(f"{url}: loading into offload_folder={folder!r} failed: {exc}", url=folder or url) from exc
        finally:
            sinks.clear()  # the CPU tensors (those placed on the CPU live on in the model)
    _stream.check_against_manifest(url, expected, header, hasher, "the model is partly loaded: load a good "
                                   "checkpoint into a fresh model")
    with torch.no_grad():
        retie_parameters(model, tied)
    if info.in_memory_fallback:
        warnings.warn(
            f"{url}: {', '.join(info.in_memory_fallback)} mapped to 'disk' but kept in CPU memory: "
            "Accelerate's offload format has no encoding for their dtype",
            StatekitWarning,
            stacklevel=2,
        )
    if folder is not None:
        offload_format.write_index(folder, index)
    if opts.places:
        state_dict = None
        if extras:
            state_dict = {}
            if _main_device(device_map, opts.main_device) != "cpu":
                cpu_modules = [m for m, d in device_map.items() if d == "cpu"]
                state_dict.update(extract_submodules_state_dict(model.state_dict(), cpu_modules))
            state_dict.update(extras)
        try:
            dispatch_model(
                model,
                device_map,
                main_device=opts.main_device,
                state_dict=state_dict,
                offload_dir=folder,
                offload_buffers=opts.offload_buffers,
                skip_keys=opts.skip_keys,
                preload_module_classes=opts.preload_module_classes,
            )
        except ValueError as exc:
            raise StatekitError(f"model {key!r} ({url}): accelerate.dispatch_model refused the device map: {exc}") from exc
    if info.in_place:
        info.marker = in_use.mark_in_use(checkpoint.url, model_key=key, offload_folder=folder)
        weakref.finalize(model, in_use.release_in_use, info.marker)
    _INFO[model] = info
    return info
