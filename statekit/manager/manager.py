"""CheckpointManager: numbered checkpoints of one run under a root, saved and resumed.

The manager holds the run's options (:mod:`~statekit.manager.policies`) and drives a save
(:mod:`statekit.api`), what follows its commit (``latest`` and retention:
:mod:`~statekit.manager.retention`) and a resume (the order of candidates:
:mod:`~statekit.manager.resume_order`); names and listing are
:mod:`~statekit.manager.listing`'s.

Layout under the root URL: ``checkpoint-<step:08d>/`` per checkpoint and ``latest``, a
hint naming the newest committed one (written after its commit). ``resume()`` always
scans the manifests (after invalidating fsspec's listing cache) and uses ``latest`` only
as a hint; a directory without a manifest is never loaded or called latest.
"""

from __future__ import annotations

import contextlib
import logging
import numbers
import os
import time
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from statekit import distributed
from statekit.api import loading, saveload
from statekit.api.attach import attach
from statekit.api.bridge import load_state, save_state
from statekit.api.asyncsave import PendingSave
from statekit.manager.backpressure import Backpressure, CheckpointStats, SaveStats
from statekit.manager.policies import AsyncPolicy, PreemptionPolicy, RetentionPolicy, manager_policies
from statekit.manager.preemption import SignalSave
from statekit.manager import lineage
from statekit.manager.resume_order import Candidate, load_first, resume_candidates
from statekit.manager.retention import after_commit, write_latest
from statekit.checks import state_check
from statekit.engine.entries import classify
from statekit.manager.listing import DEFAULT_STEP_DIGITS, CheckpointDir, checkpoint_name, list_checkpoints, refuse_checkpoint_as_root
from statekit.errors import (
    CorruptCheckpointError,
    IncompleteCheckpointError,
    InvalidOptionError,
    StatekitError,
    StatekitWarning,
    StateMismatchError,
    warn_user,
)
from statekit.engine.staging import StagingPool
from statekit.foreign.base import ForeignSummary
from statekit.format.manifest_types import Manifest
from statekit.hooks.hookspecs import Tier
from statekit.hooks.registry import call_each, get_plugin_manager
from statekit.storage import Storage
from statekit.storage.inuse import hold_in_use

logger = logging.getLogger(__name__)


class CheckpointManager:
    """Numbered checkpoints of one training run under a root URL (``docs/concepts.md``).

    Creating a manager attaches statekit to the run (:func:`statekit.attach`). Its options
    come in three groups, each given by one keyword, as a shortcut or as the group
    (:mod:`~statekit.manager.policies`, ``docs/api.md``). Also a context manager: leaving
    the ``with`` block restores the signal handlers and waits for a pending async save.

    Args:
        accelerator: an ``accelerate.Accelerator`` after ``prepare()``; or, without
            Accelerate, a mapping of stateful objects as given to :func:`statekit.save`.
        root_url: directory URL holding ``checkpoint-<step>/`` and ``latest``, or a
            ``statekit.storage.Storage`` (a URL with its fsspec options).
        keep_last: keep the newest N committed checkpoints (None: no such policy).
        retention: a :class:`~statekit.RetentionPolicy` (``keep_last``, ``keep_best`` by
            ``monitor`` and ``mode``, ``keep_every_n_steps``), not with ``keep_last``. With
            neither, every checkpoint is kept.
        async_save: True: :meth:`save` defaults to ``blocking=False``; or an
            :class:`~statekit.AsyncPolicy` (back-pressure, ``max_wait_s``: ``docs/backpressure.md``).
        save_on_signal: True: save at the next safe point after SIGTERM or SIGUSR1; or the
            signals (``"USR1"``, ``signal.SIGUSR2``, a tuple); or a
            :class:`~statekit.PreemptionPolicy` (``grace_s``, ``on_signal``, ``check_every``:
            ``docs/clusters.md``). False (default): no handlers.
        storage_options: fsspec options of ``root_url`` (not with a ``Storage``).
        allow_pickle: let :meth:`resume` read the pickle files of Accelerate's
            ``checkpoint_<n>`` folders (without: :class:`PickleNotAllowedError`).
        incremental: write a tensor file only when its bytes changed since the last committed
            checkpoint, hard-linking (server-side copying) the others (``docs/incremental.md``);
            False: every save writes every byte.
        step_digits: the zero-padded digits of the step in directory names, 0 to 20 (8:
            ``checkpoint-00000500``; 0: ``checkpoint-500``, as transformers' ``Trainer``).
        run_id: this run's id, recorded in every checkpoint's lineage (``docs/concepts.md``,
            Lineage); None: the resumed checkpoint's, or a new ``uuid4().hex``.
        **options: the manager options plugins declare (``STATEKIT_MANAGER_OPTIONS``,
            ``docs/hooks.md``; two-tier storage's: ``docs/tiers.md``), kept in
            :attr:`manager_options` and validated by their plugin. The others are plugin
            options passed to every save and load; one that no registered plugin reads (a
            misspelled ``keep_last``) warns.

    Raises:
        InvalidOptionError: an invalid value or combination (``keep_last`` with
            ``retention``; a group's field as a keyword, ``keep_best=2``: the message names
            the group), ``root_url`` is itself a checkpoint, or a plugin refused its option.
        PluginError: a ``statekit_manager_options``, ``statekit_attach`` or
            ``statekit_manager_start`` hook failed.
        PluginMissingError: an option of a plugin ``STATEKIT_DISABLE_PLUGINS`` blocks.
        StorageError: a root a plugin's option names cannot be resolved.
    """

    def __init__(
        self,
        accelerator: Any,
        root_url: str | os.PathLike[str] | Storage,
        keep_last: int | None = None,
        *,
        retention: RetentionPolicy | None = None,
        async_save: bool | AsyncPolicy = False,
        save_on_signal: bool | PreemptionPolicy | Any = False,
        storage_options: dict[str, Any] | None = None,
        allow_pickle: bool = False,
        incremental: bool = True,
        step_digits: int = DEFAULT_STEP_DIGITS,
        run_id: str | None = None,
        **options: Any,
    ) -> None:
        self.retention: RetentionPolicy
        """Which committed checkpoints are kept (:class:`~statekit.manager.policies.RetentionPolicy`)."""
        self.async_policy: AsyncPolicy
        """How saves run in the background (:class:`~statekit.manager.policies.AsyncPolicy`)."""
        self.preemption: PreemptionPolicy | None
        """What a preemption signal does (:class:`~statekit.manager.policies.PreemptionPolicy`),
        or None: no handlers."""
        self.retention, self.async_policy, self.preemption = manager_policies(
            keep_last, retention, async_save, save_on_signal, options)
        self.backpressure = Backpressure(self.async_policy)
        self.save_stats = SaveStats()
        if not isinstance(step_digits, int) or isinstance(step_digits, bool) or not 0 <= step_digits <= 20:
            raise InvalidOptionError(f"step_digits must be an integer from 0 to 20, got {step_digits!r}")
        self.step_digits = step_digits
        if run_id is not None and (not isinstance(run_id, str) or not run_id):
            raise InvalidOptionError(f"run_id must be a non-empty string or None, got {run_id!r}")
        pm = get_plugin_manager()
        self.manager_options: Mapping[str, Any] = MappingProxyType(pm.take_manager_options(options))
        """The manager options plugins declare (``STATEKIT_MANAGER_OPTIONS``): every declared
        name, with the value given or the plugin's default (read-only)."""
        call_each(pm, "statekit_manager_options", None, {"options": self.manager_options})
        if isinstance(accelerator, Mapping):
            self.accelerator, self.objects = None, dict(accelerator)
        else:
            self.accelerator, self.objects = accelerator, None
        self.root = Storage.of(root_url, storage_options)
        """The root directory and its fsspec options (:class:`~statekit.storage.Storage`)."""
        refuse_checkpoint_as_root(self.root)
        self.root_url = self.root.url
        # the run id, branch and parent the saves record; a resume continues them
        self._lineage = lineage.RunLineage(self.root, step_digits, run_id, lambda: lineage.lineage_roots(self))
        self.staging = StagingPool()
        self.pending: PendingSave | None = None
        self.pending_step: int | None = None
        """The step of :attr:`pending` (the async save in flight, if any)."""
        self.storage_options = self.root.storage_options
        self.allow_pickle = allow_pickle
        self.incremental = incremental
        self._reuse_from: tuple[str, Manifest] | None = None  # the last committed checkpoint, for incremental saves
        self.options = options
        self.resumed_from: str | None = None
        self._resumed_in_use: Any = None
        self.resumed_manifest: Manifest | ForeignSummary | None = None
        self._skipped: set[str] = set()  # checkpoints under the root that resume() could not load
        self.rollback_targets: set[str] = set()
        """Checkpoints a ``resume(step=K)`` in progress rolls back to: retention keeps them
        (the async save it waits for may commit and apply retention first)."""
        self.plugin_state: dict[str, Any] = {}
        """Per-manager state of plugins, each under its own name (manager hooks, ``docs/hooks.md``)."""
        pm.check_options(options, CheckpointManager)
        self.attachment = attach(self.accelerator, self.objects)
        self.signal_save: SignalSave | None = None if self.preemption is None else SignalSave(self, self.preemption)
        """The save on a signal (``save_on_signal``; None without): ``received``, ``result``,
        ``restore()`` (:class:`statekit.manager.preemption.SignalSave`)."""
        call_each(pm, "statekit_manager_start", None, {"manager": self})
        if self.signal_save is not None:  # handlers last: a manager whose start failed leaves none behind
            self.signal_save.install()

    @property
    def run_id(self) -> str | None:
        """The ``run_id`` given (None: none; the run's id is then :attr:`lineage_run_id`)."""
        return self._lineage.given_run_id

    @property
    def lineage_run_id(self) -> str:
        """The run id the next save records (inherited from the checkpoint resumed from
        when no ``run_id`` was given)."""
        return self._lineage.run_id

    def tiers(self) -> list[Tier]:
        """The tier plugins' objects of this manager.

        Returns:
            Each :class:`statekit.plugin_api.Tier` a plugin keeps in :attr:`plugin_state`
            (found by protocol); empty without a tier plugin.
        """
        return [state for state in self.plugin_state.values() if isinstance(state, Tier)]

    # ---------------------------------------------------------------- queries

    def list(self) -> list[CheckpointDir]:
        """Every checkpoint directory under the root (committed or not).

        Returns:
            One :class:`CheckpointDir` per directory, oldest first.
        """
        return list_checkpoints(self.root)

    def latest(self) -> str | None:
        """The newest committed checkpoint of the live history (``docs/concepts.md``,
        Lineage; scans manifests: the ``latest`` file is only a hint and is not trusted).

        Returns:
            Its URL, or None when there is none.

        Raises:
            StatekitError: the root's ``lineage.json`` is unreadable.
        """
        state = lineage.read_state([self.root])  # None without a rollback: every checkpoint is live
        committed = [i for i in list_checkpoints(self.root, details=state is not None)
                     if i.committed and lineage.is_live(state, i)]
        return committed[-1].url if committed else None

    def candidates(self) -> list[tuple[CheckpointDir, dict[str, Any] | None]]:
        """The committed checkpoints :meth:`resume` would try, in its order (newest step
        first; this root's copy of a step before a plugin's root:
        :mod:`~statekit.manager.resume_order`). With several ranks every rank calls it (a
        collective).

        Returns:
            ``(CheckpointDir, storage_options)`` pairs: the checkpoint and the fsspec
            options to read it with.

        Raises:
            PluginError: a ``statekit_resume_roots`` implementation failed.
            StorageError: the root cannot be listed.
        """
        return resume_candidates(self)

    # ---------------------------------------------------------------- save

    def url_for(self, step: int) -> str:
        """URL of the checkpoint directory of ``step``.

        Args:
            step: the training step.

        Returns:
            ``<root>/checkpoint-<step>``, the step zero-padded to ``step_digits``.
        """
        return self.url_of(checkpoint_name(step, self.step_digits))

    def url_of(self, name: str) -> str:
        """URL of the directory ``name`` under this rank's root.

        Args:
            name: a checkpoint directory's name (``CheckpointDir.name``).

        Returns:
            ``<root>/<name>``.
        """
        return self.root.url_of(name)

    def save(
        self,
        step: int | None = None,
        metrics: Mapping[str, float] | None = None,
        *,
        overwrite: bool = False,
        blocking: bool | None = None,
    ) -> Manifest | PendingSave | None:
        """Save the run as ``checkpoint-<step>``, commit it, update ``latest``, apply retention.

        A previous async save is waited for first (its error raised here) within the
        :class:`~statekit.AsyncPolicy` (``docs/backpressure.md``); still writing at the
        bound, this save is skipped with a :class:`StatekitWarning` (None returned).

        Args:
            step: the training step (names the directory). None: automatic naming, one
                more than the highest checkpoint under the root (Accelerate's
                ``checkpoint_<n>`` folders included; 0 for an empty root), and not less
                than the accelerator's ``project_configuration.iteration``.
            metrics: JSON-able numbers recorded in the manifest (``{"loss": 0.31}``).
            overwrite: replace an existing committed checkpoint of this step.
            blocking: False: copy the state to reusable host buffers, return at once, and
                write from a background thread (default: not ``async_save``).

        Returns:
            The committed manifest, or (non-blocking) a :class:`PendingSave` whose
            ``wait()`` returns it, or None when back-pressure skipped the save.

        Raises:
            CheckpointExistsError: this step is committed and not ``overwrite``; or its
                directory holds a folder statekit did not write (never replaced).
            AsyncSaveError: the previous async save failed (its error is the cause).
            PluginError, StatekitError: as :meth:`wait` for the previous async save's
                after-commit work; or as :func:`statekit.save`.
            SystemExit: ``save_on_signal`` with ``on_signal="exit"`` and a signal received
                (on any rank): this save was the signal's, committed (status ``128 + signum``).
        """
        with self._main_call():
            return self._save(step, metrics, overwrite, blocking)

    def _main_call(self) -> Any:
        """The main thread inside a manager call: the signal watcher's save waits for it
        (and it for the watcher's): the two never run statekit's collectives at once."""
        return self.signal_save.lock if self.signal_save is not None else contextlib.nullcontext()

    def save_moment(self, moment: Any) -> Manifest:
        """Save a step boundary's state (:class:`statekit.engine.moment.Moment`), blocking:
        the save on a signal from the watcher thread (:mod:`statekit.manager.signal_watcher`).

        Args:
            moment: the boundary's state, taken of this manager's objects.

        Returns:
            The committed manifest.

        Raises:
            MomentChangedError: a tensor changed since the boundary (nothing committed).
            StatekitError: as :meth:`save`.
        """
        with self._main_call():
            return self._save(moment.step, None, False, True, moment=moment)

    def _save(self, step: int | None, metrics: Mapping[str, float] | None, overwrite: bool, blocking: bool | None,
              moment: Any = None) -> Manifest | PendingSave | None:
        started = time.monotonic()
        if not self.backpressure.admit(self.pending):
            self.save_stats.skip(self.next_step() if step is None else step, self.pending, self.backpressure, started)
            return None
        self._wait_save()
        waited = time.monotonic() - started
        # every rank agrees (not from the watcher: its save is the signal's)
        on_signal = moment is None and self.signal_save is not None and self.signal_save.before_save()
        if step is None:
            step = self.next_step()
        blocking = True if on_signal else not self.async_policy.enabled if blocking is None else blocking
        url = self._lineage.url_on_branch(step)
        if not overwrite and url in self._skipped:  # the run fell back past it and reached its step again
            warn_user(f"replacing {url}, which resume() skipped as unloadable", StatekitWarning)
            overwrite = True
        self._skipped.discard(url)
        metadata = {"metrics": dict(metrics)} if metrics else {}
        save_started = time.monotonic()

        record = self._lineage.record()

        def committed(manifest: Manifest) -> None:
            self._lineage.committed(url)  # the next save descends from this one
            self._reuse_from = (url, manifest)  # the next save compares its files with this one's
            if self.signal_save is not None:
                self.signal_save.observe_commit(step, save_started, manifest.size_bytes)
            after_commit(self, step, url, manifest)

        common = dict(
            step=step, metadata=metadata, overwrite=overwrite, storage_options=self.storage_options,
            blocking=blocking, staging=self.staging, exclusive=not overwrite, after_commit=committed,
            incremental=self.incremental, reuse_from=self._reuse_from if self.incremental else None,
            lineage=record, moment=moment, host_memory_budget=self.async_policy.host_memory_budget,
        )
        if self.accelerator is not None:
            result = save_state(self.accelerator, url, **common, **self.options)
        else:
            entries = [classify(k, v) for k, v in self.objects.items()]
            result = saveload.save_objects(url, entries, options=self.options, **common)
        if not blocking:
            self.pending, self.pending_step = result, step
        if on_signal:
            self.signal_save.after_save(step)  # logs; exits, or should_stop
        elif moment is None and self.signal_save is not None:
            self.signal_save.after_plain_save(step)  # the state now is this step's: the watcher's boundary
        self.save_stats.record(step, started, waited, "writing" if not blocking else "committed")
        return result

    def step_boundary(self, step: int) -> bool:
        """A safe point for the save on a signal (``save_on_signal``, ``docs/clusters.md``);
        call it after every training step, on every rank at the same steps (cheap: a flag
        check; with several ranks one all-reduce of one int every
        :attr:`PreemptionPolicy.check_every <statekit.PreemptionPolicy.check_every>`-th call).

        When any rank has received a signal (and the watcher has not saved already), every
        rank commits an async save in flight, saves ``step`` blocking, then exits with status
        ``128 + signal number`` or returns True (``on_signal``). Inside an accumulation window
        (``sync_gradients`` False) it does nothing; the sequence: ``docs/clusters.md``.

        Args:
            step: the training step just finished (names the checkpoint).

        Returns:
            True once the run should stop (``on_signal="return"``); False otherwise, and
            always without ``save_on_signal``.

        Raises:
            SystemExit: ``on_signal="exit"``, after the signal's checkpoint committed.
            StatekitError: the signal's save failed (as :meth:`save`).
        """
        return self.signal_save is not None and self.signal_save.at_boundary(step)  # (under the watcher's lock)

    @property
    def should_stop(self) -> bool:
        """True once the save on a signal committed (``on_signal="return"``): end the loop."""
        return self.signal_save is not None and self.signal_save.should_stop

    def wait_for_save(self) -> Manifest | None:
        """Wait for the pending async save only (not for plugins' background work, unlike
        :meth:`wait`) and run its post-hooks.

        Returns:
            Its committed manifest, or None if no save was pending.

        Raises:
            AsyncSaveError: it failed (``__cause__`` is the original error).
            PluginError, StatekitError: it committed, but what follows the commit failed
                (as :meth:`wait`).
        """
        return self._wait_save()

    def next_step(self) -> int:
        """The step :meth:`save` uses without one: one more than the highest checkpoint
        under the root (any kind, committed or not; after a rollback, of the live history), at least the accelerator's
        ``project_configuration.iteration``; agreed by every rank (rank 0 decides).

        Returns:
            The step number for the next automatically named checkpoint.
        """
        state = self._lineage.state
        if state is not None:  # after a rollback: the live history's highest, not an abandoned step
            infos = [i for i in list_checkpoints(self.root) if lineage.is_live(state, i)]
        else:
            infos = list_checkpoints(self.root, details=False)
        highest = max((i.step for i in infos), default=-1)
        config = getattr(self.accelerator, "project_configuration", None)
        return int(distributed.broadcast_from_rank0(max(highest + 1, int(getattr(config, "iteration", 0) or 0))))

    def stats(self) -> CheckpointStats:
        """The time this run lost to checkpoints so far: each :meth:`save` call's blocking
        seconds, the saves back-pressure skipped, the tiers' backlog, the steps the
        last :meth:`resume` went back (``docs/backpressure.md``).

        Returns:
            A :class:`~statekit.manager.backpressure.CheckpointStats` (``.to_dict()``,
            ``.to_json()``).
        """
        tiers = self.tiers()
        backlog: dict[str, int] | None = None
        for tier in tiers:  # summed over the tiers
            backlog = {k: (backlog or {}).get(k, 0) + v for k, v in tier.backlog().items()}
        return self.save_stats.snapshot(backlog)

    def wait(self, timeout: float | None = None) -> Manifest | None:
        """Wait for the pending async save (if any) and run its post-hooks; then for the
        plugins' background work (``statekit_manager_wait``: a tier's copies).

        Args:
            timeout: seconds each plugin waits at most (None: until done); what a plugin
                leaves undone by then is its :class:`StatekitWarning`.

        Returns:
            The async save's committed manifest, or None if no save was pending.

        Raises:
            AsyncSaveError: it failed; the message names the URL, ``__cause__`` is the
                original error with its traceback.
            PluginError, StatekitError: it committed, but what follows the commit failed (a
                ``statekit_checkpoint_committed`` hook; ``latest`` or retention); the message
                says the checkpoint is committed.
            PluginError: a ``statekit_manager_wait`` implementation failed.
        """
        with self._main_call():
            return self._wait(timeout)

    def _wait(self, timeout: float | None) -> Manifest | None:
        manifest = self._wait_save()
        call_each(get_plugin_manager(), "statekit_manager_wait", None, {"manager": self, "timeout": timeout})
        return manifest

    def _wait_save(self) -> Manifest | None:
        pending, self.pending = self.pending, None
        return pending.wait() if pending is not None else None

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        timeout = None
        if self.signal_save is not None:
            self.signal_save.restore()  # the handlers installed before the manager
            timeout = self.signal_save.remaining()  # after a signal: no longer than its grace period
        if exc_info[0] is None:
            self.wait(timeout)
        elif self.pending is not None:  # already failing: don't mask that error
            try:
                self.wait(timeout)
            except StatekitError as exc:
                warn_user(f"{exc}", StatekitWarning)

    # ---------------------------------------------------------------- resume

    def resume(
        self,
        step: int | None = None,
        *,
        verify: bool = True,
        strict: bool = True,
        strict_resume: bool = False,
        other_runs: str = "raise",
    ) -> int | None:
        """Load the newest committed checkpoint of the live history that loads cleanly;
        return its step. ``resume(step=K)`` rolls back to step ``K`` and starts a new branch
        there. A checkpoint that fails verification or loading is skipped with a
        :class:`StatekitWarning` naming the file and the previous one is tried (a shape or
        key mismatch is raised). Candidates, their order (``statekit_resume_roots`` roots
        too), the fingerprint compared before the load and lineage: ``docs/concepts.md``
        (Lineage, Resume fingerprint) and :mod:`statekit.manager.resume_order`.

        Args:
            step: None: the newest checkpoint of the live history. An integer: roll back
                to that committed step (the live history's checkpoint of that step, else
                the newest written of that step): its load is not retried with another
                checkpoint; the next saves form a new branch, named
                ``checkpoint-<step>.<branch>`` where an abandoned checkpoint holds the
                plain name.
            verify: check sizes and checksums while reading.
            strict: False loads what matches (see :func:`statekit.load`); the missing and
                unexpected keys are in ``self.resumed_manifest.incompatible_keys``.
            strict_resume: raise :class:`ResumeMismatchError` for a fingerprint
                difference other than a version, instead of warning; and a difference
                the state check finds after the load is a :class:`StateMismatchError`
                instead of a :class:`StateCheckWarning` (``docs/concepts.md``, State check).
            other_runs: with the manager's ``run_id``, what a newest checkpoint of another
                run does: ``"raise"`` (default): this run's own newest is resumed with an
                :class:`~statekit.OtherRunWarning`, or, with none of its own, a
                :class:`StatekitError` naming both runs; ``"ignore"``: only this run's
                checkpoints count (None: a fresh start); ``"resume"``: continue the newest,
                whoever wrote it (``docs/concepts.md``, Lineage).

        Returns:
            The step resumed from (for an Accelerate ``checkpoint_<n>`` folder: ``n``),
            or None if the root holds no committed checkpoint. The manifest loaded is
            ``self.resumed_manifest``.

        Raises:
            StateMismatchError: the run's objects do not fit the checkpoint.
            ResumeMismatchError: ``strict_resume`` and the run differs from the newest
                checkpoint's (every difference listed; nothing loaded), or gradients saved
                mid-accumulation meet another ``gradient_accumulation_steps``.
            PickleNotAllowedError: an Accelerate folder needs pickle and not ``allow_pickle``.
            StorageError: the root is on an object store and its bucket does not exist.
            StatekitError: every committed checkpoint failed to load (the last error,
                naming its folder); the newest candidate is another run's and this run has
                none of its own (``run_id`` and ``other_runs="raise"``); the live history holds no committed
                checkpoint while abandoned ones exist.
            CheckpointNotFoundError: ``step`` is not a committed checkpoint's step.
            InvalidOptionError: ``other_runs`` is not raise/ignore/resume; ``step`` is not an
                int (``True``, ``"3"``); ``STATEKIT_STATE_CHECK`` holds an unknown mode.
        """
        with self._main_call():
            resumed = self._resume(step, verify, strict, strict_resume, other_runs)
            if resumed is not None and self.signal_save is not None:
                self.signal_save.after_plain_save(resumed)  # the state now is the resumed step's
            return resumed

    def _resume(self, step: int | None, verify: bool, strict: bool, strict_resume: bool, other_runs: str) -> int | None:
        if other_runs not in ("raise", "ignore", "resume"):
            raise InvalidOptionError(f"other_runs must be 'raise', 'ignore' or 'resume', got {other_runs!r}")
        if step is not None and (isinstance(step, bool) or not isinstance(step, numbers.Integral)):
            raise InvalidOptionError(  # resume(True) would roll back to step 1
                f"resume(step=...) takes a checkpoint's step (an int) to roll back to, or None for the newest; got "
                f"{step!r}")
        state_check.mode()  # a misspelled STATEKIT_STATE_CHECK is the caller's error, not a bad checkpoint
        self._wait_save_keeping(step)  # an async save in flight commits first (on the branch it was saved on)
        everything = resume_candidates(self)
        state = self._lineage.read_root_file(everything)
        infos = [info for info, _ in everything]
        if step is not None:
            return self._rollback(int(step), everything, state, verify, strict, strict_resume)
        loaded = load_first(self._lineage.live_candidates(everything, state, other_runs), self._skip,
                            lambda url, options: self._load(url, options, verify, strict, strict_resume))
        if loaded is None:
            self._fresh_start()
            return None
        info, manifest = loaded
        step = self._resumed(info.url, manifest, info.step, info.accelerate)
        self._lineage.continue_from(info, False, infos, state)
        logger.info("resumed from step %s (%s): continuing run %s, branch %s", step, info.url,
                    self.lineage_run_id, lineage.short(self._lineage.branch))
        return step

    def _wait_save_keeping(self, step: int | None) -> None:
        """Wait for an async save in flight; the committed checkpoints of ``step`` (a
        rollback's target) are kept by the retention its commit applies."""
        if step is not None and self.pending is not None:
            self.rollback_targets = {i.url for i in self.list() if i.committed and i.step == step}
        try:
            self._wait_save()
        finally:
            self.rollback_targets = set()

    def _skip(self, info: CheckpointDir, exc: StatekitError) -> None:
        """Warn that ``info`` failed to load and the previous one is tried; a damaged
        checkpoint under the root is remembered so that saving its step replaces it."""
        if isinstance(exc, StateMismatchError):
            warn_user(
                f"cannot resume from {info.url} (incomplete Accelerate checkpoint? {exc}); trying the previous one",
                StatekitWarning,
            )
            logger.info("skipped %s (%s): incomplete Accelerate checkpoint? %s", info.name, info.url, exc)
            return
        warn_user(f"cannot resume from {info.url} ({exc}); trying the previous checkpoint", StatekitWarning)
        logger.info("skipped %s (%s): %s", info.name, info.url, exc)
        damaged = isinstance(exc, (CorruptCheckpointError, IncompleteCheckpointError))
        if damaged and info.url.startswith(self.root_url.rstrip("/") + "/") and not info.accelerate:
            self._skipped.add(info.url)  # saving its step replaces it (not one only this setup cannot read)

    def _fresh_start(self) -> None:
        """No committed checkpoint to resume: the run starts from the beginning."""
        self.root.check_bucket()  # a missing bucket lists as empty: not a fresh run
        logger.info("no committed checkpoint under %s: starting from the beginning", self.root_url)

    def _rollback(self, step: int, everything: list[Candidate], state: lineage.LineageState | None,
                  verify: bool, strict: bool, strict_resume: bool) -> int:
        """``resume(step=K)``: load the checkpoint of step ``K`` and start a branch there."""
        info, options = self._lineage.rollback_target(step, everything, state)
        manifest = self._load(info.url, options, verify, strict, strict_resume)
        resumed = self._resumed(info.url, manifest, info.step, info.accelerate)
        self._lineage.continue_from(info, True, [i for i, _ in everything], state)
        if distributed.rank_and_world_size()[0] == 0 and info.url.startswith(self.root_url.rstrip("/") + "/"):
            write_latest(self, info.url)  # the hint no longer names an abandoned checkpoint
        logger.info("rolled back to step %s (%s): run %s continues on the new branch %s", resumed, info.url,
                    self.lineage_run_id, lineage.short(self._lineage.branch))
        return resumed

    def record_resume(self, url: str, manifest: Manifest) -> int:
        """Record a resume from ``url`` that was loaded outside :meth:`resume`.

        For an integration whose trainer decides when a checkpoint is read
        (statekit-transformers loads with :func:`statekit.load` where transformers' Trainer
        loads its optimizer, after ``accelerator.prepare``). The manager then treats
        the run as :meth:`resume` would have: retention never deletes ``url``, an in-use
        marker keeps other processes from deleting it, the next incremental save reuses its
        unchanged files, a signal during the resume saves no copy of its step, and the next
        saves continue its lineage (run id, branch, parent: ``docs/concepts.md``, Lineage)
        as after a :meth:`resume` that chose it.

        Args:
            url: the committed checkpoint the run resumed from.
            manifest: its manifest (as :func:`statekit.load` returned it).

        Returns:
            The step resumed from.
        """
        step = self._resumed(url, manifest, int(manifest.step or 0), False)
        info = CheckpointDir(step, url, True, lineage=manifest.lineage)
        self._lineage.continue_from(info, False, [], self._lineage.read_root_file([(info, None)]))
        logger.info("resumed from step %s (%s): continuing run %s, branch %s", step, url,
                    self.lineage_run_id, lineage.short(self._lineage.branch))
        return step

    def release_resumed(self) -> None:
        """Remove this process's in-use marker of the checkpoint it resumed from (retention
        is about to delete it: a policy with ``keeps_resumed`` False)."""
        if self._resumed_in_use is not None:
            self._resumed_in_use()
            self._resumed_in_use = None
        if self._reuse_from is not None and self._reuse_from[0] == self.resumed_from:
            self._reuse_from = None

    def _resumed(self, url: str, manifest: Manifest | ForeignSummary, folder_step: int, accelerate: bool) -> int:
        self.resumed_manifest = manifest
        self.resumed_from = url
        if isinstance(manifest, Manifest) and url.startswith(self.root_url.rstrip("/") + "/"):
            self._reuse_from = (url, manifest)  # unchanged files of the next save come from it
        if self._resumed_in_use is not None:
            self._resumed_in_use()  # the previous resume's marker
        self._resumed_in_use = hold_in_use(self, url, by="statekit")  # no other process deletes it
        # Accelerate's folders count saves, not steps (their "step" is the gradient
        # accumulation counter): the folder's number is what continues the naming
        step = folder_step if manifest.step is None or accelerate else int(manifest.step)
        if self.signal_save is not None:
            self.signal_save.resumed(step)  # a signal during the resume saves no copy of this step
        self.save_stats.resumed(step, [i.step for i in list_checkpoints(self.root, details=False)])
        return step

    def _load(
        self, url: str, storage_options: dict[str, Any] | None, verify: bool, strict: bool, strict_resume: bool
    ) -> Manifest | ForeignSummary:
        common = dict(
            verify=verify, storage_options=storage_options, allow_pickle=self.allow_pickle, strict=strict,
            strict_resume=strict_resume,
        )
        if self.accelerator is not None:
            return load_state(self.accelerator, url, **common, **self.options)
        entries = [classify(k, v) for k, v in self.objects.items()]  # a resume: the fingerprint is always compared
        return loading.load_objects(url, entries, options=self.options, **common)

