"""A step boundary's state, kept by reference: what a save of that step would write, taken
without copying a tensor, and the proof (version counters) that it still holds.

At each safe point with ``save_on_signal`` the manager takes a :class:`Moment`: the step,
every entry's state dict as the save would collect it (a model's ``state_dict()``, an
optimizer's, a scheduler's, a data loader's position, a dict, a scalar), the plugins'
boundary states (``statekit_boundary_state``: statekit-rng's random states) and the version
counter of every tensor those state dicts reference. Containers are rebuilt (a later
``scheduler.step()`` cannot change the moment's ``last_epoch``); tensors are not copied:
they are the live ones, and :meth:`Moment.changed` names those written since (an optimizer
step, a BatchNorm forward in training mode, gradients accumulated in place).
A save handed the moment (``save_objects(..., moment=...)``, the save on a signal from the
watcher thread, :mod:`statekit.manager.signal_watcher`) writes these states, so its data
position and random states are the boundary's while its tensors are proven to be; it
checks again after the tensor files are written and before the manifest is committed
(:meth:`Moment.check`). The blind spot is the version counter's: writes through
``tensor.data`` (:mod:`statekit.checks.versions`).
"""

from __future__ import annotations

import copy
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from statekit.checks import next_batch
from statekit.engine.entries import Entry, unwrap_model
from statekit.engine.write import state_of
from statekit.errors import StatekitError


class MomentChangedError(StatekitError):
    """A save of a :class:`Moment` found a tensor written since its step boundary: nothing
    is committed (the message names the first tensors and the step)."""


@dataclass(frozen=True)
class Moment:
    """One step boundary's state by reference (see the module docstring).

    Attributes:
        step: the step that ended at the boundary.
        states: ``entry key -> state dict`` as the save writes it (tensors by reference,
            containers rebuilt).
        plugin_states: ``plugin name -> what its statekit_boundary_state returned``.
        tensors: ``(path, tensor, version)`` of every tensor in ``states``
            (``"model.layers.0.weight"``, ``"optimizer.state.0.exp_avg"``).
        witnesses: the data loaders' next-batch witnesses made at the capture (a save of
            the moment records them, :mod:`statekit.checks.next_batch`).
        taken_at: ``time.monotonic()`` of the capture.
        seconds: how long the capture took (seconds).
    """

    step: int
    states: Mapping[str, Any]
    plugin_states: Mapping[str, Any]
    tensors: tuple[tuple[str, torch.Tensor, int], ...]
    witnesses: tuple[Any, ...] = ()
    taken_at: float = 0.0
    seconds: float = 0.0
    keys: tuple[str, ...] = field(default=())

    def changed(self, limit: int | None = None) -> list[str]:
        """The paths of the tensors written since the boundary (in place: their version
        counter moved), in capture order.

        Args:
            limit: stop after this many (None: all).

        Returns:
            The changed paths; empty: every tensor of the moment still holds its value.
        """
        out = []
        for path, tensor, version in self.tensors:
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
                f"{', '.join(changed)} changed since step {self.step}'s boundary ({what}): the live state is no "
                "longer that step's; nothing is committed"
            )

    def state_for(self, key: str) -> Any:
        """The state dict of entry ``key`` at the boundary.

        Raises:
            StatekitError: the moment holds no entry ``key`` (the run's objects changed
                since the boundary).
        """
        try:
            return self.states[key]
        except KeyError:
            raise StatekitError(f"step {self.step}'s boundary state holds no object {key!r}") from None


def capture(step: int, entries: list[Entry], accelerator: Any = None,
            plugin_states: Mapping[str, Any] | None = None) -> Moment:
    """Take the :class:`Moment` of ``step`` from the entries a save would write.

    Args:
        step: the step that just ended.
        entries: the save's classified entries (:func:`statekit.engine.entries.classify`,
            the Accelerate bridge's ``collect``).
        accelerator: the accelerator (unwraps models), or None.
        plugin_states: the plugins' ``statekit_boundary_state`` results by plugin name.

    Returns:
        The moment. Cost: one ``state_dict()`` per entry, no tensor copied (the bench:
        ``bench/signal_save.py --boundary``).

    Raises:
        Whatever an object's ``state_dict()`` raises.
    """
    started = time.monotonic()
    states: dict[str, Any] = {}
    tensors: list[tuple[str, torch.Tensor, int]] = []
    next_batch.claim_witnesses()  # a failed save's leftovers are not this moment's
    for entry in entries:
        if entry.plugin_only:
            continue
        raw = unwrap_model(entry.obj, accelerator).state_dict() if entry.kind == "model" else state_of(entry)
        states[entry.key] = _freeze(raw, entry.key, tensors)
    witnesses = tuple(next_batch.claim_witnesses())
    now = time.monotonic()
    return Moment(step, states, dict(plugin_states or {}), tuple(tensors), witnesses, now, now - started,
                  tuple(states))


def _freeze(value: Any, path: str, tensors: list[tuple[str, torch.Tensor, int]]) -> Any:
    """``value`` with its containers rebuilt and its tensors kept (recorded with their version)."""
    if isinstance(value, torch.Tensor):
        tensors.append((path, value, value._version))
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
