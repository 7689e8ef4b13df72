"""The options of an offloaded load: validation, the offload folder, and the device map.

The device map follows ``accelerate.load_checkpoint_and_dispatch`` (Accelerate 1.x,
``big_modeling.py``): a string (``"auto"``, ``"balanced"``...) is resolved with
``get_balanced_memory`` and ``infer_auto_device_map``. Options: docs/plugins/offload.md (Options).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from statekit.plugin_api import StatekitError, StorageError

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


def check_offload_folder(folder: str | os.PathLike[str] | None, *, source: str = "offload_folder") -> str:
    """Make sure ``folder`` (the ``offload_folder`` option) can hold offloaded tensors: create
    it and write a probe file; ``source`` (what is being loaded) is named in errors.

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


def device_of(name: str, device_map: Mapping[str, Any], source: str) -> Any:
    """The device ``device_map`` gives tensor ``name``: that of its closest mapped module.

    Raises:
        StatekitError: no module containing ``name`` is mapped (names ``source``).
    """
    module = name
    while True:
        if module in device_map:
            return device_map[module]
        if not module:
            raise StatekitError(f"{source}: device_map gives no device for {name!r} (nor for a module containing it)")
        module = module.rsplit(".", 1)[0] if "." in module else ""


def resolve_device_map(model: torch.nn.Module, opts: LoadOptions) -> dict[str, Any]:
    """A module -> device dict: ``opts.device_map`` as given, or a string map (default
    ``"auto"``) resolved as ``accelerate.load_checkpoint_and_dispatch`` does."""
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


def main_device(device_map: Mapping[str, Any], chosen: Any) -> Any:
    """The device inputs go to: ``chosen`` if given, else the first accelerator of the map, else the CPU."""
    if chosen is not None:
        return chosen
    others = [d for d in device_map.values() if d not in ("cpu", "disk")]
    return others[0] if others else "cpu"
