"""Does a saved optimizer state fit the live optimizer? Checked before anything of a load is applied.

``Optimizer.load_state_dict`` checks only group and parameter counts, only when called (after the
models were filled: a half-restored run), and never the state tensors' shapes (the first
``step()`` then fails). :func:`check_optimizer_fit` is the one check every load path runs first,
from structure and shapes only (meta tensors do). Compared: the ``torch.optim`` per-parameter
buffers (:data:`PARAMETER_SHAPED`) and any key the live optimizer already holds for the
parameter; other state (Adafactor's factored statistics, 8-bit quantisation maps) is not."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from statekit.errors import StateMismatchError

PARAMETER_SHAPED = frozenset(
    {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "grad_avg", "acc_delta", "sum",
     "ax", "prev", "step_size", "exp_inf"}
)
"""State keys of ``torch.optim`` optimizers (Adam/AdamW, SGD, RMSprop, Adadelta, Adagrad,
ASGD, Rprop, Adamax, NAdam, RAdam) whose tensors have their parameter's shape."""


def torch_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The ``torch.optim.Optimizer`` under wrappers (Accelerate's ``AcceleratedOptimizer``
    keeps it as ``.optimizer``), or None when there is none."""
    seen = 0
    while not isinstance(optimizer, torch.optim.Optimizer) and hasattr(optimizer, "optimizer") and seen < 8:
        optimizer, seen = optimizer.optimizer, seen + 1
    return optimizer if isinstance(optimizer, torch.optim.Optimizer) else None


def parameter_names(models: Iterable[torch.nn.Module]) -> dict[int, str]:
    """``id(parameter) -> name`` over the (unwrapped) ``models``, the first name of a shared
    parameter, so messages name a parameter as the user's model does."""
    names: dict[int, str] = {}
    for model in models:
        for name, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), name)
    return names


def check_optimizer_fit(where: str, optimizer: Any, state: Any, names: Mapping[int, str] | None = None) -> None:
    """Refuse a saved optimizer state that ``optimizer`` cannot take, before anything is applied.

    Args:
        where: the optimizer and its file, for the message (``"optimizer 'optimizer_0' (<url>)"``).
        optimizer: the live optimizer (an ``AcceleratedOptimizer`` is unwrapped); not checked when
            it is no ``torch.optim.Optimizer`` or has ``load_state_dict`` pre-hooks.
        state: the saved state dict; its tensors may be meta tensors (shapes only).
        names: :func:`parameter_names`; an unnamed parameter is named by group and index.

    Raises:
        StateMismatchError: not an optimizer state, another number of parameter groups or of
            parameters in a group (naming where the lists part), or a state tensor whose shape is
            not its parameter's (names the parameter, the state key and both shapes).
    """
    opt = torch_optimizer(optimizer)
    if opt is None or getattr(opt, "_optimizer_load_state_dict_pre_hooks", None):
        return
    if not isinstance(state, Mapping) or not isinstance(state.get("param_groups"), (list, tuple)) or not isinstance(
        state.get("state"), Mapping
    ):
        raise StateMismatchError(where, reason="the saved state is not an optimizer state dict (no 'state' and 'param_groups')")
    live_name = _namer(opt.param_groups, names or {})
    _check_group_sizes(where, state, opt.param_groups, live_name)
    _check_state_shapes(where, state, opt, live_name)


def _check_group_sizes(where: str, state: Mapping[str, Any], live_groups: list[dict[str, Any]], live_name: Any) -> None:
    """The number of parameter groups, then of parameters in each group, as saved."""
    saved_groups = list(state["param_groups"])
    if len(saved_groups) != len(live_groups):
        raise StateMismatchError(
            where,
            reason=f"{len(saved_groups)} parameter groups saved, the optimizer has {len(live_groups)}; "
            "nothing was loaded (build the optimizer with the parameter groups of the saved run)",
        )
    sizes = []
    for g, (saved, live) in enumerate(zip(saved_groups, live_groups)):
        if len(saved.get("params", ())) != len(live["params"]):
            sizes.append(
                f"parameter group {g}: {len(saved.get('params', ()))} parameters saved, the optimizer has "
                f"{len(live['params'])}{_which_differ(state['state'], saved, live, g, live_name)}"
            )
    if sizes:
        raise StateMismatchError(
            where,
            reason="; ".join(sizes) + "; nothing was loaded (a parameter frozen, added or removed since the save? "
            "build the optimizer over the parameters of the saved run)",
        )


def _check_state_shapes(where: str, state: Mapping[str, Any], opt: torch.optim.Optimizer, live_name: Any) -> None:
    """Each compared state tensor (:func:`_expected_shape`) against its parameter's shape."""
    mismatched = {}
    for g, (saved, live) in enumerate(zip(state["param_groups"], opt.param_groups)):
        for i, (sid, p) in enumerate(zip(saved["params"], live["params"])):
            per_param = state["state"].get(sid)
            if not isinstance(per_param, Mapping):
                continue
            held = opt.state.get(p, {})
            for key, value in per_param.items():
                expected = _expected_shape(key, value, p, held)
                if expected is not None and tuple(value.shape) != expected and live_name(g, i) not in mismatched:
                    mismatched[live_name(g, i)] = (
                        f"{key} saved {list(value.shape)} vs parameter {list(p.shape)}"
                        + ("" if expected == tuple(p.shape) else f" (the optimizer holds {list(expected)})")
                    )
    if mismatched:
        raise StateMismatchError(
            where, mismatched=mismatched,
            reason="the state was saved for parameters of other shapes (parameters created in another order?); "
            "nothing was loaded",
        )


def check_scheduler_fit(where: str, scheduler: Any, state: Any) -> None:
    """Refuse a saved LR scheduler state of another scheduler class (``where`` names it in the
    message), before anything is applied: ``LRScheduler.load_state_dict`` is ``__dict__.update`` and
    never refuses. The public keys are compared only when each side has keys the other lacks, so a
    torch version that added or dropped one (``verbose``) still loads. Accelerate's
    ``AcceleratedScheduler`` is unwrapped.

    Raises:
        StateMismatchError: the keys differ both ways (names them and the live class).
    """
    live = getattr(scheduler, "scheduler", scheduler)
    if not isinstance(live, torch.optim.lr_scheduler.LRScheduler) or not isinstance(state, Mapping):
        return
    mine = {k for k in live.state_dict() if isinstance(k, str) and not k.startswith("_")}
    saved = {k for k in state if isinstance(k, str) and not k.startswith("_")}
    if saved - mine and mine - saved:
        raise StateMismatchError(
            where, missing=mine - saved, unexpected=saved - mine,
            reason=f"the state was saved by another kind of scheduler than this {type(live).__name__}; nothing was loaded",
        )


def _expected_shape(key: Any, value: Any, p: torch.Tensor, held: Mapping[Any, Any]) -> tuple[int, ...] | None:
    """The shape a saved state tensor must have, or None when it is not compared."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return None
    current = held.get(key)
    if isinstance(current, torch.Tensor) and current.dim() > 0:
        return tuple(current.shape)
    return tuple(p.shape) if key in PARAMETER_SHAPED else None


def _namer(live_groups: list[dict[str, Any]], names: Mapping[int, str]) -> Any:
    def name(g: int, i: int) -> str:
        p = live_groups[g]["params"][i]
        label = names.get(id(p))
        return f"{label} (group {g}, index {i})" if label else f"group {g}, index {i} {list(p.shape)}"

    return name


def _which_differ(saved_state: Mapping[Any, Any], saved: Mapping[str, Any], live: Mapping[str, Any], g: int, live_name: Any) -> str:
    """A hint naming where the saved and live parameter lists part: the saved parameter names
    (``param_groups[g]["param_names"]``, written by optimizers built from named parameters),
    else the first position whose saved per-parameter state has another shape than the
    live parameter there."""
    saved_names, live_names = saved.get("param_names"), live.get("param_names")
    if isinstance(saved_names, (list, tuple)) and isinstance(live_names, (list, tuple)):
        gone = [n for n in saved_names if n not in set(live_names)]
        new = [n for n in live_names if n not in set(saved_names)]
        parts = ([f"saved but not in the optimizer: {', '.join(map(str, gone))}"] if gone else []) + (
            [f"in the optimizer but not saved: {', '.join(map(str, new))}"] if new else []
        )
        return f" ({'; '.join(parts)})" if parts else ""
    for i, (sid, p) in enumerate(zip(saved.get("params", ()), live["params"])):
        shapes = [tuple(v.shape) for k, v in (saved_state.get(sid) or {}).items() if isinstance(v, torch.Tensor) and k in PARAMETER_SHAPED]
        if shapes and shapes[0] != tuple(p.shape):
            return f" (they part at {live_name(g, i)}: its saved state has shape {list(shapes[0])})"
    return ""
