"""Gradients accumulated between optimizer steps: saved mid-accumulation, restored exactly.

With ``Accelerator(gradient_accumulation_steps=n)`` the ``.grad`` of every parameter
holds the sum of the micro-batches since the last optimizer step; ``accelerator.step``
counts them and ``accelerator.sync_gradients`` is False until the n-th
(``accelerate.Accelerator._do_sync``). A checkpoint taken there must carry those
gradients, or the first optimizer step after the resume uses only the micro-batches
seen after it. ``Accelerator.save_state`` does not save them; statekit does
(:class:`AccumulatedGradients`, one object per rank: inside ``no_sync`` each rank holds
its own, unreduced gradients).

At a sync point (``sync_gradients`` True: the optimizer has stepped and, in the usual
loop, zeroed the gradients) nothing is written. A loop that accumulates by hand
(``gradient_accumulation_steps=1``, ``optimizer.step()`` every k-th batch) is recognised
by its gradients: an optimizer step post-hook (:func:`watch_optimizer_steps`) marks every
``.grad`` with its version counter when the optimizer consumes it; a non-zero gradient
created or changed after that (a ``backward`` since the last step) is pending and is
saved the same way. A gradient left after a step (``zero_grad`` at the loop's start) is
not. Where the mark is missing (the hook was installed after the step) the gradient
counts as pending: saved although stale, which costs bytes, never exactness.
"""

from __future__ import annotations

from typing import Any

import torch

from statekit.engine.entries import check_fit, unwrap_model
from statekit.errors import StatekitError, StatekitWarning, StateMismatchError, warn_user


_STEPPED = "_statekit_stepped_version"  # the grad's ``_version`` when an optimizer last stepped with it
_watching: list[Any] = []  # the handle of the one global step post-hook


def watch_optimizer_steps() -> None:
    """Install, once per process, the optimizer step post-hook that marks the gradients an
    optimizer step consumed (``torch.optim.optimizer.register_optimizer_step_post_hook``)."""
    if not _watching:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _watching.append(register_optimizer_step_post_hook(_mark_consumed))


def _mark_consumed(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            grad = p.grad  # (about 0.3 us per parameter tensor and step on this CPU)
            if grad is not None:
                setattr(grad, _STEPPED, grad._version)


def pending_by_hand(accelerator: Any) -> bool:
    """True when a model's gradients hold a ``backward`` that no optimizer step has consumed
    while Accelerate counts no accumulation (``gradient_accumulation_steps=1``): a loop that
    accumulates by hand saved between its optimizer steps. All-zero gradients
    (``zero_grad(set_to_none=False)``) are not pending."""
    if accumulating(accelerator) or "DEEPSPEED" in str(getattr(accelerator, "distributed_type", "")).upper():
        return False
    fresh = [
        p.grad for m in getattr(accelerator, "_models", [])
        for p in m.parameters()
        if p.grad is not None and getattr(p.grad, _STEPPED, None) != p.grad._version
    ]
    return any(bool(g.detach().ne(0).any()) for g in fresh)


def accumulating(accelerator: Any) -> bool:
    """True when ``accelerator`` is between two optimizer steps of gradient accumulation.

    Args:
        accelerator: an ``accelerate.Accelerator``.

    Returns:
        ``gradient_accumulation_steps > 1`` and ``sync_gradients`` is False (the last
        ``accumulate()`` block did not end an accumulation window).
    """
    steps = int(getattr(accelerator, "gradient_accumulation_steps", 1) or 1)
    return steps > 1 and not bool(getattr(accelerator, "sync_gradients", True))


def refuse_unsupported(accelerator: Any, models: list[torch.nn.Module]) -> None:
    """Raise where accumulated gradients cannot be saved exactly.

    Args:
        accelerator: the run's Accelerator, between sync points.
        models: its prepared models.

    Raises:
        StatekitError: DeepSpeed (its engine keeps the accumulated gradients) or a
            sharded model (FSDP: its gradients are shards statekit-fsdp does not save);
            the message names the setting and says to save at a sync point.
    """
    if int(getattr(accelerator, "gradient_accumulation_steps", 1) or 1) > 1:
        advice = (
            f"a checkpoint between optimizer steps (gradient_accumulation_steps="
            f"{accelerator.gradient_accumulation_steps}, micro-batch {accelerator.step}) needs the accumulated "
            "gradients; save when accelerator.sync_gradients is True"
        )
    else:
        advice = ("a checkpoint between the loop's own optimizer steps (a backward no optimizer.step() consumed yet) "
                  "needs the accumulated gradients; save right after optimizer.step()")
    kind = str(getattr(accelerator, "distributed_type", ""))
    if "DEEPSPEED" in kind.upper():
        raise StatekitError(f"DeepSpeed keeps accumulated gradients inside its engine, which statekit cannot save: {advice}")
    for model in models:
        if _is_sharded(model):
            raise StatekitError(
                f"{type(model).__name__} (FSDP) holds sharded gradients, which statekit-fsdp does not save: {advice}"
            )


def check_can_save(accelerator: Any) -> None:
    """Refuse, before anything is written, a save between sync points that cannot be
    exact (:func:`refuse_unsupported`); a no-op at a sync point or without accumulation.

    Raises:
        StatekitError: see :func:`refuse_unsupported`.
    """
    if accumulating(accelerator):
        refuse_unsupported(accelerator, list(getattr(accelerator, "_models", [])))


def _is_sharded(model: torch.nn.Module) -> bool:
    if type(model).__name__ == "FullyShardedDataParallel":
        return True
    return any(type(p).__name__ == "DTensor" for p in model.parameters())


class AccumulatedGradients:
    """The accumulated gradients of an Accelerate run as a Stateful object (per rank).

    ``state_dict()`` returns ``{"accumulating": False}`` at a sync point, else
    ``{"accumulating": True, "step": int, "gradient_accumulation_steps": int,
    "grads": {"model_<i>": {param name: Tensor}}}``
    (parameter names of the unwrapped model, ``.grad`` of the same shape and dtype as
    the parameter; parameters without a gradient are left out).

    Args:
        accelerator: an ``accelerate.Accelerator`` after ``prepare()``.
    """

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator

    def _models(self) -> list[torch.nn.Module]:
        return [unwrap_model(m, self.accelerator) for m in self.accelerator._models]

    def state_dict(self) -> dict[str, Any]:
        """The gradients to save (none at a sync point).

        Raises:
            StatekitError: mid-accumulation under DeepSpeed or FSDP (see :func:`refuse_unsupported`).
        """
        by_hand = pending_by_hand(self.accelerator)
        if not (by_hand or accumulating(self.accelerator)):
            return {"accumulating": False}
        models = self._models()
        refuse_unsupported(self.accelerator, list(self.accelerator._models))
        grads = {
            f"model_{i}": {name: p.grad.detach() for name, p in model.named_parameters() if p.grad is not None}
            for i, model in enumerate(models)
        }
        return {
            "accumulating": True,
            "step": int(self.accelerator.step),
            "gradient_accumulation_steps": int(self.accelerator.gradient_accumulation_steps),
            **({"by_hand": True} if by_hand else {}),
            "grads": grads,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put the saved gradients back (``.grad`` of every saved parameter, None for the
        others) and mark the run as between sync points; a state saved at a sync point
        changes nothing.

        Raises:
            StateMismatchError: the run accumulates over another number of micro-batches
                than the saved one (the saved window cannot be completed), or a saved
                gradient has no parameter, or another shape or dtype (checked for every
                model before any gradient is set).
        """
        if not state.get("accumulating"):
            return
        saved_steps = int(state.get("gradient_accumulation_steps", self.accelerator.gradient_accumulation_steps))
        if saved_steps != self.accelerator.gradient_accumulation_steps:
            raise StateMismatchError(
                f"accumulated gradients: saved between optimizer steps with gradient_accumulation_steps="
                f"{saved_steps} (micro-batch {state.get('step')}); this run has "
                f"{self.accelerator.gradient_accumulation_steps}, so the saved window cannot be completed: "
                "resume with the saved setting or from a checkpoint saved at a sync point"
            )
        models = self._models()
        saved = state["grads"]
        if set(saved) != {f"model_{i}" for i in range(len(models))}:
            raise StateMismatchError(
                f"accumulated gradients: saved for {sorted(saved)}, the run has {len(models)} model(s)"
            )
        for i, model in enumerate(models):
            params = dict(model.named_parameters())
            shapes = {k: (tuple(v.shape), v.dtype) for k, v in saved[f"model_{i}"].items()}
            # targets: the parameters that had a gradient; a saved name the model lacks is "unexpected"
            check_fit(f"accumulated gradients of model_{i}", {k: params[k] for k in shapes if k in params}, shapes)
        with torch.no_grad():
            for i, model in enumerate(models):
                grads = saved[f"model_{i}"]
                for name, p in model.named_parameters():
                    p.grad = grads[name].to(device=p.device).clone() if name in grads else None
        if not state.get("by_hand"):  # by hand, the loop's own optimizer.step() ends the window
            self.accelerator.gradient_state._set_sync_gradients(False)


def warn_partial_window(accelerator: Any, step: int) -> None:
    """Warn that a resume from a checkpoint without accumulated gradients (Accelerate's own)
    is not exact when it was saved between optimizer steps: Accelerate's ``step`` counts
    micro-batches and restarts at every sync, so one that is not a multiple of
    ``gradient_accumulation_steps`` means mid-window.

    Args:
        accelerator: the resuming ``Accelerator``.
        step: the restored ``accelerator.step``.

    Warns:
        StatekitWarning: saved mid-window (names the micro-batch and the setting).
    """
    steps = int(getattr(accelerator, "gradient_accumulation_steps", 1) or 1)
    if steps > 1 and step % steps:
        warn_user(
            f"this Accelerate checkpoint was saved between optimizer steps (micro-batch {step % steps} of "
            f"gradient_accumulation_steps={steps}) and holds no accumulated gradients: the first optimizer step "
            "after the resume sums only the micro-batches seen after it, so the resume is not exact",
            StatekitWarning,
        )
