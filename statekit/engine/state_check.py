"""The state check: the live tensors of every saved object, digested at save and compared
with the live objects after every load (issue 38; ``docs/concepts.md``, State check).

A checkpoint's checksums prove its files; they cannot see a load path that leaves an
optimizer's moments at zero, zero-pads a reshard or skips an adapter: the files were
fine. At save, :func:`record` digests every tensor of every saved object's state dict
(:mod:`statekit.format.state_digest`: one number per tensor, the same however the tensor
is split); after a load, :func:`check` digests the objects as they now are and names
each tensor that differs. Deliberate differences are named as such, not reported as
faults: a tensor loaded into another dtype is compared after a cast back (a widening
cast is exact), and one a ``strict=False`` load left out is skipped.

What is digested: the state dict of every object the core saves whole on every rank
(models, optimizers, schedulers, scalers, custom objects, tensors and dicts of them);
not data loaders (their positions are the resume audit's), per-rank objects, objects a
plugin took (their layout is the plugin's), meta tensors (nothing to compare), ``DTensor``
shards (their global positions are the sharding plugin's to give), and models whose
``state_dict()`` is a collective (FSDP1, DeepSpeed engines: the digest runs on one rank),
with their optimizers (whose state is each rank's shard).

How much is digested: :data:`MODE_ENV` (``STATEKIT_STATE_CHECK``): ``"sampled"`` (the
default where a tensor is on the CPU: blocks of 16 elements every 4096, and every element
of tensors under 65,536 elements), ``"full"`` (every element; the default for tensors on
an accelerator, where it costs a few element-wise kernels) or ``"off"`` (a save records
no digest and a load compares none). A load compares with what the save recorded.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from statekit.engine.entries import Entry, unwrap_model
from statekit.errors import InvalidOptionError, StateCheckWarning, StateMismatchError, warn_user
from statekit.format import state_digest as sd
from statekit.format.manifest_types import Manifest, StateDigest

logger = logging.getLogger("statekit")

MODE_ENV = "STATEKIT_STATE_CHECK"
"""Environment variable choosing the state check: ``sampled``, ``full`` or ``off`` (unset:
full when every digested tensor is on an accelerator, sampled otherwise)."""

MODES = ("sampled", "full", "off")

_DIGESTED_KINDS = frozenset({"model", "optimizer", "scheduler", "scaler", "custom", "tensor", "dict"})


@dataclasses.dataclass
class StateVerdict:
    """The state check of one load.

    Attributes:
        verdict: ``"verified"`` (every compared tensor equals its saved digest),
            ``"mismatch"`` (at least one differs) or ``"not recorded"`` (the checkpoint
            holds no state digest: written before it existed, or with the check off).
        compared: tensors compared.
        sampled: the digests were sampled (:class:`statekit.format.state_digest.Sampling`).
        differences: per differing tensor, ``"<object> '<key>': <what differs>"``.
        mismatched: ``"<object key>:<tensor path>" -> "saved digest ..., live ..."``.
        deliberate: the deliberate differences, ``(object, tensor path, what)`` (loaded into
            another dtype, left out by ``strict=False``, offloaded).
    """

    verdict: str
    compared: int = 0
    sampled: bool = False
    differences: list[str] = dataclasses.field(default_factory=list)
    mismatched: dict[str, str] = dataclasses.field(default_factory=dict, repr=False)
    deliberate: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)

    @property
    def detail(self) -> str:
        """The verdict in words."""
        if self.verdict == "not recorded":
            return "the checkpoint holds no state digest"
        if self.differences:
            return "; ".join(self.differences)
        how = "sampled" if self.sampled else "every element"
        grouped: dict[tuple[str, str], list[str]] = {}
        for what, path, reason in self.deliberate:
            grouped.setdefault((what, reason), []).append(path)
        noted = "".join(f"; {what}: {len(paths)} tensor(s) {reason} ({paths[0]}{', ...' if len(paths) > 1 else ''})"
                        for (what, reason), paths in grouped.items())
        return f"{self.compared} tensors equal their saved digests ({how}){noted}"

    def to_json(self) -> dict[str, Any]:
        """The ``state`` record of the next manifest's ``resume_audit``."""
        return {"verdict": self.verdict, "detail": self.detail, "compared": self.compared, "sampled": self.sampled}


def mode() -> str | None:
    """The chosen mode (:data:`MODE_ENV`), or None for the default.

    Raises:
        InvalidOptionError: the variable holds another value.
    """
    value = os.environ.get(MODE_ENV, "").strip().lower()
    if not value:
        return None
    if value not in MODES:
        raise InvalidOptionError(f"{MODE_ENV}={value!r}: must be one of {', '.join(MODES)}")
    return value


def digestible(entries: list[Entry], accelerator: Any = None) -> list[Entry]:
    """The entries whose tensors the state digest covers: not optimizers when a model is
    sharded by a collective wrapper (their state is each rank's shard), and (by
    :func:`digested`) not the sharded models themselves.

    Args:
        entries: a save's or load's objects.
        accelerator: the run's Accelerator, or None.

    Returns:
        The entries to digest, in order.
    """
    models = [e.obj for e in entries if e.kind == "model"]
    sharded = any(_is_collective(m) or _is_collective(unwrap_model(m, accelerator)) for m in models)
    return [e for e in entries if not (sharded and e.kind == "optimizer")]


def digested(entry: Entry, accelerator: Any = None, state: Mapping[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of one object that the state digest covers, by their path in its state
    dict (``"layers.0.weight"``, ``"state.0.exp_avg"``); empty for what is not digested
    (module docstring).

    Args:
        entry: the object (:class:`statekit.engine.entries.Entry`).
        accelerator: its Accelerator, to unwrap a prepared model.
        state: its state dict when the caller has it already (not computed again).

    Returns:
        ``path -> tensor``.
    """
    if entry.kind not in _DIGESTED_KINDS or entry.per_rank or entry.plugin_only:
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
    _flatten(state, "", out)
    return out


def _digestible_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Without meta tensors (shapes only: nothing to digest)."""
    return {path: t for path, t in tensors.items() if t.device.type != "meta"}


def _is_collective(model: Any) -> bool:
    """Whether a model's ``state_dict()`` gathers across ranks (FSDP1 anywhere inside it, a
    DeepSpeed engine): it cannot be called on one rank alone."""
    if "DeepSpeed" in type(model).__name__:
        return True
    modules = model.modules() if isinstance(model, torch.nn.Module) else ()
    return any(type(m).__name__ == "FullyShardedDataParallel" for m in modules)


def _flatten(value: Any, prefix: str, out: dict[str, torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        if type(value).__name__ != "DTensor":  # a shard's global positions are its plugin's to give
            out[prefix] = value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _flatten(v, f"{prefix}.{i}" if prefix else str(i), out)


def _sampling(tensors: Iterable[torch.Tensor]) -> sd.Sampling | None:
    chosen = mode()
    if chosen == "off":
        return None
    if chosen == "full":
        return sd.Sampling.FULL
    if chosen == "sampled":
        return sd.Sampling()
    on_host = any(t.device.type == "cpu" for t in tensors)
    return sd.Sampling() if on_host else sd.Sampling.FULL


def record(
    entries: list[Entry], accelerator: Any = None, states: Mapping[str, Mapping[str, Any]] | None = None
) -> StateDigest | None:
    """The state digest of a save: every digested tensor of every object, now.

    Args:
        entries: the save's objects.
        accelerator: the run's Accelerator, or None.
        states: state dicts the save computed already, by key (the models' weights the
            core wrote: a model's ``state_dict()`` is not called twice).

    Returns:
        The manifest's ``state_digest``, or None (nothing digested, or the check off).

    Raises:
        InvalidOptionError: :data:`MODE_ENV` holds an unknown mode.
    """
    tensors = {e.key: _digestible_tensors(digested(e, accelerator, (states or {}).get(e.key)))
               for e in digestible(entries, accelerator)}
    tensors = {k: v for k, v in tensors.items() if v}
    sampling = _sampling(t for ts in tensors.values() for t in ts.values())
    if sampling is None or not tensors:
        return None
    objects = {}
    for key, named in tensors.items():
        sums = sd.digests(named, sampling)
        objects[key] = {path: f"{_dtype(t)}:{sums[path]}" for path, t in named.items()}
    return StateDigest(algorithm=sd.ALGORITHM, sampling=sampling.to_json(), objects=objects)


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _widens(saved: torch.dtype, live: torch.dtype) -> bool:
    """Whether every value of ``saved`` is exactly a value of ``live`` (bfloat16 or float16 in
    float32, float32 in float64, a narrower integer in a wider one of the same signedness)."""
    if saved.is_floating_point and live.is_floating_point:
        return torch.finfo(live).bits > torch.finfo(saved).bits and torch.finfo(live).eps <= torch.finfo(saved).eps
    if not (saved.is_floating_point or live.is_floating_point or saved.is_complex or live.is_complex
            or torch.bool in (saved, live)):
        wide, narrow = torch.iinfo(live), torch.iinfo(saved)
        return wide.min <= narrow.min and wide.max >= narrow.max
    return False


def check(
    manifest: Manifest,
    entries: list[Entry],
    url: str,
    *,
    accelerator: Any = None,
    strict: bool = False,
    left_out: Mapping[str, Iterable[str]] | None = None,
    names: Mapping[str, Mapping[str, str]] | None = None,
) -> StateVerdict:
    """Compare the live objects, as a load left them, with the checkpoint's state digest.

    Args:
        manifest: the loaded checkpoint's manifest.
        entries: the objects the load restored.
        url: the checkpoint, for messages.
        accelerator: the run's Accelerator, or None.
        strict: do not warn on a mismatch: the caller raises it (:func:`raise_mismatch`).
        left_out: per object key, the state-dict keys a ``strict=False`` load left out
            (deliberately not loaded: skipped and named).
        names: per object key, its optimizer's parameter names by state path prefix
            (:func:`optimizer_names`: ``"state.3" -> "layers.3.weight"``, so
            ``state.3.exp_avg`` is named ``exp_avg of 'layers.3.weight'``), for messages.

    Returns:
        The verdict (warned with :class:`StateCheckWarning` when it is a mismatch and not
        ``strict``; :func:`raise_mismatch` raises it when ``strict``).

    Raises:
        InvalidOptionError: :data:`MODE_ENV` holds an unknown mode.
    """
    saved = manifest.state_digest
    if saved is None or mode() == "off":
        return StateVerdict("not recorded")
    try:
        sampling = sd.Sampling.from_json(saved.sampling)
    except (KeyError, TypeError, ValueError):
        return StateVerdict("not recorded")
    verdict = StateVerdict("verified", sampled=not sampling.is_full)
    mismatched: dict[str, str] = {}
    for entry in digestible(entries, accelerator):
        recorded = saved.objects.get(entry.key)
        if not recorded:
            continue
        live = digested(entry, accelerator)
        skipped = {str(k) for k in (left_out or {}).get(entry.key, ())}
        what = f"{entry.kind} {entry.key!r}"
        parameters = (names or {}).get(entry.key)
        compared: dict[str, torch.Tensor] = {}
        for path, value in recorded.items():
            dtype, _, digest = value.partition(":")
            tensor = live.get(path)
            if tensor is not None and tensor.device.type == "meta":  # offloaded: the weights live elsewhere
                verdict.deliberate.append((what, path, "offloaded (meta on the live object), not compared"))
                continue
            if tensor is None:
                if path in skipped:
                    verdict.deliberate.append((what, path, "not loaded (strict=False)"))
                else:
                    mismatched[f"{entry.key}:{path}"] = "saved, but the live object has no such tensor after the load"
                    verdict.differences.append(f"{what}: {_named(path, parameters)} is missing after the load")
                continue
            if _dtype(tensor) != dtype:
                try:
                    cast = tensor.to(getattr(torch, dtype))
                except (AttributeError, TypeError, RuntimeError):
                    verdict.deliberate.append((what, path, f"loaded as {_dtype(tensor)} (saved {dtype}), not compared"))
                    continue
                if sd.tensor_digest(cast, sampling) != digest:
                    if _widens(getattr(torch, dtype), tensor.dtype):  # lossless: the values themselves differ
                        mismatched[f"{entry.key}:{path}"] = f"loaded as {_dtype(tensor)} (saved {dtype}), other values"
                        verdict.differences.append(f"{what}: {_named(path, parameters)} loaded as {_dtype(tensor)} (saved "
                                                   f"{dtype}) differs from the saved state after the cast back")
                    else:
                        verdict.deliberate.append(
                            (what, path, f"loaded as {_dtype(tensor)} (saved {dtype}), a narrowing cast, not compared"))
                    continue
                verdict.deliberate.append((what, path, f"loaded as {_dtype(tensor)} (saved {dtype}), equal after the cast back"))
                verdict.compared += 1
                continue
            compared[path] = tensor
        sums = sd.digests(compared, sampling)
        for path, tensor in compared.items():
            verdict.compared += 1
            _, _, digest = recorded[path].partition(":")
            if sums[path] != digest:
                zeros = " is all zeros," if bool((tensor == 0).all()) else ""
                mismatched[f"{entry.key}:{path}"] = f"saved digest {digest}, live {sums[path]}"
                verdict.differences.append(
                    f"{what}: {_named(path, parameters)}{zeros} differs from the saved state (saved digest {digest}, "
                    f"live {sums[path]})")
    verdict.mismatched = mismatched
    if verdict.differences:
        verdict.verdict = "mismatch"
        if not strict:
            warn_user(f"{url}: state check after the load: {_listed(verdict)}", StateCheckWarning)
    else:  # (at DEBUG: a save and a load log one INFO line each; the verdict is in the next manifest)
        logger.debug("state check of %s: %s", url, verdict.detail)
    return verdict


def _listed(verdict: StateVerdict) -> str:
    shown = "; ".join(verdict.differences[:10]) + (
        f"; ... ({len(verdict.differences) - 10} more)" if len(verdict.differences) > 10 else "")
    return f"{len(verdict.differences)} tensor(s) differ from the state saved: {shown}"


def raise_mismatch(verdict: StateVerdict, url: str) -> None:
    """Raise a mismatch verdict of a ``strict_resume`` load (after it was recorded for the
    next save's ``resume_audit``).

    Args:
        verdict: :func:`check`'s verdict.
        url: the checkpoint, for the message.

    Raises:
        StateMismatchError: the verdict is a mismatch; ``mismatched`` maps
            ``"<object>:<tensor path>"`` to the saved and live digests. The load completed:
            the objects hold what it loaded.
    """
    if verdict.verdict != "mismatch":
        return
    error = StateMismatchError(
        f"{url} after the load (the state check; the load completed, the objects hold what it loaded)",
        reason=_listed(verdict))
    error.mismatched = dict(verdict.mismatched)
    raise error


def _named(path: str, parameters: Mapping[str, str] | None) -> str:
    """An optimizer state path as people name it: ``state.3.exp_avg`` is ``exp_avg of
    'layers.3.weight'`` (``parameters``: :func:`optimizer_names`); any other path as it is."""
    kind, _, rest = path.partition(".")
    index, _, slot = rest.partition(".")
    name = (parameters or {}).get(f"{kind}.{index}") if kind == "state" and slot else None
    return f"{slot} of {name!r}" if name is not None else path


def optimizer_names(optimizer: Any, parameter_names: Mapping[int, str]) -> dict[str, str]:
    """``"state.<i>" -> "<parameter name>"`` for every parameter of one optimizer
    (``torch.optim.Optimizer.state_dict`` numbers them in group order), whether or not it
    holds state now: a state the load dropped is named after its parameter too. One
    optimizer's map: another numbers its own parameters from 0 as well.

    Args:
        optimizer: the optimizer (an ``AcceleratedOptimizer`` is unwrapped).
        parameter_names: ``id(parameter) -> name``
            (:func:`statekit.engine.optimizer_fit.parameter_names`).

    Returns:
        The parameter name of each state path prefix.
    """
    optimizer = getattr(optimizer, "optimizer", optimizer)
    out: dict[str, str] = {}
    index = 0
    for group in getattr(optimizer, "param_groups", []):
        for p in group["params"]:
            name = parameter_names.get(id(p))
            if name is not None:
                out[f"state.{index}"] = name
            index += 1
    return out


__all__ = ["MODES", "MODE_ENV", "StateVerdict", "check", "digestible", "digested", "optimizer_names", "raise_mismatch",
           "record"]
