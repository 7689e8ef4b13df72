"""A step boundary's state, kept by reference: what a save of that step would write, taken
without copying a tensor, and the proof (version counters) that it still holds.

At each safe point with ``save_on_signal`` the manager takes a :class:`Moment` (:func:`capture`):
the step; the state of every entry other than models and optimizers as the save would
collect it (a scheduler's, a data loader's position, a dict, a scalar; containers rebuilt,
so a later ``scheduler.step()`` cannot change the moment's ``last_epoch``), an optimizer's
``param_groups``, the plugins' boundary states (``statekit_boundary_state``: statekit-rng's
random states), and the version counter of every tensor the save would write. The models'
and optimizers' tensors come from a :class:`TensorIndex` built from their state dicts once
and again when their tensors change (an optimizer creating its state): a boundary then only
reads ``len(tensors)`` version counters (the cost: ``bench/signal_save.py --boundary``).

A save of the moment first resolves it (:func:`resolve`): the models' and optimizers' state dicts,
taken again, must hold the very tensors the boundary recorded (same storage, same version)
and the same ``param_groups``; the data position and random states written are the
boundary's. The save checks the versions again after the tensor files are written and
before the manifest is committed (:meth:`Moment.check`). The blind spot is the version
counter's: writes through ``tensor.data``, and kernels that write a tensor without bumping
its counter (BatchNorm's running statistics: its ``num_batches_tracked``, bumped by every
training forward, is what tells) (:mod:`statekit.checks.versions`).
"""

from __future__ import annotations

import copy
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from statekit.checks import next_batch, state_check
from statekit.engine.entries import Entry, unwrap_model
from statekit.engine.write import state_of
from statekit.errors import StatekitError

_INDEXED = frozenset({"model", "optimizer"})


class MomentChangedError(StatekitError):
    """A save of a :class:`Moment` found a tensor written (or replaced) since its step
    boundary: nothing is committed (the message names the first tensors and the step)."""


@dataclass(frozen=True)
class Moment:
    """One step boundary's state by reference (see the module docstring).

    Attributes:
        step: the step that ended at the boundary.
        states: ``entry key -> state`` as the save writes it, tensors by reference; before
            :func:`resolve`, models are absent and optimizers hold ``param_groups`` only.
        plugin_states: ``plugin name -> what its statekit_boundary_state returned``.
        tensors: ``(path, tensor)`` of every tensor the save writes
            (``"model.layers.0.weight"``, ``"optimizer.state.0.exp_avg"``).
        versions: their version counters at the boundary, in the same order.
        witnesses: the data loaders' next-batch witnesses made at the capture (a save of
            the moment records them, :mod:`statekit.checks.next_batch`).
        taken_at: ``time.monotonic()`` of the capture.
        seconds: how long the capture took (seconds).
        resolved: True once :func:`resolve` filled ``states`` for every entry.
    """

    step: int
    states: Mapping[str, Any]
    plugin_states: Mapping[str, Any]
    tensors: tuple[tuple[str, torch.Tensor], ...]
    versions: tuple[int, ...]
    witnesses: tuple[Any, ...] = ()
    taken_at: float = 0.0
    seconds: float = 0.0
    resolved: bool = False

    def changed(self, limit: int | None = None) -> list[str]:
        """The paths of the tensors written in place since the boundary (their version
        counter moved), in capture order.

        Args:
            limit: stop after this many (None: all).

        Returns:
            The changed paths; empty: every tensor of the moment still holds its value.
        """
        out = []
        for (path, tensor), version in zip(self.tensors, self.versions):
            if tensor._version != version:
                out.append(path)
                if limit is not None and len(out) >= limit:
                    break
        return out

    def check(self, what: str) -> None:
        """Raise unless every tensor still holds the boundary's value.

        Args:
            what: where the check runs, for the message (``"before the commit of <url>"``).

        Raises:
            MomentChangedError: naming the first changed tensors and the step.
        """
        changed = self.changed(limit=3)
        if changed:
            raise MomentChangedError(
                f"{', '.join(changed)} changed since step {self.step} ({what}): the live state is no longer that "
                "step's; nothing is committed"
            )

    def state_for(self, key: str) -> Any:
        """The state of entry ``key`` at the boundary (after :func:`resolve` for models and
        optimizers).

        Raises:
            StatekitError: the moment holds no entry ``key`` (the run's objects changed
                since the boundary).
        """
        try:
            return self.states[key]
        except KeyError:
            raise StatekitError(f"step {self.step}'s boundary state holds no object {key!r}") from None


class TensorIndex:
    """The tensors of a run's models and optimizers by path, kept from one boundary to the
    next (the objects' ``state_dict()`` is taken when it is built, not at every boundary).
    It is built again when it is :attr:`stale`, when the entries are other objects, or when
    an optimizer's state grew or shrank (AdamW creates its moments at the first step)."""

    def __init__(self) -> None:
        self.tensors: tuple[tuple[str, torch.Tensor], ...] = ()
        self.stale = True
        """Set by the caller when a :func:`resolve` found a tensor the index does not hold."""
        self.builds = 0
        self._key: tuple[Any, ...] | None = None

    def refresh(self, entries: list[Entry], accelerator: Any = None) -> None:
        """Build the index again if needed (see the class docstring).

        Args:
            entries: the save's entries.
            accelerator: the accelerator (unwraps models), or None.
        """
        key = tuple((e.key, id(e.obj), len(getattr(e.obj, "state", ())) if e.kind == "optimizer" else 0)
                    for e in entries if e.kind in _INDEXED)
        if not self.stale and key == self._key:
            return
        tensors: list[tuple[str, torch.Tensor]] = []
        for entry in entries:
            if entry.kind in _INDEXED:
                tensors.extend(_flat(entry.key, live_state(entry, accelerator)).items())
        self.tensors, self._key, self.stale = tuple(tensors), key, False
        self.builds += 1


def live_state(entry: Entry, accelerator: Any = None) -> Any:
    """The state dict a save writes of a model or optimizer entry, now.

    Raises:
        Whatever its ``state_dict()`` raises.
    """
    if entry.kind == "model":
        return unwrap_model(entry.obj, accelerator).state_dict()
    return entry.obj.state_dict()


def capture(step: int, entries: list[Entry], index: TensorIndex, accelerator: Any = None,
            plugin_states: Mapping[str, Any] | None = None) -> Moment:
    """Take the :class:`Moment` of ``step`` from the entries a save would write.

    Args:
        step: the step that just ended.
        entries: the save's classified entries (:func:`statekit.engine.entries.classify`,
            the Accelerate bridge's ``collect``).
        index: the run's :class:`TensorIndex` (refreshed here when needed).
        accelerator: the accelerator (unwraps models), or None.
        plugin_states: the plugins' ``statekit_boundary_state`` results by plugin name.

    Returns:
        The moment. Cost: the state of the entries other than models and optimizers, and
        one version counter read per tensor; no tensor copied.

    Raises:
        Whatever an object's ``state_dict()`` raises.
    """
    started = time.monotonic()
    index.refresh(entries, accelerator)
    states: dict[str, Any] = {}
    small: list[tuple[str, torch.Tensor]] = []
    next_batch.claim_witnesses()  # a failed save's leftovers are not this moment's
    for entry in entries:
        if entry.plugin_only or entry.kind == "model":
            continue
        if entry.kind == "optimizer":
            states[entry.key] = {"param_groups": _freeze(_groups(entry.obj.param_groups), entry.key, small)}
        else:
            states[entry.key] = _freeze(state_of(entry), entry.key, small)
    witnesses = tuple(next_batch.claim_witnesses())
    tensors = index.tensors + tuple(small)
    versions = tuple(t._version for _, t in tensors)
    now = time.monotonic()
    return Moment(step, states, dict(plugin_states or {}), tensors, versions, witnesses, now, now - started)


def resolve(moment: Moment, entries: list[Entry], accelerator: Any = None) -> Moment:
    """The moment with the models' and optimizers' state dicts, taken now and proven to be
    the boundary's: every tensor in them is one the boundary recorded (same storage and
    shape), its version unchanged, none missing; each optimizer's ``param_groups`` equal.

    Args:
        moment: a :func:`capture` result of the same entries.
        entries: the save's entries.
        accelerator: the accelerator, or None.

    Returns:
        A resolved :class:`Moment` (``states`` for every entry; ``tensors`` the live state
        dicts' with the boundary's versions).

    Raises:
        MomentChangedError: a tensor changed, appeared or was replaced since the boundary,
            or an optimizer's ``param_groups`` differ (the message names it).
    """
    recorded = {path: (t, v) for (path, t), v in zip(moment.tensors, moment.versions)}
    states = dict(moment.states)
    tensors: list[tuple[str, torch.Tensor]] = []
    versions: list[int] = []
    seen: set[str] = set()
    for entry in entries:
        if entry.kind not in _INDEXED:
            continue
        state = live_state(entry, accelerator)
        if entry.kind == "optimizer" and not _same(_groups(state["param_groups"]),
                                                   moment.state_for(entry.key)["param_groups"]):
            raise MomentChangedError(f"{entry.key}'s param_groups changed since step {moment.step}")
        for path, tensor in _flat(entry.key, state).items():
            tensors.append((path, tensor))
            versions.append(_boundary_version(path, tensor, recorded.get(path), moment.step))
            seen.add(path)
        states[entry.key] = state
    indexed = {e.key for e in entries if e.kind in _INDEXED}
    gone = [p for p, _ in moment.tensors if p.split(".", 1)[0] in indexed and p not in seen]
    if gone:
        raise MomentChangedError(f"{gone[0]} is gone since step {moment.step}")
    small = [(pt, v) for pt, v in zip(moment.tensors, moment.versions) if pt[0].split(".", 1)[0] not in indexed]
    return replace(moment, states=states, tensors=tuple(tensors) + tuple(pt for pt, _ in small),
                   versions=tuple(versions) + tuple(v for _, v in small), resolved=True)


def _boundary_version(path: str, tensor: torch.Tensor, old: tuple[torch.Tensor, int] | None, step: int) -> int:
    """The version the boundary recorded of ``tensor``, proven unchanged since.

    Raises:
        MomentChangedError: it is not the recorded tensor (created or replaced), or it changed.
    """
    if old is None or old[0].data_ptr() != tensor.data_ptr() or old[0].shape != tensor.shape:
        raise MomentChangedError(f"{path} is not the tensor step {step}'s boundary recorded (created or replaced since)")
    if tensor._version != old[1]:
        raise MomentChangedError(f"{path} changed since step {step}")
    return old[1]


def _flat(key: str, state: Any) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    state_check.flatten(state, key, out)
    return out


def _groups(groups: Any) -> list[dict[str, Any]]:
    """An optimizer's param_groups without their params (live groups hold tensors, a state
    dict's hold indices)."""
    return [{k: v for k, v in g.items() if k != "params"} for g in groups]


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except RuntimeError:  # a tensor among the values (a capturable optimizer's lr): compared as changed
        return False


def _freeze(value: Any, path: str, tensors: list[tuple[str, torch.Tensor]]) -> Any:
    """``value`` with its containers rebuilt and its tensors kept (recorded by path)."""
    if isinstance(value, torch.Tensor):
        tensors.append((path, value))
        return value
    if isinstance(value, Mapping):
        frozen = {k: _freeze(v, f"{path}.{k}", tensors) for k, v in value.items()}
        if isinstance(value, OrderedDict):  # a module's state dict: its _metadata (versions) kept
            ordered = OrderedDict(frozen)
            if hasattr(value, "_metadata"):
                ordered._metadata = value._metadata  # type: ignore[attr-defined]
            return ordered
        return frozen
    if isinstance(value, list):
        return [_freeze(v, f"{path}.{i}", tensors) for i, v in enumerate(value)]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_freeze(v, f"{path}.{i}", tensors) for i, v in enumerate(value))
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    return copy.deepcopy(value)
