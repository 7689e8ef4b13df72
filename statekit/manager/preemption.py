"""Save on a signal: a preempted run writes a committed checkpoint of the step it reached.

Clusters and spot machines end a run with a signal and a grace period (SLURM's
``--signal=USR1@90``, Kubernetes' ``terminationGracePeriodSeconds``, a spot notice).
:class:`SignalSave`, created by ``CheckpointManager(..., save_on_signal=True)``, installs
handlers that only *record* the signal (a handler interrupts arbitrary code: a save from it
could catch the optimizer mid-update). The run acts at its next *safe point*:

- :meth:`CheckpointManager.step_boundary(step) <statekit.CheckpointManager.step_boundary>`
  (the training loop calls it after each step; inside ``accelerator.accumulate`` a call
  between two optimizer steps is not a safe point, the next optimizer step's is);
- :meth:`CheckpointManager.save <statekit.CheckpointManager.save>` (the save becomes the
  signal's save, blocking);
- ``CheckpointHook.on_step_end`` (hook-based trainers).

There the ranks agree (:func:`statekit.distributed.max_over_ranks` of the signal's number: the signal may have reached
one rank only), an async save in flight is committed first (waited for at most the grace
left; still writing then: nothing is saved, the newest committed checkpoint stays latest),
the step is saved blocking
(unless it is committed already), the signal-to-commit time is logged, and the run exits
with code ``128 + signal number`` (``on_signal="exit"``) or
:attr:`CheckpointManager.should_stop` turns True (``on_signal="return"``). See
``docs/clusters.md``.

With ``PreemptionPolicy(watcher=True)`` (the default) each step boundary also records its
state by reference (:mod:`statekit.engine.moment`, a few microseconds to a millisecond), and
a watcher thread saves it the moment a signal arrives when nothing has changed it since,
without waiting for the next safe point (:mod:`statekit.manager.signal_watcher`); the safe
points above are then the fallback.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Any

from statekit import distributed
from statekit.api.bridge import collect
from statekit.engine import moment as moments
from statekit.engine.entries import classify
from statekit.engine.gradients import accumulating
from statekit.engine.live_state import is_collective
from statekit.hooks.registry import call_each, get_plugin_manager
from statekit.errors import InvalidOptionError, StatekitWarning, warn_user
from statekit.manager.policies import PreemptionPolicy
from statekit.manager.signal_watcher import SignalWatcher

logger = logging.getLogger(__name__)

def exit_code(signum: int) -> int:
    """The exit status of a run that saved on a signal and exited: ``128 + signum`` (143 for
    SIGTERM, 138 for SIGUSR1), the shell's status of a process ended by that signal, so a
    scheduler sees what it would have seen without statekit (a preempted run, not a success).

    Args:
        signum: the signal's number.

    Returns:
        The exit status.
    """
    return 128 + int(signum)


class SignalSave:
    """The save-on-signal state of one :class:`statekit.CheckpointManager`
    (its ``signal_save`` attribute; None without ``save_on_signal``).

    Handlers record the first signal's number and time and count the others; each then
    calls the handler installed before it if that was a Python function (SIG_DFL and
    SIG_IGN are not imitated: the default action of SIGTERM would end the process before
    the save). A second signal during the save is counted and does nothing else.

    Args:
        manager: the manager (its ``save``, ``accelerator``, ``tiers()`` and ``wait``).
        policy: the manager's :class:`~statekit.manager.policies.PreemptionPolicy` (checked
            there): the signals, ``grace_s`` (seconds from the signal to the kill, the
            deadline of the save), ``on_signal`` and ``check_every`` (with several ranks,
            agree on the flag every N-th safe point, one all-reduce on the gloo group).

    Raises:
        InvalidOptionError: the manager is created outside the main thread (Python runs
            signal handlers there only).
    """

    def __init__(self, manager: Any, policy: PreemptionPolicy) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise InvalidOptionError(
                "save_on_signal: create the CheckpointManager in the main thread (Python runs signal handlers "
                "only there)"
            )
        self.manager = manager
        self.policy = policy
        self.signals: tuple[signal.Signals, ...] = policy.signals  # type: ignore[assignment]
        self.grace_s = policy.grace_s
        self.on_signal = policy.on_signal
        self.received: signal.Signals | None = None
        """The first signal received (this rank), or None."""
        self.received_at: float | None = None
        self.signal_count = 0
        """Signals received by this rank (a second one during the save is counted, nothing else)."""
        self.should_stop = False
        self.deadline: float | None = None
        """Once the signal was acted on: ``time.monotonic()`` of the end of the grace period
        (the manager's ``__exit__`` and the tiers' wait at exit wait no longer)."""
        self.result: dict[str, Any] | None = None
        """After the signal's save: ``{"signal", "step", "url", "seconds", "grace_s", "saved",
        "in_flight", "replicated", "total_seconds"}`` (``seconds``: from the signal, or from
        the safe point on a rank the signal did not reach, to the (local) commit; ``saved``
        False when the step was committed already; ``replicated``: with a tier plugin,
        whether every tier's copy committed within the grace (None without);
        ``total_seconds``: to the end of the tiers' wait; ``in_flight``: None, or the step of an async save that was still writing
        when the grace ran out: then nothing was saved and ``step``/``url`` name the newest
        committed checkpoint, None if there is none; ``from_watcher``: saved by the watcher
        thread (:mod:`~statekit.manager.signal_watcher`; then also ``exit_code`` and
        ``boundary_seconds``, the record's cost); ``path``: which way, a sentence: ``"saved
        from the watcher at step 6 while the main thread was in evaluate (train.py:41)"``,
        ``"fell back: model.1.num_batches_tracked changed since step 10; saved at the step
        boundary 11"``)."""
        self.step_seconds: float | None = None
        """The longest time between two safe points seen (seconds)."""
        self._boundaries = 0
        self._last_boundary: float | None = None
        self._warned_step = False
        self._rate: float | None = None  # bytes per second of the last committed save
        self._last_bytes: int | None = None
        self._last_committed: int | None = None
        self._acting = False
        self._agreed = 0  # the signal number the ranks agreed on at the last check (0: none)
        self._in_flight_wait = 0.0
        self.watcher_in_flight_wait = 0.0
        """Seconds the watcher waited for an async save in flight before it fell back."""
        self._previous: dict[signal.Signals, Any] = {}
        self.lock = threading.RLock()
        """Held by the main thread inside a manager call and by the watcher while it saves:
        the two never run statekit's collectives at once, and a step boundary waits for the
        watcher's save."""
        self.moment: moments.Moment | None = None
        """The last step boundary's state by reference (with ``watcher``), or None."""
        self.index = moments.TensorIndex()
        """The models' and optimizers' tensors by path, kept between boundaries."""
        self._collectives: dict[int, bool] = {}
        self.capture_error: str | None = None
        """Why the last boundary's state could not be taken (the watcher then falls back)."""
        self.fallback: str | None = None
        """The watcher's fallback, a sentence (``"fell back: ... changed since step 7 ..."``), or None."""
        self.watcher: SignalWatcher | None = SignalWatcher(self) if policy.watcher else None

    def install(self) -> None:
        """Install the handlers (the manager does, once it has started: a manager whose
        start failed leaves no handler behind); :meth:`restore` puts the previous back.
        Idempotent: a signal whose handler is this one already is left as it is (an
        integration that restores at the end of each training call installs again at the next)."""
        for sig in self.signals:
            if signal.getsignal(sig) != self._handler:  # a bound method: compare, not identity
                self._previous[sig] = signal.signal(sig, self._handler)
        if self.watcher is not None:
            distributed.signal_group()  # created now, on every rank: never by the watcher thread
            self.watcher.start()

    # ------------------------------------------------------------- handlers

    def _handler(self, signum: int, frame: Any) -> None:
        self.signal_count += 1
        if self.received is None:
            self.received, self.received_at = signal.Signals(signum), time.monotonic()
        previous = self._previous.get(signal.Signals(signum))
        if callable(previous) and previous is not signal.default_int_handler:
            previous(signum, frame)

    def restore(self) -> None:
        """Put back the handlers installed before (where ours is still installed) and the
        wakeup fd; the watcher thread ends."""
        if self.watcher is not None:
            self.watcher.stop()
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._handler:  # a bound method: compare, not identity
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}

    # ------------------------------------------------------------- measurements

    def observe_commit(self, step: int, started: float, size_bytes: int) -> None:
        """Record a committed save (its step, its write rate) for the deadline estimate.

        Args:
            step: the checkpoint's step.
            started: ``time.monotonic()`` when its save began.
            size_bytes: the checkpoint's bytes.
        """
        seconds = time.monotonic() - started
        self._last_committed = step
        self._last_bytes = size_bytes
        if seconds > 0 and size_bytes > 0:
            self._rate = size_bytes / seconds

    @property
    def last_committed(self) -> int | None:
        """The step of the newest checkpoint this run committed or resumed from, or None."""
        return self._last_committed

    @last_committed.setter
    def last_committed(self, step: int | None) -> None:
        self._last_committed = step

    def resumed(self, step: int) -> None:
        """Record the step the run resumed from (committed: a signal at its boundary saves nothing new).

        Args:
            step: the step resumed from.
        """
        self._last_committed = step

    # ------------------------------------------------------------- safe points

    def at_boundary(self, step: int) -> bool:
        """A step boundary (:meth:`CheckpointManager.step_boundary`): save and stop if any
        rank has a signal.

        Returns:
            True once the run should stop (``on_signal="return"``).

        Raises:
            SystemExit: ``on_signal="exit"``, after the commit.
        """
        with self.lock:  # after the watcher's save, if one is running
            return self._at_boundary(step)

    def _at_boundary(self, step: int) -> bool:
        if self.should_stop:
            return True
        accelerator = self.manager.accelerator
        if accelerator is not None and accumulating(accelerator):
            return False  # between two optimizer steps: the window's end is the safe point
        now = time.monotonic()
        if self._last_boundary is not None:
            self._note_step_time(now - self._last_boundary)
        self._last_boundary = now
        self._boundaries += 1
        if distributed.rank_and_world_size()[1] > 1:
            if self._boundaries % self.policy.check_every:
                return False
            # the signal's number (the highest if ranks got different ones): the exit status
            self._agreed = distributed.max_over_ranks([int(self.received or 0)])[0]
            if not self._agreed:
                return self._capture(step)
        elif self.received is None:
            return self._capture(step)
        self._act(step, save=True)
        return True

    def _capture(self, step: int) -> bool:
        """Record this boundary's state by reference for the watcher (with ``watcher``);
        returns False (the run goes on)."""
        if self.watcher is None or self.received is not None:
            return False
        manager = self.manager
        try:
            entries = self.entries()
            sharded = [e.key for e in entries if e.kind == "model" and self._collective(e.obj)]
            if sharded:
                self.moment, self.capture_error = None, f"{sharded[0]} is sharded (its state dict is a collective)"
                return False
            objects = {e.key: e.obj for e in entries if e.kind != "model"}
            plugin_states = dict(call_each(get_plugin_manager(), "statekit_boundary_state", None,
                                           {"objects": objects}, guard_rng=False))
            self.moment = moments.capture(step, entries, self.index, manager.accelerator, plugin_states)
            self.capture_error = None
        except Exception as exc:  # noqa: BLE001 - a signal then saves at the next safe point, as without a watcher
            self.moment, self.capture_error = None, f"{type(exc).__name__}: {exc}"
            logger.debug("save_on_signal: step %d's boundary state not taken", step, exc_info=True)
        return False

    def entries(self) -> list[Any]:
        """The entries the manager's save writes (:class:`statekit.engine.entries.Entry`)."""
        if self.manager.accelerator is not None:
            return collect(self.manager.accelerator)
        return [classify(k, v) for k, v in self.manager.objects.items()]

    def _collective(self, model: Any) -> bool:
        known = self._collectives.get(id(model))
        if known is None:
            known = self._collectives[id(model)] = is_collective(model)
        return known

    def before_save(self) -> bool:
        """Whether the save about to run is the signal's (any rank has one); a collective.

        Returns:
            True: the manager saves blocking and then calls :meth:`after_save`.
        """
        if self._acting or self.should_stop:
            return False
        self._agreed = distributed.max_over_ranks([int(self.received or 0)])[0]  # 0: no rank got one
        return self._agreed > 0

    def after_save(self, step: int) -> None:
        """Finish the signal's save done by :meth:`CheckpointManager.save` (log, stop).

        Args:
            step: the step saved.
        """
        self._act(step, save=False)

    def after_plain_save(self, step: int) -> None:
        """A save that was not the signal's returned: the state now is ``step``'s, the
        watcher's newest boundary (a signal during the save finds it committed).

        Args:
            step: the step saved.
        """
        self._capture(step)

    def _note_step_time(self, seconds: float) -> None:
        self.step_seconds = max(self.step_seconds or 0.0, seconds)
        if seconds > self.grace_s and not self._warned_step:
            self._warned_step = True
            if self.watcher is not None:  # a stretch that changed nothing is covered: say what is not
                risk = ("a signal in such a stretch is saved by the watcher only when nothing changed the state since "
                        "the last step boundary (an evaluation under no_grad, a stalled loader); one inside training "
                        "work would be acted on after the deadline and only the newest committed checkpoint would "
                        "remain; call step_boundary() after each optimizer step")
            else:
                risk = ("a signal arriving now would be acted on after the deadline and only the newest committed "
                        "checkpoint would remain; call step_boundary() more often (inside long evaluations too)")
            warn_user(
                f"save_on_signal: {seconds:.1f} s passed between two safe points (step_boundary calls), more than "
                f"grace_s={self.grace_s:g} s: {risk}, or ask the scheduler for a longer grace period",
                StatekitWarning,
            )

    def _act(self, step: int, save: bool) -> None:
        started = time.monotonic()
        signum = self.received
        since = self.received_at if self.received_at is not None else started
        late = started - since
        if self.received is None:
            logger.info("save_on_signal: another rank received a signal; saving step %d", step)
        if late > self.grace_s:
            warn_user(
                f"save_on_signal: the safe point at step {step} came {late:.1f} s after "
                f"{signum.name if signum else 'the signal'}, past grace_s={self.grace_s:g} s (the longest time "
                f"between safe points so far: {self.step_seconds or 0:.1f} s); saving anyway, the newest "
                "committed checkpoint stays latest if the process is killed first",
                StatekitWarning,
            )
        self._acting = True
        self.deadline = since + self.grace_s
        try:
            if not self._commit_in_flight(step, since):
                return self._give_up(step, signum, since)
            saved = save and self._last_committed != step
            if saved:
                self._warn_if_too_slow(step, self.grace_s - late)
                self.manager.save(step, blocking=True)
            seconds = time.monotonic() - since  # to the (local) commit
            url = self.manager.url_for(step)
            logger.warning(
                "save_on_signal: %s: step %d committed at %s, %.2f s after the signal (grace %g s)%s",
                signum.name if signum else "signal on another rank", step, url, seconds, self.grace_s,
                "" if (saved or not save) else " (committed already)",
            )
            copied = self.wait_for_tiers(step, url, since)
        finally:
            self._acting = False
        path = "saved at the step boundary" if saved or not save else "committed already at the step boundary"
        if self.fallback:
            path = f"{self.fallback.split('; the next step boundary saves')[0]}; {path} {step}"
        self.result = {"signal": signum.name if signum else None, "step": step, "url": url, "seconds": seconds,
                       "grace_s": self.grace_s, "saved": saved or not save, "in_flight": None,
                       "replicated": copied, "total_seconds": time.monotonic() - since, "path": path,
                       "from_watcher": False}
        self._stop(signum)

    def wait_for_tiers(self, step: int, url: str, since: float) -> bool | None:
        """After the signal's local commit: wait for the tiers' copies until the deadline.

        Args:
            step: the step committed.
            url: its URL.
            since: ``time.monotonic()`` of the signal.

        Returns:
            Whether every tier's copy committed; None without a tier plugin.
        """
        tiers = self.manager.tiers()
        if not tiers:
            return None
        self.manager.wait(timeout=max(0.0, self.grace_s - (time.monotonic() - since)))
        name = url.rstrip("/").rsplit("/", 1)[-1]
        copied = all(name in tier.copied_names() for tier in tiers)
        logger.warning("save_on_signal: the tiers' copies of step %d %s, %.2f s after the signal", step,
                       "committed" if copied else "did not commit within the grace", time.monotonic() - since)
        return copied

    def remaining(self) -> float | None:
        """Seconds left of the grace period once the signal was acted on (>= 0), else None."""
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def _stop(self, signum: signal.Signals | None) -> None:
        self.should_stop = True
        if self.deadline is not None:  # the tiers' wait at interpreter exit ends with the grace
            for tier in self.manager.tiers():
                tier.exit_by(self.deadline)
        if self.on_signal == "exit":  # a rank the signal did not reach exits as the ranks that got it
            agreed = signal.Signals(self._agreed) if self._agreed else signal.SIGTERM
            raise SystemExit(exit_code(signum if signum is not None else agreed))

    def _estimate(self) -> float | None:
        """Seconds the signal's save is estimated to take (last save's bytes at its measured
        rate), or None before the first measured save."""
        if self._rate is None or self._last_bytes is None:
            return None
        return self._last_bytes / self._rate

    def _commit_in_flight(self, step: int, since: float) -> bool:
        """Wait for an async save still writing, bounded by the grace left (``grace_s``
        minus the time since the signal, minus the signal's own save's estimate); every
        rank agrees. True: none in flight, or it finished (collected, its error raised);
        False: still writing on some rank at the bound (left alone: it commits or not,
        never half: its manifest is written last)."""
        pending = self.manager.pending
        self._in_flight_wait = 0.0
        done = True
        if pending is not None:
            bound = self.grace_s - (time.monotonic() - since) - (self._estimate() or 0.0)
            started = time.monotonic()
            done = pending.join(max(0.0, bound))
            # with the watcher's wait, if it waited for this save before it fell back
            self._in_flight_wait = time.monotonic() - started + self.watcher_in_flight_wait
        if distributed.rank_and_world_size()[1] > 1:
            done = not distributed.any_rank(not done)
        if done:
            self.manager.wait_for_save()  # collect it: post-hooks, its error raised here
        return done

    def _give_up(self, step: int, signum: signal.Signals | None, since: float) -> bool:
        """The async save in flight did not finish within the grace: no signal's save."""
        writing = self.manager.pending_step if self.manager.pending is not None else None
        newest = self._last_committed
        kept = (
            f"the newest committed checkpoint, {self.manager.url_for(newest)}, stays latest"
            if newest is not None else "no checkpoint of this run is committed: the next start begins from scratch"
        )
        warn_user(
            f"save_on_signal: the async save of step {writing if writing is not None else '(another rank)'} is still "
            f"writing after {self._in_flight_wait:.1f} s of waiting, the grace left by grace_s={self.grace_s:g} s "
            f"{self._estimate_text()}; step {step} is not saved and {kept} (the save in flight commits if it "
            "finishes before the kill, or stays uncommitted: never loaded)",
            StatekitWarning,
        )
        seconds = time.monotonic() - since
        self.result = {"signal": signum.name if signum else None, "step": newest,
                       "url": None if newest is None else self.manager.url_for(newest), "seconds": seconds,
                       "grace_s": self.grace_s, "saved": False, "in_flight": writing, "replicated": None,
                       "total_seconds": seconds, "from_watcher": False,
                       "path": f"not saved: the async save of step {writing} was still writing"}
        logger.warning(
            "save_on_signal: %s: step %d not saved (the async save of step %s still writing); %.2f s after the "
            "signal (grace %g s)", signum.name if signum else "signal on another rank", step, writing, seconds,
            self.grace_s,
        )
        self._stop(signum)
        return True

    def _estimate_text(self) -> str:
        estimate = self._estimate()
        if estimate is None:
            return "(no save measured yet)"
        return f"less the signal's own save's estimated {estimate:.1f} s"

    def _warn_if_too_slow(self, step: int, remaining: float) -> None:
        estimate = self._estimate()
        if estimate is None or estimate <= remaining:
            return
        tier = (
            "writing to the local root first (the tiers copy it until the deadline)"
            if self.manager.tiers()
            else "no faster local tier is configured (a local root_url with a tier plugin copying to the remote one: "
            "docs/tiers.md)"
        )
        warn_user(
            f"save_on_signal: step {step} needs about {estimate:.1f} s ({self._last_bytes:,} bytes at the measured "
            f"{self._rate / 2**20:.1f} MiB/s of the last save), {remaining:.1f} s of grace_s={self.grace_s:g} s "
            f"remain; {tier}",
            StatekitWarning,
        )
