"""Hold the next optimizer step while something still reads the live state.

A save that reads tensors after its call returned (an async save staging under a host-memory
budget, a save on a signal from a watcher thread) needs the tensors unchanged until it has
read them. In a training loop the writer of parameters and optimizer state is
``optimizer.step()``; one process-wide optimizer step pre-hook
(``torch.optim.optimizer.register_optimizer_step_pre_hook``) makes every step wait until
each open :class:`Reading` is done. Nothing else is held: a reader must still prove, with
version counters (:mod:`statekit.checks.versions`), that no other in-place write happened.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

logger = logging.getLogger(__name__)

_lock = threading.Condition()
_open: list[Reading] = []
_hook: list[Any] = []  # the handle of the one global pre-hook, once installed


class Reading:
    """One reader of the live state that optimizer steps wait for, from
    :func:`begin_reading` until :meth:`done` (call it in a ``finally``: a reader that never
    ends blocks training).

    Args:
        label: what reads, for the log (``"async save of step 40"``).
    """

    def __init__(self, label: str) -> None:
        self.label = label
        self.waited_s = 0.0
        """Seconds optimizer steps spent waiting for this reader."""

    def done(self) -> None:
        """End the reading: steps waiting for it go on (idempotent)."""
        with _lock:
            if self in _open:
                _open.remove(self)
                _lock.notify_all()

    @property
    def open(self) -> bool:
        """True until :meth:`done`."""
        with _lock:
            return self in _open


def begin_reading(label: str) -> Reading:
    """Hold every optimizer step of this process from now until the returned reading is done.

    Args:
        label: what reads (logged when a step waits for it).

    Returns:
        The open :class:`Reading`.
    """
    with _lock:
        if not _hook:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            _hook.append(register_optimizer_step_pre_hook(_before_step))
        reading = Reading(label)
        _open.append(reading)
        return reading


def wait_for_readers(timeout: float | None = None) -> bool:
    """Block until no reading is open (what an optimizer step does).

    Args:
        timeout: at most this many seconds (None: as long as it takes).

    Returns:
        True when none is open.
    """
    with _lock:
        return _lock.wait_for(lambda: not _open, timeout)


def _before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    with _lock:
        if not _open:
            return
        waiting = list(_open)
        logger.info("optimizer step waits for %s", ", ".join(r.label for r in waiting))
        started = time.monotonic()
        _lock.wait_for(lambda: not _open)
        for reading in waiting:
            reading.waited_s += time.monotonic() - started
