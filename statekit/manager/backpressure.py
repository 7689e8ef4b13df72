"""Back-pressure of async saves, and the time a run loses to checkpoints (issue 30).

A :class:`~statekit.CheckpointManager` writes one async save at a time. When ``save()``
is called while the previous async save is still writing, :class:`Backpressure` decides
what the new save does: ``"wait"`` up to ``max_wait_s`` seconds for the previous one to
finish (then save as usual), or ``"skip"`` it at once. A save that is not made warns
(:class:`~statekit.StatekitWarning`) naming its step, the checkpoint still writing and how
many saves the run skipped; the newest committed checkpoint stays ``latest``, and the one
still writing commits when it is done. With several ranks the ranks agree (one small
gather and broadcast on statekit's gloo group): a save is made only when every rank's
previous save has finished, so no rank enters a save the others skip.

:class:`SaveStats` records what each ``save()`` call cost its caller;
``CheckpointManager.stats()`` returns it as a :class:`CheckpointStats` (``docs/backpressure.md``).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from statekit import distributed
from statekit.errors import StatekitWarning, warn_user
from statekit.manager.policies import AsyncPolicy

RECORDS_KEPT = 1000
"""How many of the newest :class:`SaveRecord` a run keeps (the totals cover every save)."""


class Backpressure:
    """What ``save()`` does while the previous async save is still writing.

    Args:
        policy: the manager's :class:`~statekit.manager.policies.AsyncPolicy` (checked
            there): ``"wait"`` for the previous save up to ``max_wait_s`` seconds, then skip
            this save if it is still writing; ``"skip"`` this save at once.
    """

    def __init__(self, policy: AsyncPolicy) -> None:
        self.policy = policy.backpressure
        self.max_wait_s = None if policy.max_wait_s is None else float(policy.max_wait_s)

    @property
    def bound_s(self) -> float | None:
        """Seconds a save waits at most for the previous one (0 for ``"skip"``; None: no bound)."""
        return 0.0 if self.policy == "skip" else self.max_wait_s

    def admit(self, pending: Any) -> bool:
        """Wait (within the bound) for the previous async save to finish writing.

        With several ranks this is a collective (every rank calls ``save()`` at the same
        point): the save is admitted only when every rank's previous save has finished.

        Args:
            pending: the manager's :class:`~statekit.api.asyncsave.PendingSave`, or None.

        Returns:
            True: the previous save (if any) has finished, the new save may start (the
            caller collects the previous one, raising its error). False: skip this save.
        """
        bound = self.bound_s
        done = True if pending is None else pending.join(bound)
        if bound is not None:  # every rank's previous save finished: one all-reduce (one process: none)
            done = not distributed.any_rank(not done)
        return done

    def describe(self) -> str:
        """The policy as the user wrote it (for messages)."""
        if self.policy == "skip":
            return "backpressure='skip'"
        return f"backpressure='wait', max_wait_s={self.max_wait_s!r}"


@dataclass(frozen=True)
class SaveRecord:
    """What one ``CheckpointManager.save()`` call cost the training loop.

    Attributes:
        step: the checkpoint's step.
        blocking_s: seconds the call held its caller (waiting, staging, and for a blocking
            save the whole write and commit).
        waited_s: the part of ``blocking_s`` spent waiting for the previous async save.
        outcome: ``"committed"`` (a blocking save), ``"writing"`` (an async save handed to
            its background thread) or ``"skipped"`` (back-pressure: not saved).
    """

    step: int | None
    blocking_s: float
    waited_s: float
    outcome: str


@dataclass(frozen=True)
class CheckpointStats:
    """The time a run lost to checkpoints (``CheckpointManager.stats()``).

    Attributes:
        saves: the newest :data:`RECORDS_KEPT` ``save()`` calls of this manager, oldest first.
        save_count: every ``save()`` call of this manager that returned (skipped ones included).
        skipped_saves: saves back-pressure skipped.
        blocking_s_total: seconds all ``save()`` calls held their caller together.
        blocking_s_max: the longest one, seconds.
        replication: the tiers' backlog on this rank (their :meth:`Tier.backlog
            <statekit.plugin_api.Tier.backlog>` summed: ``checkpoints``, ``files`` and
            ``bytes`` queued or being copied, and the counts a tier adds:
            ``docs/backpressure.md``), or None without a tier plugin.
        resumed_step: the step the last ``resume()`` loaded (None: no resume, or a fresh start).
        reached_step: the highest step of any checkpoint directory under the root when that
            resume ran (committed or not, loadable or not: a save the previous run started),
            at least ``resumed_step``; None without a resume.
        steps_lost_on_resume: ``reached_step - resumed_step``: a lower bound of the training
            steps the previous run did that this one does again (the steps after the
            previous run's last save attempt are not recorded anywhere); None without a resume.
    """

    saves: list[SaveRecord] = field(default_factory=list)
    save_count: int = 0
    skipped_saves: int = 0
    blocking_s_total: float = 0.0
    blocking_s_max: float = 0.0
    replication: dict[str, int] | None = None
    resumed_step: int | None = None
    reached_step: int | None = None
    steps_lost_on_resume: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """The stats as plain JSON-able values.

        Returns:
            A dict with the attributes' names; ``saves`` is a list of dicts.
        """
        return asdict(self)

    def to_json(self, **kwargs: Any) -> str:
        """The stats as JSON (:meth:`to_dict`).

        Args:
            **kwargs: passed to :func:`json.dumps` (``indent=2``...).

        Returns:
            The JSON text.
        """
        return json.dumps(self.to_dict(), **kwargs)


class SaveStats:
    """The running record behind :class:`CheckpointStats` (one per manager)."""

    def __init__(self) -> None:
        self.records: list[SaveRecord] = []
        self.count = 0
        self.skipped = 0
        self.total_s = 0.0
        self.max_s = 0.0
        self.resumed_step: int | None = None
        self.reached_step: int | None = None

    def record(self, step: int | None, started: float, waited_s: float, outcome: str) -> None:
        """Record one ``save()`` call that started at ``started`` (``time.monotonic()``).

        Args:
            step: its step.
            started: ``time.monotonic()`` when the call began.
            waited_s: seconds it waited for the previous async save.
            outcome: ``"committed"``, ``"writing"`` or ``"skipped"``.
        """
        blocking = time.monotonic() - started
        self.records.append(SaveRecord(step, blocking, waited_s, outcome))
        del self.records[:-RECORDS_KEPT]
        self.count += 1
        self.skipped += outcome == "skipped"
        self.total_s += blocking
        self.max_s = max(self.max_s, blocking)

    def skip(self, step: int | None, pending: Any, policy: Backpressure, started: float) -> None:
        """Record and announce a save back-pressure skipped (a :class:`StatekitWarning`).

        Args:
            step: the step not saved.
            pending: this rank's save still writing (None: another rank's is).
            policy: the manager's :class:`Backpressure`.
            started: ``time.monotonic()`` when the ``save()`` call began.
        """
        waited = time.monotonic() - started
        self.record(step, started, waited, "skipped")
        writing = f"the async save to {pending.url}" if pending is not None else "another rank's async save"
        warn_user(
            f"save of step {step} skipped: {writing} is still writing after {waited:.3g} s ({policy.describe()}); "
            f"{self.skipped} save(s) skipped in this run; the newest committed checkpoint stays latest",
            StatekitWarning,
        )

    def resumed(self, step: int | None, steps_under_root: list[int]) -> None:
        """Record a resume: the step loaded and the steps of the checkpoint directories
        found under the root (what the previous run reached).

        Args:
            step: the step loaded (None: a fresh start).
            steps_under_root: every ``checkpoint-<step>`` directory's step under the root.
        """
        self.resumed_step = step
        self.reached_step = None if step is None else max([step, *steps_under_root])

    def snapshot(self, backlog: dict[str, int] | None = None) -> CheckpointStats:
        """The stats now.

        Args:
            backlog: the tiers' backlog (:attr:`CheckpointStats.replication`), or None.

        Returns:
            A :class:`CheckpointStats`.
        """
        lost = None if self.resumed_step is None or self.reached_step is None else self.reached_step - self.resumed_step
        return CheckpointStats(
            saves=list(self.records), save_count=self.count, skipped_saves=self.skipped,
            blocking_s_total=self.total_s, blocking_s_max=self.max_s, replication=backlog,
            resumed_step=self.resumed_step, reached_step=self.reached_step, steps_lost_on_resume=lost,
        )
