"""A checkpoint hook for hook-based trainers: :class:`CheckpointHook` and :class:`TrainerProgress`.

The trainer shape is the one of RoboOrchardLab's ``HookBasedTrainer``
(https://github.com/HorizonRobotics/robo_orchard_lab, "Hook Based Trainer Architecture"):
nested loops, each with a pair of hook channels::

    on_loop_begin
      on_epoch_begin                      (per epoch)
        on_step_begin                     (per optimizer step)
          on_batch_begin .. on_batch_end  (per micro-batch: forward, backward)
        optimizer.step(); zero_grad()
        on_step_end
      on_epoch_end
    on_loop_end

Every hook method takes the trainer's hook arguments (``PipelineHookArgs`` there) and
ignores them: what the hook needs is in the :class:`statekit.CheckpointManager` and the
trainer's :class:`TrainerProgress`, which the manager saves with the model. Saves happen
only at step end and epoch end, never between micro-batches: after ``optimizer.step()``
and ``zero_grad()`` the accumulated gradients are consumed, so the model, optimizer,
scheduler, data loader position, RNG and counters are the whole state, and a resume from
there is exact however many micro-batches a step spans (``docs/hook-trainers.md``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from statekit.api.asyncsave import PendingSave
from statekit.format.manifest_types import Manifest
from statekit.manager.manager import CheckpointManager
from statekit.errors import InvalidOptionError, StatekitError, StateMismatchError

__all__ = ["CheckpointHook", "TrainerProgress"]


@dataclass
class TrainerProgress:
    """The trainer's own counters, a Stateful object saved with the run.

    Pass it to the manager with the other objects (the mapping of
    :class:`statekit.CheckpointManager`, or ``accelerator.register_for_checkpointing``),
    and let the trainer loop from it: after :meth:`CheckpointHook.on_loop_begin` resumed,
    the trainer continues at epoch ``epoch``, step ``step_in_epoch`` of it (the data
    loader's position, restored by statekit, yields the rest of that epoch).

    The trainer advances it at three points, in this order with the hooks::

        progress.finish_micro_batch()   after each micro-batch's backward
        progress.finish_step()          after optimizer.step() and zero_grad(), before on_step_end
        progress.finish_epoch()         after the epoch's last step, before on_epoch_end

    so a checkpoint taken at ``on_epoch_end`` says "epoch ``epoch`` starts next" (nothing
    of the finished epoch is replayed on resume), and one taken at the ``on_step_end`` of an
    epoch's last step says "this epoch's steps are done, its end is not": the resumed
    trainer runs no step of it, calls :meth:`finish_epoch` and ``on_epoch_end``, as the
    uninterrupted run did after that step.

    Attributes:
        epoch: epochs finished (the index of the current epoch, from 0).
        step_in_epoch: optimizer steps finished in the current epoch.
        global_step: optimizer steps finished in the whole run (names the checkpoints).
        micro_batch: micro-batches accumulated toward the next optimizer step (0 at a
            step boundary; a save needs 0).
    """

    epoch: int = 0
    step_in_epoch: int = 0
    global_step: int = 0
    micro_batch: int = 0

    def finish_micro_batch(self) -> None:
        """Count one micro-batch (forward and backward done) toward the current step."""
        self.micro_batch += 1

    def finish_step(self) -> None:
        """Count one optimizer step (call after ``optimizer.step()`` and ``zero_grad()``)."""
        self.micro_batch = 0
        self.step_in_epoch += 1
        self.global_step += 1

    def finish_epoch(self) -> None:
        """Count one epoch (call after its last step, before ``on_epoch_end``)."""
        self.epoch += 1
        self.step_in_epoch = 0

    def state_dict(self) -> dict[str, int]:
        """The counters, as ``{"epoch", "step_in_epoch", "global_step", "micro_batch"}`` ints.

        Returns:
            A new dict of the four counters.
        """
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Set the counters from :meth:`state_dict`'s output.

        Args:
            state: ``{"epoch", "step_in_epoch", "global_step", "micro_batch"}``, each a
                non-negative int.

        Raises:
            StateMismatchError: a counter is missing, unexpected or not a non-negative int.
        """
        names = set(asdict(self))
        bad = {k: f"saved {v!r} vs expected a non-negative int" for k, v in state.items() if k in names and not _count(v)}
        if set(state) != names or bad:
            raise StateMismatchError(
                "TrainerProgress", missing=names - set(state), unexpected=set(state) - names, mismatched=bad
            )
        for name in names:
            setattr(self, name, int(state[name]))


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class _TrainerChannels:
    """Every hook channel of the trainer shape, as methods that do nothing: a trainer that
    calls each channel on each of its hooks can take a :class:`CheckpointHook` as it is."""

    def on_loop_begin(self, args: Any = None) -> Any:
        return None

    def on_loop_end(self, args: Any = None) -> Any:
        return None

    def on_epoch_begin(self, args: Any = None) -> None:
        return None

    def on_epoch_end(self, args: Any = None) -> Any:
        return None

    def on_step_begin(self, args: Any = None) -> None:
        return None

    def on_step_end(self, args: Any = None) -> Any:
        return None

    def on_batch_begin(self, args: Any = None) -> None:
        return None

    def on_batch_end(self, args: Any = None) -> None:
        return None

    def on_model_forward_begin(self, args: Any = None) -> None:
        return None

    def on_model_forward_end(self, args: Any = None) -> None:
        return None

    def on_model_backward_begin(self, args: Any = None) -> None:
        return None

    def on_model_backward_end(self, args: Any = None) -> None:
        return None


class CheckpointHook(_TrainerChannels):
    """Checkpointing for a hook-based trainer, added as one more hook.

    ``on_loop_begin`` resumes from the newest committed checkpoint under the manager's
    root; ``on_step_end`` saves every ``every_n_steps`` optimizer steps; ``on_epoch_end``
    saves every ``every_n_epochs`` epochs; ``on_loop_end`` waits for an async save
    (``CheckpointManager(..., async_save=True)``) to commit. Checkpoints are named by
    ``progress.global_step``; a step saved already (at its step end, or the one resumed
    from) is not saved again at the epoch end. The other channels (``on_epoch_begin``,
    ``on_step_begin``, ``on_batch_*``, ``on_model_*``) do nothing.

    Nothing is saved between micro-batches: at ``on_step_end`` the optimizer has stepped
    and ``zero_grad()`` ran, so no accumulated gradient is lost (see
    ``docs/hook-trainers.md``). A save with ``progress.micro_batch != 0`` is refused.

    Args:
        manager: a :class:`statekit.CheckpointManager` over the run's objects (model,
            optimizer, scheduler, data loader, and ``progress``).
        progress: the trainer's counters: a :class:`TrainerProgress`, or any Stateful
            object with int attributes ``global_step`` (optimizer steps done),
            ``micro_batch`` (micro-batches accumulated, optional) and, for
            ``every_n_epochs``, ``epoch`` (epochs done); the manager must save it.
        every_n_steps: save at the step end when ``global_step`` is a multiple of N.
        every_n_epochs: save at the epoch end when ``epoch`` (epochs done) is a multiple of M.

    Raises:
        InvalidOptionError: (a ``ValueError``) neither ``every_n_steps`` nor
            ``every_n_epochs`` is given, one is not a positive int, or ``progress`` is not
            among the objects the manager saves
            (a resume would restore the model but restart the trainer's counters).
    """

    def __init__(
        self,
        manager: CheckpointManager,
        progress: Any,
        *,
        every_n_steps: int | None = None,
        every_n_epochs: int | None = None,
    ) -> None:
        if every_n_steps is None and every_n_epochs is None:
            raise InvalidOptionError("CheckpointHook: give every_n_steps and/or every_n_epochs, or it never saves")
        for name, value in (("every_n_steps", every_n_steps), ("every_n_epochs", every_n_epochs)):
            if value is not None and not (_count(value) and value > 0):
                raise InvalidOptionError(f"CheckpointHook: {name} must be a positive int or None, got {value!r}")
        if not _is_saved_by(manager, progress):
            raise InvalidOptionError(
                f"CheckpointHook: the progress object ({type(progress).__name__}) is not among the objects "
                "the manager saves, so a resume would restart the trainer's counters; pass it in the mapping "
                "(CheckpointManager({..., 'trainer': progress}, url)) or call "
                "accelerator.register_for_checkpointing(progress) before creating the manager"
            )
        self.manager = manager
        self.progress = progress
        self.every_n_steps = every_n_steps
        self.every_n_epochs = every_n_epochs
        self.resumed_step: int | None = None
        self.last_saved_step: int | None = None
        self._begun = False

    def on_loop_begin(self, args: Any = None) -> int | None:
        """Resume from the newest committed checkpoint, if there is one.

        Loads every object of the manager (``progress`` included) in place; the trainer
        then loops from ``progress``. Only the first call resumes: a later loop of the
        same trainer (an evaluation pass that opens ``on_loop_begin`` again) loads nothing.

        Args:
            args: the trainer's hook arguments (ignored).

        Returns:
            The step resumed from (also ``self.resumed_step``), or None for a fresh run.

        Raises:
            StateMismatchError: the checkpoint does not fit the run's objects, or its step
                (its name) is not the ``global_step`` of the progress it restored.
            StatekitError: as :meth:`statekit.CheckpointManager.resume`.
        """
        if self._begun:
            return self.resumed_step
        self._begun = True
        step = self.manager.resume()
        if step is not None and int(self.progress.global_step) != step:
            raise StateMismatchError(
                f"the trainer progress restored from {self.manager.resumed_from} "
                f"(global_step {self.progress.global_step}, but the checkpoint is step {step})"
            )
        self.resumed_step = self.last_saved_step = step
        return step

    def on_step_end(self, args: Any = None) -> Manifest | PendingSave | None:
        """Save if ``progress.global_step`` is a multiple of ``every_n_steps``; then the
        manager's :meth:`~statekit.CheckpointManager.step_boundary` (with
        ``save_on_signal``: a signal's save of this step, then exit or
        ``manager.should_stop``, which the trainer checks to end its loop).

        Args:
            args: the trainer's hook arguments (ignored).

        Returns:
            The committed manifest, a pending async save, or None when nothing was saved.

        Raises:
            StatekitError: ``progress.micro_batch`` is not 0 (the trainer called
                ``on_step_end`` before finishing the step), or the save failed.
            SystemExit: ``save_on_signal`` with ``on_signal="exit"``, after the signal's save.
        """
        result = None
        if self.every_n_steps is not None and not int(self.progress.global_step) % self.every_n_steps:
            result = self._save("on_step_end")
        # the safe point of CheckpointManager(save_on_signal=...): exits, or sets manager.should_stop
        self.manager.step_boundary(int(self.progress.global_step))
        return result

    def on_epoch_end(self, args: Any = None) -> Manifest | PendingSave | None:
        """Save if ``progress.epoch`` (epochs done) is a multiple of ``every_n_epochs``.

        Args:
            args: the trainer's hook arguments (ignored).

        Returns:
            The committed manifest, a pending async save, or None when nothing was saved
            (no epoch save due, or this step is saved already).

        Raises:
            StatekitError: ``progress.micro_batch`` is not 0, or the save failed.
        """
        if self.every_n_epochs is None or int(self.progress.epoch) % self.every_n_epochs:
            return None
        return self._save("on_epoch_end")

    def on_loop_end(self, args: Any = None) -> Manifest | PendingSave | None:
        """Wait for a pending async save to commit.

        Args:
            args: the trainer's hook arguments (ignored).

        Returns:
            Its committed manifest, or None if no save was pending.

        Raises:
            AsyncSaveError: the pending save failed.
        """
        return self.manager.wait()

    def _save(self, channel: str) -> Any:
        step = int(self.progress.global_step)
        if step == self.last_saved_step:
            return None
        pending = int(getattr(self.progress, "micro_batch", 0) or 0)
        if pending:
            raise StatekitError(
                f"CheckpointHook.{channel} at step {step}: progress.micro_batch is {pending}, so the step is "
                "not finished and the gradients accumulated so far are not in a checkpoint; call "
                "progress.finish_step() after optimizer.step() and zero_grad(), before on_step_end"
            )
        result = self.manager.save(step)
        self.last_saved_step = step
        return result


def _is_saved_by(manager: CheckpointManager, progress: Any) -> bool:
    """Whether ``progress`` is one of the objects ``manager`` saves (by identity)."""
    if manager.objects is not None:
        return any(obj is progress for obj in manager.objects.values())
    custom = getattr(manager.accelerator, "_custom_objects", None) or []
    return any(obj is progress for obj in custom)
