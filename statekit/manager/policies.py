"""The :class:`~statekit.CheckpointManager`'s options, grouped as users think of them:
which checkpoints to keep (:class:`RetentionPolicy`), how saves run in the background
(:class:`AsyncPolicy`) and what a preemption signal does (:class:`PreemptionPolicy`).

Each group is a frozen dataclass that checks its values when built, so a bad value is an
:class:`~statekit.InvalidOptionError` at the user's line, before a manager exists. The
grouping follows Orbax's ``CheckpointManagerOptions`` and Lightning's ``ModelCheckpoint``
(https://orbax.readthedocs.io/en/latest/api_reference/checkpoint.checkpoint_manager.html);
the manager takes one keyword per group, its shortcut or the group (``keep_last=3`` or
``retention=``, ``async_save=True`` or ``AsyncPolicy``, ``save_on_signal=True`` or
``PreemptionPolicy``: :func:`manager_policies`). A plugin's manager options are its own
(``docs/hooks.md``).
"""

from __future__ import annotations

import math
import signal
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from statekit.engine.budget import check_host_memory_budget
from statekit.errors import InvalidOptionError

BACKPRESSURE_POLICIES = ("wait", "skip")
"""The values of :attr:`AsyncPolicy.backpressure`."""

DEFAULT_MAX_WAIT_SECONDS = 300.0
"""Default bound of the ``"wait"`` policy, seconds: half the NCCL watchdog's default (600 s),
so a save waiting on slow storage never gets a multi-GPU job killed."""

DEFAULT_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR1)
"""The signals ``save_on_signal=True`` handles: SIGTERM (Kubernetes, spot instances,
torchrun's launcher forwarding its own SIGTERM, SLURM's end of job) and SIGUSR1 (SLURM's
``--signal=USR1@<seconds>``)."""

DEFAULT_GRACE_S = 30.0
"""The grace period assumed without ``grace_s``: Kubernetes' default
``terminationGracePeriodSeconds`` and how long torchrun waits for its workers after
forwarding a SIGTERM before it sends SIGKILL."""

ON_SIGNAL = ("exit", "return")
"""The values of :attr:`PreemptionPolicy.on_signal`."""


def _positive_int_or_none(name: str, value: Any) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise InvalidOptionError(f"{name} must be a positive integer or None, got {value!r}")


@dataclass(frozen=True)
class RetentionPolicy:
    """Which committed checkpoints a manager keeps: a checkpoint is kept if *any* policy
    keeps it; the others are deleted (manifest first) right after a new checkpoint commits.
    With no policy set (the default), every checkpoint is kept.

    Args:
        keep_last: keep the newest N committed checkpoints (None: no such policy).
        keep_best: keep the best K by ``metrics[monitor]`` given to ``save()``
            (checkpoints without that metric never count as best).
        monitor: the metric name for ``keep_best``.
        mode: ``"min"`` or ``"max"``: which direction of ``monitor`` is better.
        keep_every_n_steps: keep checkpoints whose step is a multiple of M.

    Raises:
        InvalidOptionError: a count is not a positive integer or None, or ``mode`` is not
            ``"min"``/``"max"``.
    """

    keep_last: int | None = None
    keep_best: int | None = None
    monitor: str = "loss"
    mode: str = "min"
    keep_every_n_steps: int | None = None

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_best", "keep_every_n_steps"):
            _positive_int_or_none(name, getattr(self, name))
        if self.mode not in ("min", "max"):
            raise InvalidOptionError(f"mode must be 'min' or 'max', got {self.mode!r}")
        if not isinstance(self.monitor, str) or not self.monitor:
            raise InvalidOptionError(f"monitor must be a metric name (a non-empty str), got {self.monitor!r}")

    @property
    def keeps_all(self) -> bool:
        """True when no policy is set: nothing is ever deleted."""
        return self.keep_last is None and self.keep_best is None and self.keep_every_n_steps is None

    @property
    def keeps_resumed(self) -> bool:
        """True: the checkpoint this process resumed from is kept while it runs, whatever the
        policies say (the default; a run's own starting point stays until the next run).
        A policy that mirrors another tool's rotation exactly (statekit-transformers'
        ``save_total_limit``) returns False."""
        return True

    def kept(self, committed: list[Any]) -> set[str]:
        """The URLs the policies keep of ``committed`` (the manager adds the newest, the
        resumed-from one (see :attr:`keeps_resumed`) and the plugins' vetoes).

        Args:
            committed: :class:`~statekit.CheckpointDir` of the committed checkpoints, oldest
                step first.

        Returns:
            Their URLs that at least one policy keeps.
        """
        keep: set[str] = set()
        if self.keep_last is not None:
            keep |= {i.url for i in committed[-self.keep_last :]}
        if self.keep_every_n_steps is not None:
            keep |= {i.url for i in committed if i.step % self.keep_every_n_steps == 0}
        if self.keep_best is not None:
            scored = [i for i in committed if isinstance((i.metrics or {}).get(self.monitor), (int, float))]
            scored.sort(key=lambda i: i.metrics[self.monitor], reverse=self.mode == "max")
            keep |= {i.url for i in scored[: self.keep_best]}
        return keep


@dataclass(frozen=True)
class AsyncPolicy:
    """How a manager's saves run in the background (``docs/backpressure.md``).

    Args:
        enabled: the default of ``save(blocking=...)``: True saves return once the state
            is staged in host memory and write on a background thread.
        backpressure: what ``save()`` does while the previous background save is still
            writing: ``"wait"`` up to ``max_wait_s``, then skip this save; ``"skip"`` it at
            once. A skipped save warns with its step and is counted in ``stats()``.
        max_wait_s: the bound of ``"wait"``, seconds (default 300, half the NCCL
            watchdog's 600; None: wait as long as it takes).
        host_memory_budget: the most host memory an async save's staging holds: bytes
            (int, at least 64 KiB) or a fraction of the state (float in (0, 1]); None
            (default): one buffer the size of the state, kept between saves (the shortest
            save; ``docs/concepts.md``, Async saves).

    Raises:
        InvalidOptionError: ``enabled`` is not a bool, an unknown ``backpressure``, a
            bound that is not a finite number >= 0 or None, or a budget that is not one of
            the above (the message names the value).
    """

    enabled: bool = True
    backpressure: str = "wait"
    max_wait_s: float | None = DEFAULT_MAX_WAIT_SECONDS
    host_memory_budget: int | float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise InvalidOptionError(f"AsyncPolicy.enabled (async_save=) must be True or False, got {self.enabled!r}")
        if self.backpressure not in BACKPRESSURE_POLICIES:
            raise InvalidOptionError(f"backpressure must be one of {BACKPRESSURE_POLICIES}, got {self.backpressure!r}")
        wait = self.max_wait_s
        if wait is not None and (isinstance(wait, bool) or not isinstance(wait, (int, float))
                                 or not math.isfinite(wait) or wait < 0):
            raise InvalidOptionError(f"max_wait_s must be a finite number of seconds >= 0 or None, got {wait!r}")
        check_host_memory_budget(self.host_memory_budget, "AsyncPolicy.host_memory_budget")


@dataclass(frozen=True)
class PreemptionPolicy:
    """Save on a preemption signal (``docs/clusters.md``). The handlers only record the
    signal; the next safe point (``step_boundary()``, ``save()``,
    ``CheckpointHook.on_step_end``) saves that step blocking, every rank agreeing, then
    acts as ``on_signal`` says.

    Args:
        signals: True (SIGTERM and SIGUSR1), or signals: ``signal.SIGUSR2``, an int, a
            name (``"USR1"``), or an iterable of them; normalised to a tuple of
            ``signal.Signals``.
        grace_s: seconds between the signal and the kill (default 30, Kubernetes'
            ``terminationGracePeriodSeconds``); a save estimated to end past it warns.
        on_signal: ``"exit"``: after the commit raise ``SystemExit(128 + signal number)``;
            ``"return"``: ``step_boundary()`` returns True and ``should_stop`` is True.
        check_every: with several ranks, agree on the signal (one all-reduce of one int
            on statekit's gloo group) every N-th step boundary (default 1: every step;
            ``docs/clusters.md``); every rank must give the same N.
        watcher: True (default): a watcher thread, woken by the signal even while the
            main thread is in an evaluation, a stalled data loader or a compile, saves the
            last step boundary's state when its version counters prove nothing changed it
            (:mod:`statekit.manager.signal_watcher`); else, and with False, the next safe
            point saves. Every rank must give the same value.
        before_exit: with ``on_signal="exit"``, ``callable(result)`` called with
            :attr:`SignalSave.result <statekit.manager.preemption.SignalSave.result>` just
            before a save from the watcher ends the process (``os._exit``: no ``atexit``
            handler, no ``finally`` of the main thread runs; flush your own logs here);
            None: nothing. What it raises is logged and the process exits regardless.

    Raises:
        InvalidOptionError: a name or number that is not a signal (or SIGKILL/SIGSTOP),
            a ``grace_s`` that is not a positive number, an unknown ``on_signal``, or a
            ``check_every`` that is not a positive integer.
    """

    signals: bool | int | str | signal.Signals | Iterable[Any] = True
    grace_s: float = DEFAULT_GRACE_S
    on_signal: str = "exit"
    check_every: int = 1
    watcher: bool = True
    before_exit: Callable[[dict[str, Any]], None] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "signals", parse_signals(self.signals))
        grace = self.grace_s
        if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not grace > 0 or not math.isfinite(grace):
            raise InvalidOptionError(f"grace_s must be a positive number of seconds, got {grace!r}")
        object.__setattr__(self, "grace_s", float(grace))
        if self.on_signal not in ON_SIGNAL:
            raise InvalidOptionError(f"on_signal must be 'exit' or 'return', got {self.on_signal!r}")
        every = self.check_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise InvalidOptionError(f"PreemptionPolicy.check_every must be a positive integer, got {every!r}")
        if not isinstance(self.watcher, bool):
            raise InvalidOptionError(f"PreemptionPolicy.watcher must be True or False, got {self.watcher!r}")
        if self.before_exit is not None and not callable(self.before_exit):
            raise InvalidOptionError(f"PreemptionPolicy.before_exit must be a callable or None, got {self.before_exit!r}")


def parse_signals(value: Any) -> tuple[signal.Signals, ...]:
    """The signals of ``save_on_signal``.

    Args:
        value: True (:data:`DEFAULT_SIGNALS`), or an iterable of signals: ``signal.SIGUSR1``,
            an int, or a name (``"SIGUSR1"``, ``"USR1"``).

    Returns:
        The signals, without repeats.

    Raises:
        InvalidOptionError: a name or number is not a signal, or it cannot be handled
            (SIGKILL, SIGSTOP).
    """
    if value is True:
        return DEFAULT_SIGNALS
    if isinstance(value, (str, int)):
        value = (value,)
    try:
        items = list(value)
    except TypeError:
        raise InvalidOptionError(
            f"save_on_signal must be True, False or a tuple of signals, got {value!r}"
        ) from None
    out: list[signal.Signals] = []
    for item in items:
        try:
            if isinstance(item, str):
                name = item.upper()
                sig = signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
            else:
                sig = signal.Signals(item)
        except (KeyError, ValueError):
            raise InvalidOptionError(f"save_on_signal: {item!r} is not a signal") from None
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            raise InvalidOptionError(f"save_on_signal: {sig.name} cannot be handled by any process")
        if sig not in out:
            out.append(sig)
    if not out:
        raise InvalidOptionError("save_on_signal: an empty tuple of signals; pass False to turn it off")
    return tuple(out)


MOVED_KEYWORDS: dict[str, tuple[str, str, str | None]] = {
    **{name: ("retention", "RetentionPolicy", name) for name in ("keep_best", "monitor", "mode", "keep_every_n_steps")},
    **{name: ("async_save", "AsyncPolicy", name) for name in ("backpressure", "max_wait_s")},
    **{name: ("save_on_signal", "PreemptionPolicy", name) for name in ("grace_s", "on_signal")},
    "signal_check_every": ("save_on_signal", "PreemptionPolicy", "check_every"),
    "async_policy": ("async_save", "AsyncPolicy", None),
    "preemption": ("save_on_signal", "PreemptionPolicy", None),
}
"""Keywords the manager does not take, each a field of a group: ``{name: (the group's
keyword, its class, the field)}``, for the error that names the fix."""


def manager_policies(keep_last: int | None, retention: RetentionPolicy | None, async_save: bool | AsyncPolicy,
                     save_on_signal: Any, options: dict[str, Any]) -> tuple[RetentionPolicy, AsyncPolicy,
                                                                             PreemptionPolicy | None]:
    """The manager's three groups from its keywords (``CheckpointManager``'s arguments).

    Args:
        keep_last: the retention shortcut (None: not given).
        retention: the retention group (None: ``RetentionPolicy(keep_last=keep_last)``).
        async_save: a bool (``AsyncPolicy(enabled=async_save)``) or the group.
        save_on_signal: False or None (no handlers), True or signals
            (``PreemptionPolicy(signals=save_on_signal)``), or the group.
        options: the manager's ``**options``, checked for a keyword of :data:`MOVED_KEYWORDS`.

    Returns:
        ``(retention, async_policy, preemption)``; ``preemption`` None when no signal is handled.

    Raises:
        InvalidOptionError: ``keep_last`` and ``retention`` both given; ``retention`` not a
            ``RetentionPolicy``; a keyword of :data:`MOVED_KEYWORDS` (the message names the
            group to pass it in); a group's own errors.
    """
    for name in sorted(options.keys() & MOVED_KEYWORDS.keys()):
        keyword, cls, field = MOVED_KEYWORDS[name]
        inside = "..." if field is None else f"{field}={options[name]!r}"
        raise InvalidOptionError(f"CheckpointManager takes no {name}=: pass {keyword}=statekit.{cls}({inside})")
    if retention is None:
        retention = RetentionPolicy(keep_last=keep_last)
    elif not isinstance(retention, RetentionPolicy):
        raise InvalidOptionError(f"retention must be a statekit.RetentionPolicy, got {type(retention).__name__}")
    elif keep_last is not None:
        raise InvalidOptionError(f"keep_last={keep_last!r} and retention=RetentionPolicy(...) both set the retention; "
                                 f"pass RetentionPolicy(keep_last={keep_last!r}, ...) alone")
    async_policy = async_save if isinstance(async_save, AsyncPolicy) else AsyncPolicy(enabled=async_save)
    if save_on_signal is False or save_on_signal is None:
        preemption = None
    elif isinstance(save_on_signal, PreemptionPolicy):
        preemption = save_on_signal
    else:
        preemption = PreemptionPolicy(signals=save_on_signal)
    return retention, async_policy, preemption
