"""The live tensors the state check digests, read from a save's or a load's objects
(:class:`statekit.checks.state_check.LiveTensors`): which objects are digested and the
tensors of each, by their path in its state dict (``docs/concepts.md``, State check).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from statekit.checks import state_check
from statekit.checks.state_check import LiveTensors
from statekit.engine.entries import Entry, unwrap_model

logger = logging.getLogger("statekit")

_DIGESTED_KINDS = frozenset({"model", "optimizer", "scheduler", "scaler", "custom", "tensor", "dict"})


def live_tensors(
    entries: list[Entry], accelerator: Any = None, states: Mapping[str, Mapping[str, Any]] | None = None
) -> list[LiveTensors]:
    """The digested objects of a save or a load and their live tensors, in order; none when
    the check is off (:data:`~statekit.checks.state_check.MODE_ENV`: no state dict is computed).

    ``states``: state dicts the save computed already, by key (not computed twice).

    Raises:
        InvalidOptionError: :data:`~statekit.checks.state_check.MODE_ENV` holds an unknown mode.
    """
    if state_check.mode() == "off":
        return []
    return [LiveTensors(e.key, e.kind, e.per_rank, digested(e, accelerator, (states or {}).get(e.key)))
            for e in digestible(entries, accelerator)]


def digestible(entries: list[Entry], accelerator: Any = None) -> list[Entry]:
    """The entries whose tensors the state digest covers, in order: not optimizers when a
    model is sharded by a collective wrapper (their state is each rank's shard)."""
    models = [e.obj for e in entries if e.kind == "model"]
    sharded = any(_is_collective(m) or _is_collective(unwrap_model(m, accelerator)) for m in models)
    return [e for e in entries if not (sharded and e.kind == "optimizer")]


def digested(entry: Entry, accelerator: Any = None, state: Mapping[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """``path -> tensor`` of one object that the state digest covers, by path in its state
    dict (``"layers.0.weight"``, ``"state.0.exp_avg"``), DTensors included; empty for what
    is not digested (sharded models among them). ``state``: its state dict when the caller
    has it already."""
    if entry.kind not in _DIGESTED_KINDS or entry.plugin_only:
        return {}
    try:
        if entry.kind == "model":
            model = unwrap_model(entry.obj, accelerator)
            if any(_is_collective(m) for m in (entry.obj, model)):
                return {}
            state = model.state_dict() if state is None else state
        elif state is not None:
            pass
        elif entry.kind == "tensor":
            state = {entry.key: entry.obj}
        elif entry.kind == "dict":
            state = entry.obj
        else:
            state = entry.obj.state_dict()
    except Exception:  # noqa: BLE001 - an object whose state cannot be read now is not digested
        logger.debug("state check: %s has no readable state dict", entry.key, exc_info=True)
        return {}
    out: dict[str, torch.Tensor] = {}
    state_check.flatten(state, "", out)
    return out


def is_collective(model: Any) -> bool:
    """Whether ``model``'s (or its unwrapped core's) ``state_dict()`` gathers across ranks
    (FSDP1 anywhere inside it, a DeepSpeed engine): no rank may call it alone."""
    return _is_collective(model) or _is_collective(unwrap_model(model))


def _is_collective(model: Any) -> bool:
    """Whether a model's ``state_dict()`` gathers across ranks (FSDP1 anywhere inside it, a
    DeepSpeed engine): it cannot be called on one rank alone."""
    if "DeepSpeed" in type(model).__name__:
        return True
    modules = model.modules() if isinstance(model, torch.nn.Module) else ()
    return any(type(m).__name__ == "FullyShardedDataParallel" for m in modules)
