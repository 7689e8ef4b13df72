"""Which models are sharded, which optimizers go with them, and the tensor/JSON split of their state.

DCP gets tensors only: :func:`split_state` replaces each tensor leaf with ``{"__dcp__": flat_key}``
(keys ``.``-joined as DCP's ``flatten_state_dict`` does) and the skeleton is stored as JSON.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from statekit.plugin_api import StatekitError

REF = "__dcp__"
"""Key of a skeleton leaf that stands for a tensor stored through DCP."""


# --------------------------------------------------------------------------- detection


def strip_wrappers(model: torch.nn.Module) -> torch.nn.Module:
    """Strip DDP/DataParallel (``.module``) and ``torch.compile`` (``._orig_mod``) wrappers,
    stopping at an FSDP1 ``FullyShardedDataParallel`` (which must stay, its state-dict
    hooks produce the shards). Accelerate's ``unwrap_model`` would strip FSDP1 too, so it
    is not used here."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    while True:
        if isinstance(model, FullyShardedDataParallel):
            return model
        if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
            model = model._orig_mod
        else:
            return model


def sharding_kind(model: torch.nn.Module) -> str | None:
    """How a (wrapper-stripped) model is sharded.

    Returns:
        ``"fsdp2"`` (a ``fully_shard`` module inside), ``"fsdp1"`` (a
        ``FullyShardedDataParallel`` inside), ``"dtensor"`` (DTensor parameters or
        buffers without FSDP, e.g. tensor parallel), or None for a plain model.
    """
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    modules = list(model.modules())
    if any(isinstance(m, FSDPModule) for m in modules):
        return "fsdp2"
    if any(isinstance(m, FullyShardedDataParallel) for m in modules):
        return "fsdp1"
    if any(isinstance(t, DTensor) for t in (*model.parameters(), *model.buffers())):
        return "dtensor"
    return None


def inner_optimizer(obj: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer behind ``obj``, or None when ``obj`` is not an optimizer.

    Optimizer wrappers that are optimizers themselves (Accelerate's
    ``AcceleratedOptimizer`` keeps the real one in ``.optimizer``) are unwrapped. LR
    schedulers also have an ``.optimizer`` but are not optimizers: None.
    """
    if not isinstance(obj, torch.optim.Optimizer):
        return None
    for _ in range(8):
        inner = getattr(obj, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer) or inner is obj:
            break
        obj = inner
    return obj


def optimizers_of(model: torch.nn.Module, objects: Mapping[str, Any], where: str) -> list[tuple[str, torch.optim.Optimizer]]:
    """The optimizers among ``objects`` whose parameters belong to ``model``.

    Returns:
        ``[(key, torch_optimizer)]`` in ``objects`` order (a wrapper and the optimizer it
        wraps are both listed).

    Raises:
        StatekitError: an optimizer holds parameters of this model *and* other tensors
            (DCP's ``get_state_dict`` can only map one model's parameters to names).
    """
    params = {id(p) for p in model.parameters()}
    found = []
    for key, obj in objects.items():
        opt = inner_optimizer(obj)
        if opt is None:
            continue
        ids = [id(p) for group in opt.param_groups for p in group["params"]]
        inside = sum(1 for i in ids if i in params)
        if inside == 0:
            continue
        if inside != len(ids):
            raise StatekitError(
                f"optimizer {key!r} holds {inside} parameters of sharded model {where!r} and {len(ids) - inside} "
                "other tensors; statekit-fsdp saves an optimizer together with one model: give each model its own optimizer"
            )
        found.append((key, opt))
    return found


def frozen_keys(model: torch.nn.Module, prefix: str) -> frozenset[str]:
    """The flat keys (``<prefix>.<fqn>``, as :func:`split_state` names them) of the model's
    parameters that do not require gradients.

    FQNs are those of DCP's ``get_state_dict``, through DCP's own ``_get_fqns`` (where this
    torch lacks it, the known wrapper prefixes are stripped by name). The result only
    decides which file a chunk is written to.
    """
    try:
        from torch.distributed.checkpoint.state_dict import _get_fqns as get_fqns
    except ImportError:  # pragma: no cover - an older or newer torch without the helper

        def get_fqns(model: torch.nn.Module, name: str) -> set[str]:
            parts = [p for p in name.split(".") if p not in ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")]
            return {".".join(parts)}

    keys: set[str] = set()
    for name, p in model.named_parameters():
        if not p.requires_grad:
            keys.update(f"{prefix}.{fqn}" for fqn in get_fqns(model, name))
    return frozenset(keys)


def unique(optimizers: list[torch.optim.Optimizer]) -> list[torch.optim.Optimizer]:
    """The optimizers without repeats (by identity), in order."""
    seen: set[int] = set()
    return [o for o in optimizers if not (id(o) in seen or seen.add(id(o)))]


# --------------------------------------------------------------------------- tensor / JSON split


def _is_ref(v: Any) -> bool:
    return isinstance(v, dict) and len(v) == 1 and REF in v


def split_state(state: Any, prefix: str = "") -> tuple[Any, dict[str, torch.Tensor]]:
    """Replace every tensor leaf of a nested dict/list/tuple state with ``{"__dcp__": key}``.

    Args:
        state: nested dicts (str or int keys), lists and tuples; leaves are tensors
            (plain, DTensor, ShardedTensor) or plain values.
        prefix: path prefix of the flat keys.

    Returns:
        ``(skeleton, tensors)``: the state with tensor leaves replaced, and
        ``flat_key -> tensor`` (the original objects, not copies).

    Raises:
        StatekitError: two different paths flatten to the same key.
    """
    tensors: dict[str, torch.Tensor] = {}

    def walk(v: Any, path: str) -> Any:
        if isinstance(v, torch.Tensor):
            if path in tensors:
                raise StatekitError(f"two tensors of the state flatten to the same key {path!r}")
            tensors[path] = v
            return {REF: path}
        if isinstance(v, Mapping):
            return {k: walk(x, f"{path}.{k}" if path else str(k)) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x, f"{path}.{i}" if path else str(i)) for i, x in enumerate(v)]
        if isinstance(v, tuple):
            return tuple(walk(x, f"{path}.{i}" if path else str(i)) for i, x in enumerate(v))
        return v

    return walk(state, prefix), tensors


def refs_of(skeleton: Any) -> list[str]:
    """Every flat key referenced by a skeleton, in traversal order."""
    out: list[str] = []

    def walk(v: Any) -> None:
        if _is_ref(v):
            out.append(v[REF])
        elif isinstance(v, Mapping):
            for x in v.values():
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)

    walk(skeleton)
    return out


def fill_state(skeleton: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Inverse of :func:`split_state`: the skeleton with each ``{"__dcp__": key}`` replaced
    by ``tensors[key]``.

    Raises:
        KeyError: a referenced key is missing from ``tensors``.
    """

    def walk(v: Any) -> Any:
        if _is_ref(v):
            return tensors[v[REF]]
        if isinstance(v, Mapping):
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x) for x in v]
        if isinstance(v, tuple):
            return tuple(walk(x) for x in v)
        return v

    return walk(skeleton)


def global_shape(t: torch.Tensor) -> tuple[int, ...]:
    """Shape of the whole tensor (a DTensor's or ShardedTensor's global shape)."""
    return tuple(int(s) for s in t.size())
