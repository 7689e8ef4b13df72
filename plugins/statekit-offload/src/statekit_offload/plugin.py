"""The statekit-offload hooks: load under a memory budget, save offloaded models, export.

Registered from the entry point ``offload`` in group ``statekit``. Importing this module
imports neither accelerate nor numpy (``python -X importtime`` shows neither): both are
imported inside the hooks, and only when a model needs them.

* ``statekit_load_state_pre``: takes the model and fills it itself
  (:func:`statekit_offload.loading.load_model`) when

  - ``statekit.load(..., device_map=..., max_memory=..., offload_folder=...)`` asks for a
    device map (the options apply to the only model of the load, or to the only one
    with meta tensors), or
  - the model has parameters on the meta device (built under ``init_empty_weights()``):
    without a device map it is filled on the CPU, one tensor at a time, or
  - this plugin saved the model (it owns it): then a model with real tensors is
    loaded in place as the core would.

  Models saved by other plugins are never touched.
* ``statekit_save_state_pre`` (``tryfirst``, so no other model plugin computes the state
  dict of an offloaded model first): takes every model with Accelerate offload hooks and
  writes ``<key>.safetensors`` in the core's layout tensor by tensor
  (:func:`statekit_offload.saving.save_model`). Its record (``records["offload"]
  ["models"][key]``) names the file and the tie groups.
* ``STATEKIT_CONVERTERS["offload"]``: :func:`statekit_offload.export.export`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from statekit.plugin_api import CORE, StatekitError, hookimpl, unwrap_model
from statekit_offload.options import OPTION_NAMES

if TYPE_CHECKING:
    from statekit.plugin_api import Checkpoint


def _export(src_url: str, out_url: str, *, storage_options: dict[str, Any] | None = None) -> dict[str, str]:
    """``statekit convert SRC OUT --to offload`` (see :func:`statekit_offload.export.export`)."""
    from statekit_offload.export import export

    return export(src_url, out_url, storage_options=storage_options)


STATEKIT_CONVERTERS = {"offload": _export}
"""Converters for ``statekit convert``: ``--to offload`` writes an Accelerate offload folder."""

STATEKIT_OPTIONS = frozenset(OPTION_NAMES) | {"tied_parameters"}
"""The ``checkpoint.options`` this plugin reads: the load options
(:data:`statekit_offload.options.OPTION_NAMES`) and, on save, ``tied_parameters``."""


@hookimpl(tryfirst=True)
def statekit_save_state_pre(models: list[Any], weights: list[Any], output_dir: str, checkpoint: Checkpoint) -> None:
    """Take every model whose weights are offloaded by Accelerate hooks and save it tensor by tensor.

    Raises:
        StateMismatchError: an offloaded tensor has no source or a source of another shape/dtype.
        UnsupportedDtypeError: a tensor cannot be stored (names it).
    """
    from statekit_offload.saving import is_offloaded, save_model

    for i in reversed(range(len(models))):
        model = models[i]
        core = unwrap_model(model, checkpoint.accelerator)
        if not is_offloaded(core):
            continue
        key = checkpoint.key_of(model)
        record = save_model(checkpoint, key, core, tied_parameters=checkpoint.options.get("tied_parameters") or ())
        checkpoint.records.setdefault("models", {})[key] = record
        models.pop(i)
        weights.pop(i)


@hookimpl
def statekit_load_state_pre(models: list[Any], input_dir: str, checkpoint: Checkpoint) -> None:
    """Fill models under a device map, or meta models on the CPU, or the models this plugin saved.

    Raises:
        StatekitError: bad options, a device map for several models, or a model that is
            already dispatched with offloaded weights.
        StorageError: disk offload without a usable ``offload_folder`` (names it).
        StateMismatchError: keys, shapes or dtypes differ (listed).
        CorruptCheckpointError: the tensor file fails verification.
    """
    from statekit_offload.loading import has_meta_tensors, load_model, model_file
    from statekit_offload.options import LoadOptions
    from statekit_offload.saving import is_offloaded, load_plain

    opts = LoadOptions.from_options(checkpoint.options)
    entries = []
    for model in models:
        key = checkpoint.key_of(model)
        owner = checkpoint.owner_of(key)
        if owner in (CORE, checkpoint.plugin):
            core = unwrap_model(model, checkpoint.accelerator)
            entries.append(_Loaded(model, key, owner == checkpoint.plugin, core, has_meta_tensors(core)))
    placed = _placed(checkpoint, entries) if opts.places else set()
    for e in entries:
        place = e.key in placed
        if not (place or e.meta or e.ours):
            continue
        if is_offloaded(e.core):
            raise StatekitError(
                f"{checkpoint.url}: model {e.key!r} is already dispatched with offloaded weights; load into a fresh "
                "model built under accelerate.init_empty_weights() (with device_map=... to offload it again)"
            )
        if place or e.meta:
            load_model(checkpoint, e.key, e.core, opts if place else LoadOptions())
        else:
            load_plain(checkpoint, e.key, e.core, model_file(checkpoint, e.key))
        models.remove(e.model)


@dataclass(frozen=True)
class _Loaded:
    """A model of the load this plugin may fill: its key, whether this plugin saved it,
    the unwrapped model and whether it holds meta tensors."""

    model: Any
    key: str
    ours: bool
    core: Any
    meta: bool


def _placed(checkpoint: Checkpoint, entries: list[_Loaded]) -> set[str]:
    """The key of the one model ``device_map``/``max_memory`` apply to: the only model, or
    the only one on the meta device.

    Raises:
        StatekitError: several models and not exactly one of them on the meta device.
    """
    if len(entries) <= 1:
        return {e.key for e in entries}
    meta = [e for e in entries if e.meta]
    if len(meta) != 1:
        keys = ", ".join(e.key for e in (meta or entries))
        raise StatekitError(
            f"{checkpoint.url}: device_map/max_memory apply to one model, and this load has several "
            f"({keys}); load the offloaded model in a statekit.load call of its own"
        )
    return {meta[0].key}
