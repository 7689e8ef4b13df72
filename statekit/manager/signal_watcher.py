"""The save on a signal from anywhere in the loop: a watcher thread saves the last step
boundary's state the moment the signal arrives, when nothing has changed it since.

Python runs a signal handler on the main thread between two bytecodes: while that thread
sits in C code (a long ``no_grad`` evaluation, a data loader waiting for its workers, a
``torch.compile`` warm-up), the handler waits, and so would a save at the next
``step_boundary``. :class:`SignalWatcher` sets ``signal.set_wakeup_fd`` to one end of a
socket pair: CPython's C-level handler writes the signal's number there at once, and the
watcher thread, blocked on the other end, wakes (https://docs.python.org/3/library/signal.html#signal.set_wakeup_fd).
An fd set before (an asyncio loop's self-pipe) keeps receiving every byte: the watcher
forwards them (a loop that later resets the wakeup fd turns the watcher off; the next safe
point still saves); an earlier manager's watcher's fd is not forwarded to (only the newest
manager's watcher acts).

On the first signal (:meth:`SignalWatcher.act`):

1. the step barrier holds every optimizer step from now on (:mod:`statekit.engine.step_barrier`);
2. the main thread's manager call, if it is in one (a save, a step boundary), ends first
   (their collectives must not run beside the watcher's); the last boundary's
   :class:`~statekit.engine.moment.Moment` (a save records one too) is clean when no tensor
   it references has changed (``changed()`` is empty) and no async save is still writing;
3. the ranks agree on it (:func:`statekit.distributed.watchers_agree`: same step, all
   clean, within its timeout);
4. agreed: the moment is saved, blocking, from this thread (the tensors live, everything
   else as of the boundary: data position and random states are the boundary's); its
   tensors are checked again after the files are written, before the commit; then the
   tiers' copies are waited for within the grace, and the run exits with ``128 + signum``
   (``os._exit`` after flushing stdio and the log handlers: the main thread may be in a C
   call and cannot be asked to raise) or ``should_stop`` turns True;
5. not agreed, or changed before the commit (nothing committed): the next safe point saves
   as without a watcher. ``SignalSave.result["path"]`` and the log say which happened.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

from statekit import distributed
from statekit.devices import no_rng_guard
from statekit.engine import step_barrier
from statekit.engine.moment import Moment, MomentChangedError, resolve
from statekit.errors import StatekitError

logger = logging.getLogger(__name__)

_OURS: set[int] = set()  # the send ends of the live watchers' socket pairs (wakeup fds statekit set)


class SignalWatcher:
    """The watcher thread of one :class:`~statekit.manager.preemption.SignalSave`.

    Args:
        signal_save: the manager's save-on-signal state (its ``moment``, ``lock``,
            ``manager``, ``policy``).
    """

    def __init__(self, signal_save: Any) -> None:
        self.signal_save = signal_save
        self.deliveries = 0
        """Signals of ``save_on_signal`` the watcher saw arrive (each delivery, also while the
        main thread's handler has not run yet)."""
        self.outcome: str | None = None
        """None until the first signal; then ``"saved"`` (from the watcher), ``"committed"``
        (the boundary's step was committed already), ``"fell-back"``, or ``"safe-point"``
        (a safe point acted on the signal while the watcher waited for the main thread)."""
        self.reason: str | None = None
        """Why the watcher fell back (a sentence), or None."""
        self.finished = threading.Event()
        """Set once the watcher acted on the first signal (saved or fell back)."""
        self._numbers = {int(s) for s in signal_save.signals}
        self._recv: socket.socket | None = None
        self._send: socket.socket | None = None
        self._chained = -1
        self._forward = False
        self._thread: threading.Thread | None = None
        self.resolved: Moment | None = None

    # ------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Set the wakeup fd and start the thread (main thread; idempotent).

        Raises:
            InvalidOptionError: not called from the main thread (``set_wakeup_fd`` refuses).
        """
        if self._send is not None:
            return
        self._recv, self._send = socket.socketpair()
        self._send.setblocking(False)  # set_wakeup_fd wants a non-blocking fd
        self._chained = signal.set_wakeup_fd(self._send.fileno(), warn_on_full_buffer=False)
        _OURS.add(self._send.fileno())
        self._forward = self._chained != -1 and self._chained not in _OURS
        if self._chained != -1 and not self._forward:  # an earlier manager's watcher: it does not act for this one
            logger.info("save_on_signal: the wakeup fd was another manager's watcher's; this manager's watcher "
                        "takes the signals (the other manager's handlers still record them)")
        elif self._chained != -1:
            logger.info("save_on_signal: a wakeup fd was set already (fd %d, an event loop's?): the watcher forwards "
                        "every signal byte to it", self._chained)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, args=(self._recv,), name="statekit-signal-watcher",
                                            daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Put the previous wakeup fd back (where ours is still set) and end the thread."""
        if self._send is None:
            return
        current = signal.set_wakeup_fd(self._chained, warn_on_full_buffer=False)
        if current != self._send.fileno():  # someone replaced ours since: leave theirs
            signal.set_wakeup_fd(current, warn_on_full_buffer=False)
        _OURS.discard(self._send.fileno())
        try:
            self._send.send(b"\0")  # byte 0: no signal, the thread's cue to end
        except OSError:
            pass
        self._send.close()
        self._send = None
        self._thread = None

    def _run(self, recv: socket.socket) -> None:
        try:
            while True:
                data = recv.recv(256)
                if not data:
                    return
                if self._forward:
                    try:
                        os.write(self._chained, data)
                    except OSError:  # the previous owner closed it
                        self._forward = False
                for number in data:
                    if number == 0:
                        return
                    if number in self._numbers:
                        self.deliveries += 1
                        if self.deliveries == 1:
                            self.act(signal.Signals(number), time.monotonic())
        except Exception:  # noqa: BLE001 - the thread must not die silently; the next safe point saves
            logger.exception("save_on_signal: the signal watcher failed; the next safe point saves")
        finally:
            recv.close()

    # ------------------------------------------------------------- the save

    def act(self, signum: signal.Signals, at: float) -> None:
        """Save the last boundary's state if every rank can, else leave it to the next safe
        point (see the module docstring). Runs on the watcher thread.

        Args:
            signum: the signal.
            at: ``time.monotonic()`` when the watcher woke.
        """
        s = self.signal_save
        if s.received is None:  # the main thread's handler may not have run yet
            s.received, s.received_at = signum, at
        # the main thread inside a manager call (a save, a resume): its collectives end first; a save
        # records its step's state on the way out, which this save then finds committed
        owned = s.lock.acquire(timeout=max(0.0, s.grace_s - (time.monotonic() - at) - (s._estimate() or 0.0)))
        if owned and (s.should_stop or s.result is not None):  # a safe point acted on it while the watcher waited
            s.lock.release()
            self.outcome = "safe-point"
            self.finished.set()
            return
        reading = step_barrier.begin_reading(f"save on {signum.name} from the watcher")
        saved = False
        try:
            moment = s.moment
            reason = self._unclean(owned, moment, at)
            if reason is not None:
                reading.done()  # training goes on while the ranks agree to fall back
            step = moment.step if moment is not None else -1
            if not distributed.watchers_agree(step, reason is None):
                self._fall_back(reason or "another rank could not save its boundary (or did not answer in "
                                f"{distributed.SIGNAL_AGREE_TIMEOUT_SECONDS:g} s)", signum, at)
                return
            saved = self._save(self.resolved, signum, at)
            if saved and s.on_signal == "exit":  # still holding the optimizer steps: the run ends at the commit
                if s.policy.before_exit is not None:
                    try:
                        s.policy.before_exit(dict(s.result))
                    except Exception:  # noqa: BLE001 - the process ends regardless: the checkpoint is committed
                        logger.exception("save_on_signal: PreemptionPolicy.before_exit failed; exiting anyway")
                _exit_now(s.result["exit_code"])
        finally:
            reading.done()
            if owned:
                s.lock.release()
            self.finished.set()

    def _unclean(self, owned: bool, moment: Any, at: float) -> str | None:
        """Why this rank cannot save the boundary from the watcher, or None."""
        s = self.signal_save
        if not owned:
            return "the main thread stayed inside a manager call (a save, a resume) past the grace"
        if moment is None:
            return "no step boundary was recorded yet"
        if s.capture_error is not None:
            return f"the last boundary's state could not be taken ({s.capture_error})"
        changed = moment.changed(limit=3)
        if changed:
            return f"{', '.join(changed)} changed since step {moment.step}"
        pending = s.manager.pending
        if pending is not None:
            bound = s.grace_s - (time.monotonic() - at) - (s._estimate() or 0.0)
            started = time.monotonic()
            done = pending.join(max(0.0, bound))
            s.watcher_in_flight_wait = time.monotonic() - started  # the safe point's warning counts it
            if not done:
                return f"the async save of step {s.manager.pending_step} is still writing"
        changed = moment.changed(limit=3)  # again: the wait for the save in flight took a while
        if changed:
            return f"{', '.join(changed)} changed since step {moment.step}"
        try:
            self.resolved = resolve(moment, s.entries(), s.manager.accelerator)
        except MomentChangedError as exc:
            if "not the tensor" in str(exc) or "is gone" in str(exc):
                s.index.stale = True  # the next boundary indexes the tensors again
            return str(exc)
        return None

    def _save(self, moment: Any, signum: signal.Signals, at: float) -> bool:
        """Commit the moment (or find it committed); False: fell back (nothing committed)."""
        s = self.signal_save
        where = main_thread_doing()
        committed = s.last_committed == moment.step
        s.deadline = at + s.grace_s
        try:
            if not committed:
                with no_rng_guard():  # the generators are the main thread's: a guard would rewind them
                    s.manager.save_moment(moment)
        except MomentChangedError as exc:
            self._fall_back(str(exc), signum, at)
            return False
        except StatekitError as exc:  # the next safe point tries again
            self._fall_back(f"the save from the watcher failed: {exc}", signum, at)
            return False
        seconds = time.monotonic() - at
        url = s.manager.url_for(moment.step)
        self.outcome = "committed" if committed else "saved"
        path = (f"saved from the watcher at step {moment.step} while the main thread was {where}" if not committed
                else f"step {moment.step} was committed already (signal while the main thread was {where})")
        logger.warning("save_on_signal: %s: %s, committed at %s, %.2f s after the signal (grace %g s)",
                       signum.name, path, url, seconds, s.grace_s)
        copied = s.wait_for_tiers(moment.step, url, at)
        s.result = {"signal": signum.name, "step": moment.step, "url": url, "seconds": seconds, "grace_s": s.grace_s,
                    "saved": True, "in_flight": None, "replicated": copied,
                    "total_seconds": time.monotonic() - at, "path": path, "from_watcher": True,
                    "exit_code": 128 + int(signum), "boundary_seconds": moment.seconds}
        s.should_stop = True
        s.last_committed = moment.step
        if s.deadline is not None:
            for tier in s.manager.tiers():
                tier.exit_by(s.deadline)
        return True

    def _fall_back(self, reason: str, signum: signal.Signals, at: float) -> None:
        self.outcome, self.reason = "fell-back", reason
        self.signal_save.fallback = f"fell back: {reason}; the next step boundary saves"
        logger.warning("save_on_signal: %s: %s (%.2f s after the signal)", signum.name,
                       self.signal_save.fallback, time.monotonic() - at)


def main_thread_doing() -> str:
    """Where the main thread is, for the log: its innermost frame, and the innermost one
    outside the standard library, torch and statekit (``"in evaluate (train.py:41)"``)."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return "not running"
    inner = frame
    library = (os.path.dirname(os.__file__), os.path.dirname(distributed.__file__), "site-packages", "dist-packages")
    user = frame
    while user is not None and any(part in user.f_code.co_filename for part in library):
        user = user.f_back
    text = f"in {inner.f_code.co_name} ({os.path.basename(inner.f_code.co_filename)}:{inner.f_lineno})"
    if user is not None and user is not inner:
        text += f", called from {user.f_code.co_name} ({os.path.basename(user.f_code.co_filename)}:{user.f_lineno})"
    return text


def _exit_now(code: int) -> None:
    """End the process from the watcher thread with ``code``: the log handlers and stdio
    flushed, then ``os._exit`` (``SystemExit`` would end this thread only, and the main thread
    may sit in a C call for as long as the grace lasts; atexit handlers do not run: the
    checkpoint and the tiers' copies were waited for already)."""
    for handler in list(logging.getLogger().handlers) + list(logging.getLogger("statekit").handlers):
        try:
            handler.flush()
        except Exception:  # noqa: BLE001 - exiting regardless
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    _end_daemonic_children()
    os._exit(code)


def _end_daemonic_children(join_s: float = 1.0) -> None:
    """Terminate this process's daemonic ``multiprocessing`` children (DataLoader workers),
    as ``multiprocessing``'s own exit function does at a normal exit: ``os._exit`` skips it,
    and a worker stuck in a stalled read would outlive the run, holding its stdout open."""
    import multiprocessing

    children = [p for p in multiprocessing.active_children() if p.daemon]
    for child in children:
        try:
            child.terminate()
        except Exception:  # noqa: BLE001 - exiting regardless
            pass
    deadline = time.monotonic() + join_s
    for child in children:
        child.join(max(0.0, deadline - time.monotonic()))
