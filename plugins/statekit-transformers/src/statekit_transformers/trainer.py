"""``StatekitTrainerMixin``: transformers' ``Trainer`` writes and resumes statekit checkpoints.

A user changes one line (``Trainer`` -> :class:`StatekitTrainer`, or mixes
:class:`StatekitTrainerMixin` into a ``Trainer`` subclass such as trl's ``SFTTrainer``).
Trainer keeps driving: when it would write ``checkpoint-<step>/`` the mixin saves that
step through a :class:`statekit.CheckpointManager` on ``args.output_dir`` instead, and when
it would read one back it reads through statekit, verified. The checkpoint keeps Trainer's
name and layout (``from_pretrained``, the Hub, ``trainer_state.json``); what was pickle
(optimizer, scheduler, scaler, RNG, training arguments) is safetensors and JSON.

What the mixin overrides (design-notes, "statekit-transformers"):

=================================  =======================================================
Trainer method                     with the mixin
=================================  =======================================================
``train``                          ``resume_from_checkpoint=True`` is the newest committed
                                   checkpoint, on either tier (Trainer's
                                   ``get_last_checkpoint`` takes the highest number,
                                   committed or not); an interrupted save is refused
``get_train_dataloader``           the loader is tracked by statekit from its first batch
``_save_checkpoint``               Trainer's best-model and callback bookkeeping, then
                                   ``manager.save(step)``
``_load_from_checkpoint``          deferred to the next one inside ``train()``; outside it,
                                   the model alone, verified
``_load_optimizer_and_scheduler``  the whole state in one verified load (model, optimizer,
                                   scheduler, scaler, loader position, random states)
``_load_scaler``, ``_load_rng_state``  nothing left to do
``_load_best_model``               the best checkpoint's model, verified
=================================  =======================================================

A checkpoint without a statekit manifest (Trainer's own, from before the plugin) goes
through Trainer's code in every one of them.

Every one of these names is checked on the Trainer class when the mixin is built: a
transformers release that renames one makes the construction fail, naming it, instead of
silently writing Trainer's own pickles.

This module is an integration, a client of statekit's public API (``import statekit``),
as user code is; the plugin hooks of :mod:`statekit_transformers.plugin` use only the
plugin API.
"""

from __future__ import annotations

import dataclasses

import inspect
import logging
import os
import sys
import warnings
from collections.abc import Mapping
from typing import Any

import statekit
from statekit_transformers.plugin import (
    MANIFEST_NAME, MODEL_KEY, OPTION, STATE_KEY, TRAINER_STATE_NAME, TRAINING_ARGS_NAME, TrainerStateFile,
)
from statekit_transformers.retention import RETENTION_KEYWORDS, TrainerRetention

logger = logging.getLogger("statekit.transformers")

__all__ = ["StatekitTrainerMixin", "SUPPORTED_TRANSFORMERS", "checkpoints_under", "statekit_trainer_class"]

SUPPORTED_TRANSFORMERS = ">=5.0,<5.25"
"""The transformers versions the mixin is tested with (the distribution's requirement)."""

# The Trainer methods the mixin overrides, with the parameters it calls them with.
_OVERRIDDEN: dict[str, tuple[str, ...]] = {
    "train": ("resume_from_checkpoint", "trial"),
    "_save_checkpoint": ("model", "trial"),
    "_load_from_checkpoint": ("resume_from_checkpoint", "model"),
    "_load_optimizer_and_scheduler": ("checkpoint",),
    "_load_scaler": ("checkpoint",),
    "_load_rng_state": ("checkpoint",),
    "_load_best_model": (),
    "get_train_dataloader": (),
    "_get_output_dir": ("trial",),
    "store_flos": (),
}
LOADER_KEY = "train_dataloader"
_SKIP_ABSORBED = r".*statekit's resume already continues epoch .* returns the loader itself"
_AFTER_LAST_BATCH = r".*the checkpoint was saved inside the for loop right after the last batch of epoch"
# TrainingArguments that decide which batches Trainer skips on a resume (global_step times
# gradient_accumulation_steps batches of per_device_train_batch_size): statekit's saved position
# stands for the saved values
_DATA_SETTINGS = ("per_device_train_batch_size", "gradient_accumulation_steps", "dataloader_drop_last",
                  "train_sampling_strategy", "group_by_length")


def check_trainer_api(trainer_cls: type) -> None:
    """Fail if the Trainer class lacks a method the mixin overrides, or its parameters changed.

    Raises:
        statekit.PluginError: names the method and the transformers version (plugin
            ``transformers``).
    """
    import transformers

    for name, params in _OVERRIDDEN.items():
        base = next((c.__dict__[name] for c in trainer_cls.__mro__ if c.__name__ == "Trainer" and name in c.__dict__), None)
        if base is None:
            raise statekit.PluginError(
                f"transformers {transformers.__version__}: Trainer.{name} does not exist; statekit-transformers "
                f"overrides it and supports transformers{SUPPORTED_TRANSFORMERS}",
                plugin_name="transformers",
            )
        have = list(inspect.signature(base).parameters)[1:]
        if list(params) != have[: len(params)]:
            raise statekit.PluginError(
                f"transformers {transformers.__version__}: Trainer.{name}{tuple(have)} changed (expected {params}); "
                f"statekit-transformers supports transformers{SUPPORTED_TRANSFORMERS}",
                plugin_name="transformers",
            )


def checkpoints_under(output_dir: str) -> list[tuple[int, str, bool]]:
    """The checkpoints a Trainer resume may continue from under ``output_dir``, oldest first.

    Returns:
        ``(step, path, is_statekit)`` for each committed statekit checkpoint and each
        Trainer folder written without statekit (:func:`statekit.list_checkpoints` tells them
        apart by content); an interrupted statekit save, an Accelerate or DCP folder are not
        among them.
    """
    if not os.path.isdir(output_dir):
        return []
    found = [
        (info.step, info.url, info.kind == "statekit")
        for info in statekit.list_checkpoints(os.path.abspath(output_dir), details=False)
        if info.kind in ("statekit", "trainer") and not info.accelerate
    ]
    return sorted(found)


def _is_statekit(path: Any) -> bool:
    return isinstance(path, (str, os.PathLike)) and os.path.isfile(os.path.join(path, MANIFEST_NAME))


class StatekitTrainerMixin:
    """Mix into a ``transformers.Trainer`` (sub)class: its checkpoints become statekit checkpoints.

    ``class MyTrainer(StatekitTrainerMixin, SFTTrainer): pass``, or use
    :class:`StatekitTrainer` (the mixin over ``Trainer``). Everything Trainer takes is taken
    unchanged; one keyword is added.

    Args:
        statekit_options: keyword arguments of :class:`statekit.CheckpointManager` beyond
            what ``TrainingArguments`` already says: ``async_save``, ``replicate_to`` (and
            the other two-tier options), ``save_on_signal``, ``incremental``,
            ``storage_options``... Retention is Trainer's ``save_total_limit`` rotation (the
            newest and the best checkpoint, ``state.best_model_checkpoint``, never deleted;
            the newest others up to the limit:
            :class:`~statekit_transformers.retention.TrainerRetention`); the
            :class:`statekit.RetentionPolicy` fields given here (``keep_every_n_steps``...,
            :data:`~statekit_transformers.retention.RETENTION_KEYWORDS`) keep more, a
            ``retention=`` replaces it.
        *args, **kwargs: ``Trainer``'s.

    Raises:
        statekit.PluginError: the installed transformers lacks a Trainer method the mixin
            overrides, or its parameters changed (a version outside
            :data:`SUPPORTED_TRANSFORMERS`), naming it.
        InvalidOptionError: a ``statekit_options`` entry the manager refuses.
    """

    def __init__(self, *args: Any, statekit_options: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        check_trainer_api(type(self))
        self.statekit_options = dict(statekit_options or {})
        self._statekit_manager: statekit.CheckpointManager | None = None
        self._statekit_objects: dict[str, Any] = {}
        self._statekit_resume: str | None = None  # the statekit checkpoint this train() resumes from
        self._statekit_loader: Any = None
        super().__init__(*args, **kwargs)
        if self._statekit_off:
            warnings.warn(
                "statekit-transformers: DeepSpeed/FSDP through Trainer are saved by their own engines; this "
                "Trainer's checkpoints stay Trainer's (no statekit manifest, pickles included)",
                statekit.StatekitWarning, stacklevel=2,
            )
        if self.statekit_options.get("save_on_signal") and not self._statekit_off:  # the manager's safe point after every step
            from statekit_transformers.preemption import SaveOnSignal

            self.add_callback(SaveOnSignal(self))

    @property
    def _statekit_off(self) -> bool:
        """DeepSpeed or FSDP through Trainer: their engines write and read the checkpoint
        (said once at construction); the mixin then leaves every checkpoint method to Trainer."""
        return bool(getattr(self, "is_deepspeed_enabled", False) or getattr(self, "is_fsdp_enabled", False))

    # ------------------------------------------------------------ the manager

    def _statekit_objects_now(self, resuming: bool = False) -> dict[str, Any]:
        """The objects of a checkpoint: the model, Trainer's state, the train loader, and the
        optimizer, scheduler and scaler (a resume asks for them even with ``save_only_model``:
        a checkpoint without them cannot continue a run)."""
        objects: dict[str, Any] = {MODEL_KEY: self.model, STATE_KEY: TrainerStateFile(self)}
        if self._statekit_loader is not None:
            objects[LOADER_KEY] = self._statekit_loader
        if resuming or not self.args.save_only_model:
            if self.optimizer is not None:
                objects["optimizer"] = self.optimizer
            if self.lr_scheduler is not None:
                objects["scheduler"] = self.lr_scheduler
            scaler = getattr(self.accelerator, "scaler", None)
            if scaler is not None:
                objects["scaler"] = scaler
        return objects

    def statekit_manager(self, run_dir: str | None = None) -> statekit.CheckpointManager:
        """The :class:`statekit.CheckpointManager` of this run's checkpoints (``args.output_dir``).

        Built on first use, and again when Trainer created new objects (a new ``train()``
        call builds a new optimizer), after the previous one's async save committed.

        Args:
            run_dir: the directory of ``checkpoint-<step>`` folders (default
                ``args.output_dir``; a hyperparameter search trial's own run directory).

        Returns:
            The manager (``step_digits=0``, retention: Trainer's ``save_total_limit``
            rotation, :class:`~statekit_transformers.retention.TrainerRetention`, plus
            ``statekit_options``).

        Raises:
            statekit.InvalidOptionError: a ``statekit_options`` entry the manager refuses.
        """
        run_dir = run_dir or self.args.output_dir
        objects = self._statekit_objects_now()
        same = self._statekit_manager is not None and self._statekit_manager.root_url.rstrip("/") == os.path.abspath(run_dir)
        if same and {k: id(v) for k, v in objects.items() if k != STATE_KEY} == {
            k: id(v) for k, v in self._statekit_objects.items() if k != STATE_KEY
        }:
            return self._statekit_manager
        if self._statekit_manager is not None:
            self._statekit_manager.__exit__(None, None, None)  # its async save commits, its signal handlers go
        options: dict[str, Any] = {"step_digits": 0, "incremental": True}
        given = dict(self.statekit_options)
        limit = self.args.save_total_limit
        if "retention" not in given:
            # Trainer's rotation (the newest and the best, up to the limit), plus the retention
            # fields given in statekit_options; without a limit Trainer keeps every checkpoint
            extra = {k: given.pop(k) for k in RETENTION_KEYWORDS if k in given}
            if limit is not None and limit > 0:
                options["retention"] = TrainerRetention(save_total_limit=limit, trainer=self, **extra)
            elif extra:
                options["retention"] = statekit.RetentionPolicy(**extra)
        options.update(given)
        options["save_on_signal"] = _without_watcher(options.get("save_on_signal", False))
        options[OPTION] = self
        os.makedirs(run_dir, exist_ok=True)
        self._statekit_objects = objects
        self._statekit_manager = statekit.CheckpointManager(objects, os.path.abspath(run_dir), **options)
        return self._statekit_manager

    # ------------------------------------------------------------ save

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        if self._statekit_off:
            return super()._save_checkpoint(model, trial)
        from transformers.trainer_callback import ExportableState
        from transformers.trainer_utils import SaveStrategy

        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        run_dir = self._get_output_dir(trial=trial)
        manager = self.statekit_manager(run_dir)
        step = self.state.global_step
        if self.args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST) and self.state.best_global_step:
            best = manager.url_for(self.state.best_global_step)
            if self.state.best_global_step == step or _is_statekit(best) or os.path.isdir(best):
                self.state.best_model_checkpoint = best
        if self.args.should_save:  # as Trainer: the callbacks' states, to where they are now
            for cb in [c for c in self.callback_handler.callbacks + [self.control] if isinstance(c, ExportableState)]:
                name = type(cb).__name__
                if isinstance(self.state.stateful_callbacks.get(name), list):
                    self.state.stateful_callbacks[name].append(cb.state())
                else:
                    self.state.stateful_callbacks[name] = cb.state()
        url = manager.url_for(step)
        replace = _is_statekit(url)
        if replace:  # as Trainer does: this step is written again (a resume from an older checkpoint, a new run)
            warnings.warn(f"statekit-transformers: replacing {url}, written earlier in this output_dir (as Trainer does)",
                          statekit.StatekitWarning, stacklevel=2)
        manager.save(step=step, metrics=self._statekit_metrics(step), overwrite=replace)
        if self.control.should_training_stop:
            # train()'s last save commits before Trainer's end of training reads the best
            # checkpoint and, with save_total_limit=1, deletes every folder but the best
            manager.wait()
        if self.args.push_to_hub:
            manager.wait()  # the Hub gets a committed checkpoint
            self._push_from_checkpoint(manager.url_for(step))

    def _statekit_metrics(self, step: int) -> dict[str, float] | None:
        """This step's evaluation metric (``metric_for_best_model``, from the evaluation log),
        recorded in the manifest (``statekit ls``; a ``keep_best`` given in ``statekit_options``)."""
        if not self.args.metric_for_best_model:
            return None
        key = _metric_key(self.args.metric_for_best_model)
        for entry in reversed(self.state.log_history):
            if entry.get("step") == step and key in entry:
                return {key: float(entry[key])}
        return None

    # ------------------------------------------------------------ resume

    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None, **kwargs: Any) -> Any:
        """``Trainer.train``; ``resume_from_checkpoint=True`` takes the newest committed
        checkpoint (or a Trainer folder written before statekit) under ``args.output_dir``.

        Raises:
            ValueError: ``True`` and no checkpoint to resume from (as Trainer).
            statekit.IncompleteCheckpointError: the path given is an interrupted statekit save.
        """
        if resume_from_checkpoint is False:  # as Trainer: no resume
            resume_from_checkpoint = None
        if resume_from_checkpoint is True:
            resume_from_checkpoint = self._statekit_newest()
            logger.info("resuming from %s", resume_from_checkpoint)
        if isinstance(resume_from_checkpoint, (str, os.PathLike)):
            resume_from_checkpoint = os.path.abspath(resume_from_checkpoint)
            parent, name = os.path.split(resume_from_checkpoint.rstrip(os.sep))
            kinds = {os.path.basename(i.url): i.kind for i in statekit.list_checkpoints(parent, details=False)} if os.path.isdir(parent) else {}
            if kinds.get(name) == "incomplete":
                raise statekit.IncompleteCheckpointError(
                    f"{resume_from_checkpoint}: an interrupted statekit save (never committed); resume from a committed one"
                )
        self._statekit_resume = resume_from_checkpoint if _is_statekit(resume_from_checkpoint) else None
        with warnings.catch_warnings():
            # Trainer skips the resumed epoch's consumed batches with accelerate's
            # skip_first_batches; statekit's restored loader continues there already and
            # comes back itself: expected here, not news for the user
            warnings.filterwarnings("ignore", message=_SKIP_ABSORBED, category=statekit.StatekitWarning)
            # Trainer derives the epoch from the step: a save at an epoch's last step is exact
            warnings.filterwarnings("ignore", message=_AFTER_LAST_BATCH, category=statekit.StatekitWarning)
            try:
                return super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial, **kwargs)
            finally:
                self._statekit_wait(failing=sys.exc_info()[0] is not None)

    def _statekit_wait(self, failing: bool) -> None:
        """Let an async save in flight commit before ``train()`` returns or raises (a
        failing run keeps its own error: the save's is then a warning)."""
        if self._statekit_manager is None:
            return
        if self._statekit_manager.signal_save is not None:  # save_on_signal: the handlers from before train()
            self._statekit_manager.signal_save.restore()
        try:
            self._statekit_manager.wait()
        except statekit.StatekitError as exc:
            if not failing:
                raise
            warnings.warn(f"statekit-transformers: {exc}", statekit.StatekitWarning, stacklevel=3)

    def _statekit_newest(self) -> str:
        """The checkpoint ``resume_from_checkpoint=True`` continues from: the newest committed
        one under ``args.output_dir`` or on a plugin's root (``replicate_to``: the remote
        tier), or a Trainer folder from before statekit. One that is only remote is first
        copied into ``args.output_dir`` (Trainer reads its checkpoint's folder itself).

        Raises:
            ValueError: none (as Trainer).
        """
        local = checkpoints_under(self.args.output_dir)
        newest = local[-1] if local else None
        if self.statekit_options.get("replicate_to"):
            for info, options in self.statekit_manager().candidates():
                if newest is None or info.step > newest[0]:
                    return self._statekit_fetch(info.url, options, info.step)
                break
        if newest is None:
            raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir})")
        return newest[1]

    def _statekit_fetch(self, url: str, storage_options: dict[str, Any] | None, step: int) -> str:
        """Copy a committed checkpoint from another root into ``args.output_dir`` (through a
        temporary name, renamed when complete and verified: never half a checkpoint)."""
        import shutil

        import fsspec

        local = os.path.join(os.path.abspath(self.args.output_dir), f"checkpoint-{step}")
        temporary = local + ".statekit-fetch"
        shutil.rmtree(temporary, ignore_errors=True)
        fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
        fs.get(path.rstrip("/") + "/", temporary + "/", recursive=True)
        statekit.verify(temporary)
        os.replace(temporary, local)
        logger.info("copied %s to %s (verified) to resume from it", url, local)
        return local

    def _statekit_load(self, path: str, objects: Mapping[str, Any]) -> Any:
        return statekit.load(path, objects, **{OPTION: self})

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if self._statekit_off or not _is_statekit(resume_from_checkpoint):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        if resume_from_checkpoint == self._statekit_resume:
            return None  # train()'s resume: the whole state loads at once, once the optimizer exists
        self._statekit_load(resume_from_checkpoint, {MODEL_KEY: model if model is not None else self.model})
        logger.info("loaded the model of %s (verified)", resume_from_checkpoint)
        return None

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if self._statekit_off or not _is_statekit(checkpoint):
            return super()._load_optimizer_and_scheduler(checkpoint)
        # model, optimizer, scheduler, scaler, trainer state: one verified load, fingerprint
        # compared (Trainer calls this after accelerator.prepare; values are copied in place)
        saved_args = _saved_arguments(checkpoint)
        if saved_args.get("save_only_model"):
            raise statekit.ResumeMismatchError(checkpoint, [
                "save_only_model True: the checkpoint holds no optimizer or scheduler state, so training cannot "
                "continue exactly from it (as transformers documents); resume from a checkpoint saved without it, "
                "or load the model with from_pretrained and start a new run"
            ])
        objects = self._statekit_objects_now(resuming=True)
        changed = _changed_data_settings(saved_args, self.args)
        if changed:
            warnings.warn(
                f"statekit-transformers: {checkpoint}: {'; '.join(changed)} since the save: the data position "
                "cannot be restored, Trainer skips the resumed epoch's first batches by the new settings: "
                "the resume is not exact",
                statekit.StatekitWarning, stacklevel=2,
            )
            objects.pop(LOADER_KEY, None)
        manifest = self._statekit_load(checkpoint, objects)
        self.statekit_manager().record_resume(checkpoint, manifest)
        logger.info("resumed the training state of %s (verified)", checkpoint)
        return None

    def _load_scaler(self, checkpoint: str | None) -> None:
        if not _is_statekit(checkpoint):
            return super()._load_scaler(checkpoint)
        return None  # loaded with the optimizer

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if not _is_statekit(checkpoint):
            return super()._load_rng_state(checkpoint)
        # restored with the training state; the tracked loader replays the draws of the
        # batches Accelerate fetched ahead before the save (statekit.loaders.fetch_rng)
        return None

    def get_train_dataloader(self) -> Any:
        """``Trainer.get_train_dataloader``, tracked by statekit from its first batch: the
        checkpoint holds its exact position and the random draws of the batches it read ahead."""
        loader = super().get_train_dataloader()
        if self._statekit_off:
            return loader
        statekit.attach(None, {LOADER_KEY: loader})
        self._statekit_loader = loader
        return loader

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        if not _is_statekit(best):
            return super()._load_best_model()
        logger.info("loading the best model from %s (score: %s)", best, self.state.best_metric)
        self._statekit_load(best, {MODEL_KEY: self.model})
        return None


def _saved_arguments(checkpoint: str) -> dict[str, Any]:
    """``training_args.json`` of a checkpoint (empty when absent: a checkpoint of another writer)."""
    import json

    path = os.path.join(checkpoint, TRAINING_ARGS_NAME)
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _changed_data_settings(saved: Mapping[str, Any], args: Any) -> list[str]:
    """``name saved -> now`` for each of :data:`_DATA_SETTINGS` that differs."""
    return [
        f"{name} {saved[name]!r} -> {getattr(args, name)!r}"
        for name in _DATA_SETTINGS
        if name in saved and hasattr(args, name) and saved[name] != getattr(args, name)
    ]


def _metric_key(name: str) -> str:
    return name if name.startswith("eval_") else f"eval_{name}"


def statekit_trainer_class(trainer_cls: type) -> type:
    """``trainer_cls`` with :class:`StatekitTrainerMixin` mixed in (``statekit_trainer_class(SFTTrainer)``).

    Raises:
        statekit.PluginError: as :class:`StatekitTrainerMixin`, at the first construction.
    """
    return type(f"Statekit{trainer_cls.__name__}", (StatekitTrainerMixin, trainer_cls), {"__module__": __name__})


def _without_watcher(save_on_signal: Any) -> Any:
    """``save_on_signal`` with the signal watcher off: a Trainer run saves at its step ends
    only. The watcher saves the boundary state of what declares one
    (``statekit_boundary_state``); Trainer's own state (``TrainerState``, its callbacks) does
    not yet, so a watcher save during an evaluation could record a later log history than
    the step's: not provably exact."""
    if save_on_signal is False or save_on_signal is None:
        return save_on_signal
    policy = save_on_signal if isinstance(save_on_signal, statekit.PreemptionPolicy) else (
        statekit.PreemptionPolicy() if save_on_signal is True else statekit.PreemptionPolicy(signals=save_on_signal))
    return dataclasses.replace(policy, watcher=False)

