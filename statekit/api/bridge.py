"""The Accelerate bridge: ``save_state``/``load_state`` of a whole run, drop-in for
``Accelerator.save_state``/``load_state`` (docs/design-notes.md, "Accelerate conformance").
accelerate is never imported here: the accelerator is only used through its attributes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from statekit.api import loading, saveload
from statekit.api.accelerate_hooks import ensure_registered as _ensure_hooks_plugin
from statekit.engine.entries import Entry
from statekit.engine import gradients
from statekit.engine.gradients import AccumulatedGradients, check_can_save
from statekit.errors import StatekitWarning, warn_user
from statekit.foreign.base import ForeignSummary
from statekit.format.manifest_types import Manifest
from statekit.hooks.registry import get_plugin_manager


class AcceleratorCounters:
    """The accelerator's ``step`` and ``project_configuration.iteration`` as a Stateful
    object. A load restores ``step`` only, as ``Accelerator.load_state`` does: ``iteration``
    names this process's next ``checkpoint_<n>``, so rewinding it would aim at an existing one.
    """

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator

    def state_dict(self) -> dict[str, int]:
        """Returns ``{"step": int, "iteration": int}``."""
        config = getattr(self.accelerator, "project_configuration", None)
        return {"step": int(self.accelerator.step), "iteration": int(getattr(config, "iteration", 0) or 0)}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Set ``step`` back (``iteration`` is left as it is)."""
        self.accelerator.step = int(state["step"])


def collect(accelerator: Any, for_load: bool = False) -> list[Entry]:
    """The prepared accelerator's stateful objects under stable keys, in Accelerate's order:
    ``model_<i>``, ``optimizer_<i>``, ``scheduler_<i>``, ``dataloader_<i>`` (per rank),
    ``custom_<i>``, ``scaler`` (if any), ``accelerator``, and ``gradients`` (per rank,
    optional, :class:`statekit.engine.gradients.AccumulatedGradients`) with
    ``gradient_accumulation_steps > 1``, gradients no optimizer step consumed (accumulation
    by hand), or ``for_load`` (a load, or an attachment, which serves both)."""
    entries = [Entry(f"model_{i}", "model", m) for i, m in enumerate(accelerator._models)]
    entries += [Entry(f"optimizer_{i}", "optimizer", o) for i, o in enumerate(accelerator._optimizers)]
    entries += [Entry(f"scheduler_{i}", "scheduler", s) for i, s in enumerate(accelerator._schedulers)]
    entries += [Entry(f"dataloader_{i}", "dataloader", d, per_rank=True) for i, d in enumerate(accelerator._dataloaders)]
    entries += [Entry(f"custom_{i}", "custom", c) for i, c in enumerate(accelerator._custom_objects)]
    if getattr(accelerator, "scaler", None) is not None:
        entries.append(Entry("scaler", "scaler", accelerator.scaler))
    entries.append(Entry("accelerator", "custom", AcceleratorCounters(accelerator)))
    gradients.watch_optimizer_steps()  # marks what each optimizer step consumes: pending_by_hand
    if int(getattr(accelerator, "gradient_accumulation_steps", 1) or 1) > 1 or for_load or gradients.pending_by_hand(accelerator):
        # optional: a checkpoint saved without accumulation (or by Accelerate) has none
        entries.append(Entry("gradients", "custom", AccumulatedGradients(accelerator), per_rank=True, optional=True))
    return entries


_PREPARED = ("_models", "_optimizers", "_schedulers", "_dataloaders", "_custom_objects")


def warn_if_nothing_prepared(accelerator: Any, url: str, verb: str) -> None:
    """Warn (StatekitWarning, at the user's line) when the accelerator holds nothing
    prepared or registered: a resume would "succeed" into a run that trains from scratch.
    ``verb`` is ``"saved"`` or ``"loaded"``, for the message."""
    if not any(getattr(accelerator, name, None) for name in _PREPARED):
        warn_user(
            f"{url}: the accelerator holds no model, optimizer, scheduler or data loader, so only its step "
            f"counters are {verb}: call accelerator.prepare(model, optimizer, ...) (or "
            "accelerator.register_for_checkpointing(obj)) before saving or resuming",
            StatekitWarning,
        )


def save_state(
    accelerator: Any,
    url: str,
    *,
    step: int | None = None,
    metadata: dict[str, Any] | None = None,
    overwrite: bool = False,
    storage_options: dict[str, Any] | None = None,
    blocking: bool = True,
    staging: Any = None,
    exclusive: bool = False,
    after_commit: Any = None,
    incremental: bool = False,
    reuse_from: Any = None,
    lineage: Any = None,
    host_memory_budget: int | float | None = None,
    moment: Any = None,
    **options: Any,
) -> Any:
    """Save everything ``Accelerator.save_state`` saves, in the statekit format, to any URL.

    Call it on every process (as ``accelerator.save_state``). ``step``, ``metadata``,
    ``overwrite``, ``storage_options``, ``blocking``, ``host_memory_budget`` and ``**options`` are as
    :func:`statekit.save`; ``staging``, ``exclusive``, ``after_commit``, ``incremental``,
    ``reuse_from``, ``lineage`` and ``moment`` are the manager's (:func:`statekit.api.saveload.save_objects`).

    Args:
        accelerator: an ``accelerate.Accelerator`` after ``prepare()``.
        url: checkpoint directory URL (local path, ``memory://``, ``s3://``...).

    Returns:
        The committed manifest (or a ``PendingSave`` when not ``blocking``).

    Raises:
        CheckpointExistsError, PluginError, UnsupportedValueError, StorageError: as
            :func:`statekit.save`.
        StatekitError: saved between two optimizer steps of gradient accumulation under
            DeepSpeed or FSDP, whose accumulated gradients statekit cannot save (nothing is
            written; save when ``accelerator.sync_gradients`` is True).
    """
    _ensure_hooks_plugin(get_plugin_manager())
    get_plugin_manager().check_options(options, save_state)
    check_can_save(accelerator)  # before anything is written
    warn_if_nothing_prepared(accelerator, url, "saved")
    result = saveload.save_objects(
        url,
        collect(accelerator),
        step=step,
        metadata=metadata,
        overwrite=overwrite,
        storage_options=storage_options,
        options=options,
        accelerator=accelerator,
        blocking=blocking,
        staging=staging,
        exclusive=exclusive,
        after_commit=after_commit,
        incremental=incremental,
        reuse_from=reuse_from,
        lineage=lineage,
        host_memory_budget=host_memory_budget,
        moment=moment,
    )
    config = getattr(accelerator, "project_configuration", None)
    if config is not None:  # as Accelerator.save_state: one more save of this run
        config.iteration = int(getattr(config, "iteration", 0) or 0) + 1
    return result


def load_state(
    accelerator: Any,
    url: str,
    *,
    verify: bool = True,
    allow_pickle: bool = False,
    storage_options: dict[str, Any] | None = None,
    strict: bool = True,
    strict_resume: bool = False,
    **options: Any,
) -> Manifest | ForeignSummary:
    """Restore a run saved by :func:`save_state`, or a directory written by
    ``Accelerator.save_state`` (its pickle files only with ``allow_pickle=True``).

    ``url``, ``verify``, ``allow_pickle``, ``storage_options``, ``strict_resume`` and
    ``**options`` are as :func:`statekit.load`.

    Args:
        accelerator: the ``accelerate.Accelerator`` of the resumed run, after ``prepare()``
            of the same objects in the same order.
        strict: as :func:`statekit.load`; a directory ``Accelerator.save_state`` wrote
            loads all or nothing.

    Returns:
        The manifest (:class:`statekit.Manifest`); for a directory
        ``Accelerator.save_state`` wrote, a :class:`statekit.ForeignSummary`.

    Raises:
        StatekitError: as :func:`statekit.load` (``CheckpointNotFoundError``,
            ``IncompleteCheckpointError``, ``CorruptCheckpointError``,
            ``StateMismatchError``, ``PluginError``, ``PluginMissingError``).
        PickleNotAllowedError: an Accelerate-format directory and not ``allow_pickle``.
        ResumeMismatchError: see ``strict_resume``; nothing was loaded.
        StateMismatchError: also with ``strict_resume``, when a loaded tensor differs from
            the state saved (the load completed).
    """
    _ensure_hooks_plugin(get_plugin_manager())
    get_plugin_manager().check_options(options, load_state)
    warn_if_nothing_prepared(accelerator, url, "loaded")
    return loading.load_objects(
        url,
        collect(accelerator, for_load=True),
        verify=verify,
        storage_options=storage_options,
        options=options,
        accelerator=accelerator,
        allow_pickle=allow_pickle,
        strict=strict,
        strict_resume=strict_resume,
    )
