"""The diffusers/transformers folder layout: library detection, folder names, config JSON, shards.

Nothing here imports diffusers or transformers: a model can only be a ``ModelMixin`` (or
``PreTrainedModel``) once its module is imported, so detection looks the class up in
``sys.modules``. File names and the shard index follow ``ModelMixin.save_pretrained``
(diffusers ``models/modeling_utils.py``) and ``huggingface_hub.split_torch_state_dict_into_shards``.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import PurePath
from typing import Any

import torch

from statekit.plugin_api import StatekitError, view_identity

DIFFUSERS = "diffusers"
TRANSFORMERS = "transformers"

WEIGHTS_NAME = {DIFFUSERS: "diffusion_pytorch_model.safetensors", TRANSFORMERS: "model.safetensors"}
"""Unsharded weights file name per library."""

CONFIG_NAME = "config.json"
SCHEDULER_CONFIG_NAME = "scheduler_config.json"

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
"""Default largest shard: 5 GB (decimal, as ``"5GB"`` in ``huggingface_hub``)."""

# ConfigMixin.to_json_string drops these (diffusers/configuration_utils.py).
_DROPPED_CONFIG_KEYS = ("_ignore_files", "_use_default_values", "_pre_quantization_dtype")

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*$", re.IGNORECASE)
_UNITS = {
    None: 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


# --------------------------------------------------------------------------- detection


def _class_in(module_name: str, class_name: str) -> type | None:
    module = sys.modules.get(module_name)
    cls = getattr(module, class_name, None) if module is not None else None
    return cls if isinstance(cls, type) else None


def library_of(model: Any) -> str | None:
    """``"diffusers"`` for a ``ModelMixin``, ``"transformers"`` for a ``PreTrainedModel``,
    else None (also while the library is not imported), without importing either."""
    return library_of_class(type(model))


def library_of_class(cls: Any) -> str | None:
    """:func:`library_of` for a class (an ``EMAModel``'s ``model_cls``); None for a non-class."""
    if not isinstance(cls, type):
        return None
    mixin = _class_in("diffusers.models.modeling_utils", "ModelMixin")
    if mixin is not None and issubclass(cls, mixin):
        return DIFFUSERS
    pretrained = _class_in("transformers.modeling_utils", "PreTrainedModel")
    if pretrained is not None and issubclass(cls, pretrained):
        return TRANSFORMERS
    return None


def ema_class() -> type | None:
    """``diffusers.training_utils.EMAModel`` if that module is imported, else None."""
    return _class_in("diffusers.training_utils", "EMAModel")


def is_sharded_model(model: torch.nn.Module) -> bool:
    """True if a parameter is a ``DTensor`` (FSDP2 / tensor parallel) or a DeepSpeed ZeRO-3
    partition: such models belong to the sharding plugins, never to a full-weights writer."""
    for p in model.parameters():
        if type(p).__name__ == "DTensor" or hasattr(p, "ds_numel"):
            return True
    return False


def library_version(library: str) -> str:
    """Installed version of ``library`` read from package metadata (no import), or ``"unknown"``."""
    try:
        return metadata.version(library)
    except metadata.PackageNotFoundError:
        return "unknown"


# --------------------------------------------------------------------------- names


def _snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()


def default_folder(class_name: str, library: str) -> str:
    """The folder name a model of ``class_name`` gets, as diffusers pipelines name
    components (``UNet2DConditionModel`` -> ``unet``; the rules: docs/plugins/diffusers.md)."""
    if library == TRANSFORMERS:
        return "image_encoder" if "Vision" in class_name else "text_encoder"
    if class_name.startswith("UNet"):
        return "unet"
    if class_name.startswith("Autoencoder") or class_name in ("VQModel", "AsymmetricAutoencoderKL"):
        return "vae"
    if "ControlNet" in class_name:
        return "controlnet"
    if "Transformer" in class_name:
        return "transformer"
    if "Adapter" in class_name:
        return "adapter"
    base = class_name[: -len("Model")] if class_name.endswith("Model") and class_name != "Model" else class_name
    return _snake(base) or "model"


_FOLDER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")


def check_folder(name: Any, what: str) -> str:
    """Validate a folder name given in code.

    Raises:
        StatekitError: not a file-name-safe string (letters, digits, ``_``, ``.``, ``-``).
    """
    if not isinstance(name, str) or not _FOLDER.match(name):
        raise StatekitError(
            f"statekit-diffusers: folder name {name!r} for {what} must be a file-name-safe string "
            "(letters, digits, '_', '.', '-'; not starting with '_' or '.')"
        )
    return name


def dedupe(name: str, used: set[str]) -> str:
    """``name`` if unused, else ``name_1``, ``name_2``...; the result is added to ``used``."""
    candidate, i = name, 0
    while candidate in used:
        i += 1
        candidate = f"{name}_{i}"
    used.add(candidate)
    return candidate


# --------------------------------------------------------------------------- config JSON


def _json_saveable(value: Any) -> Any:
    # diffusers ConfigMixin.to_json_string's to_json_saveable, plus tuples and dtypes.
    if hasattr(value, "tolist") and not isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, PurePath):
        return value.as_posix()
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if hasattr(value, "to_dict") and callable(value.to_dict):
        return _json_saveable(value.to_dict())
    if isinstance(value, Mapping):
        return {k: _json_saveable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_saveable(v) for v in value]
    return value


def hf_json(obj: Mapping[str, Any]) -> bytes:
    """Serialise a config as the Hugging Face libraries do: 2-space indent, sorted keys, newline.

    Raises:
        StatekitError: a value is not JSON-serialisable (names it).
    """
    try:
        return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise StatekitError(f"statekit-diffusers: config is not JSON-serialisable: {exc}") from exc


def diffusers_config(config: Mapping[str, Any], class_name: str) -> dict[str, Any]:
    """The ``config.json`` content (a JSON-able dict) of a diffusers model or scheduler.

    Mirrors ``diffusers.configuration_utils.ConfigMixin.to_json_string`` (diffusers 0.42)
    without mutating the live ``config``; ``class_name`` is written as ``_class_name``.
    """
    out = {k: _json_saveable(v) for k, v in dict(config).items() if k not in _DROPPED_CONFIG_KEYS}
    out["_class_name"] = class_name
    out["_diffusers_version"] = library_version(DIFFUSERS)
    return out


def transformers_config(model: Any) -> dict[str, Any]:
    """The ``config.json`` content of a transformers model (``config.to_dict()``, with
    ``architectures`` set to the model's class as ``PreTrainedModel.save_pretrained`` does)."""
    out = _json_saveable(model.config.to_dict())
    out["architectures"] = [type(model).__name__]
    out.setdefault("transformers_version", library_version(TRANSFORMERS))
    return out


def config_changes(live: Mapping[str, Any], saved: Mapping[str, Any]) -> dict[str, Any]:
    """Public config entries of ``saved`` that differ from ``live`` once both are JSON values.

    Private keys (leading ``_``: ``_class_name``, ``_diffusers_version``, ``_name_or_path``...)
    are left out, so ``register_to_config(**changes)`` restores what the run configured
    without turning tuples into lists where nothing changed.
    """
    changes = {}
    for key, value in saved.items():
        if key.startswith("_"):
            continue
        if key not in live or _json_saveable(live[key]) != value:
            changes[key] = value
    return changes


# --------------------------------------------------------------------------- shards


def parse_size(value: Any) -> int:
    """Parse a shard size: an int (bytes) or a string such as ``"5GB"``, ``"200MiB"``, ``"10KB"``.

    Decimal units (KB, MB, GB, TB) are powers of 10 and binary units (KiB...) powers of 2,
    as in ``huggingface_hub.utils.parse_size_to_int``.

    Raises:
        StatekitError: not a positive size.
    """
    if isinstance(value, bool):
        raise StatekitError(f"statekit-diffusers: max_shard_size must be bytes or a size string, got {value!r}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str) and (m := _SIZE.match(value)):
        unit = m.group(2).upper() if m.group(2) else None
        size = int(float(m.group(1)) * _UNITS[unit])
    else:
        raise StatekitError(f"statekit-diffusers: max_shard_size must be bytes or a size string like '5GB', got {value!r}")
    if size <= 0:
        raise StatekitError(f"statekit-diffusers: max_shard_size must be positive, got {value!r}")
    return size


@dataclass
class ShardPlan:
    """How one state dict is split into files.

    Attributes:
        files: ``file name -> {tensor name: tensor}`` in write order.
        index: the index JSON content, or None when there is a single file.
        total_bytes: bytes of tensor data (shared storage counted once).
    """

    files: dict[str, dict[str, torch.Tensor]]
    index: dict[str, Any] | None
    total_bytes: int


def plan_shards(state: Mapping[str, torch.Tensor], weights_name: str, max_shard_bytes: int) -> ShardPlan:
    """Split ``state`` into shards of at most ``max_shard_bytes`` (bytes) of tensor data.

    Follows ``huggingface_hub.split_torch_state_dict_into_shards``; a tensor bigger than the
    limit is alone in its shard, views of one storage go with their first name. One file
    named ``weights_name`` when everything fits.
    """
    shards: list[dict[str, torch.Tensor]] = []
    current: dict[str, torch.Tensor] = {}
    current_bytes = total = 0
    first_of: dict[tuple[Any, ...], str] = {}
    tied: dict[str, str] = {}
    for name, t in state.items():
        ident = view_identity(t)
        if ident is not None and ident in first_of:
            tied[name] = first_of[ident]
            continue
        if ident is not None:
            first_of[ident] = name
        nbytes = t.numel() * t.element_size()
        total += nbytes
        if nbytes > max_shard_bytes:
            shards.append({name: t})
            continue
        if current and current_bytes + nbytes > max_shard_bytes:
            shards.append(current)
            current, current_bytes = {}, 0
        current[name] = t
        current_bytes += nbytes
    if current or not shards:
        shards.append(current)
    shard_of = {name: i for i, shard in enumerate(shards) for name in shard}
    for name, target in tied.items():
        shards[shard_of[target]][name] = state[name]
        shard_of[name] = shard_of[target]
    if len(shards) == 1:
        return ShardPlan({weights_name: shards[0]}, None, total)
    stem, ext = weights_name.rsplit(".", 1)
    names = [f"{stem}-{i + 1:05d}-of-{len(shards):05d}.{ext}" for i in range(len(shards))]
    files = dict(zip(names, shards))
    weight_map = {name: names[shard_of[name]] for name in state}
    return ShardPlan(files, {"metadata": {"total_size": total}, "weight_map": weight_map}, total)


def index_name(weights_name: str) -> str:
    """The index file name for sharded weights (``<weights_name>.index.json``)."""
    return f"{weights_name}.index.json"
