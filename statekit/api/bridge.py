"""The Accelerate bridge: ``save_state``/``load_state`` of a whole run, and ``attach``.

``save_state(accelerator, url)`` collects what ``Accelerator.save_state`` saves
(``_models``, ``_optimizers``, ``_schedulers``, ``_dataloaders``, ``_custom_objects``,
the GradScaler, the step counter) under stable keys (``model_0``, ``optimizer_0``,
``scheduler_0``, ``dataloader_0``, ``custom_0``, ``scaler``, ``accelerator``) and runs the
engine, so a plugin that takes ``model_0`` leaves ``model_1`` its own file name.

``attach(accelerator)`` prepares the run for exact resume (data loader tracking and the
``statekit_attach`` hooks) and registers Accelerate's own pre-hooks, so code that keeps
calling ``accelerator.save_state(dir)`` runs the statekit plugins, writes a manifest and
gets post-hooks, which Accelerate lacks. accelerate is never imported here: the
accelerator object is only used through its attributes.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from typing import Any

from statekit._version import __version__
from statekit import distributed, format as fmt
from statekit.engine import data
from statekit.api import saveload as engine
from statekit.engine.context import CORE, Checkpoint
from statekit.api.saveload import Entry
from statekit.errors import CorruptCheckpointError
from statekit.api.accelerate_hooks import ensure_registered as _ensure_hooks_plugin
from statekit.hooks.registry import call_each, get_plugin_manager
from statekit.storage import Storage


class AcceleratorCounters:
    """The accelerator's own counters as a Stateful object: ``step`` (gradient accumulation
    step) and ``project_configuration.iteration`` (automatic checkpoint naming).

    Both are saved; a load restores ``step`` only and leaves ``iteration`` alone, as
    ``Accelerator.load_state`` does: ``iteration`` counts the saves of *this* process and
    names its next ``checkpoint_<n>``, so rewinding it would aim the next save at an
    existing checkpoint.
    """

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator

    def state_dict(self) -> dict[str, int]:
        """Returns ``{"step": int, "iteration": int}``."""
        config = getattr(self.accelerator, "project_configuration", None)
        return {"step": int(self.accelerator.step), "iteration": int(getattr(config, "iteration", 0) or 0)}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Set ``step`` back (``iteration`` is left as it is, see the class docstring)."""
        self.accelerator.step = int(state["step"])


def collect(accelerator: Any) -> list[Entry]:
    """The run's stateful objects under stable keys, in Accelerate's order.

    Args:
        accelerator: an ``accelerate.Accelerator`` after ``prepare()``.

    Returns:
        Engine entries: ``model_<i>``, ``optimizer_<i>``, ``scheduler_<i>``,
        ``dataloader_<i>`` (per rank), ``custom_<i>``, ``scaler`` (if any), ``accelerator``.
    """
    entries = [Entry(f"model_{i}", "model", m) for i, m in enumerate(accelerator._models)]
    entries += [Entry(f"optimizer_{i}", "optimizer", o) for i, o in enumerate(accelerator._optimizers)]
    entries += [Entry(f"scheduler_{i}", "scheduler", s) for i, s in enumerate(accelerator._schedulers)]
    entries += [Entry(f"dataloader_{i}", "dataloader", d, per_rank=True) for i, d in enumerate(accelerator._dataloaders)]
    entries += [Entry(f"custom_{i}", "custom", c) for i, c in enumerate(accelerator._custom_objects)]
    if getattr(accelerator, "scaler", None) is not None:
        entries.append(Entry("scaler", "scaler", accelerator.scaler))
    entries.append(Entry("accelerator", "custom", AcceleratorCounters(accelerator)))
    return entries


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
    **options: Any,
) -> Any:
    """Save everything ``Accelerator.save_state`` saves, in the statekit format, to any URL.

    Call it on every process (as ``accelerator.save_state``).

    Args:
        accelerator: an ``accelerate.Accelerator`` after ``prepare()``.
        url: checkpoint directory URL (local path, ``memory://``, ``s3://``...).
        step: training step for the manifest (default: None).
        metadata: JSON-able metadata for the manifest.
        overwrite: replace a committed checkpoint at ``url``.
        storage_options: fsspec options.
        blocking: False: stage to host memory and write in the background (returns a
            :class:`statekit.api.asyncsave.PendingSave`).
        staging: a :class:`statekit.engine.staging.StagingPool` to reuse (async saves).
        exclusive: fail if another saver commits this checkpoint first.
        after_commit: ``callable()`` run right after the commit (used by the manager).
        **options: plugin options (``checkpoint.options``).

    Returns:
        The committed manifest (or a ``PendingSave`` when not ``blocking``).

    Raises:
        CheckpointExistsError, PluginError, UnsupportedValueError, StorageError: as
            :func:`statekit.save`.
    """
    _ensure_hooks_plugin(get_plugin_manager())
    result = engine.save_objects(
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
    **options: Any,
) -> dict[str, Any]:
    """Restore a run saved by :func:`save_state`, or a directory written by
    ``Accelerator.save_state`` (its pickle files only with ``allow_pickle=True``).

    Args:
        accelerator: the ``accelerate.Accelerator`` of the resumed run, after ``prepare()``
            of the same objects in the same order.
        url: checkpoint directory URL.
        verify: check sizes and checksums while reading.
        allow_pickle: allow the pickle files of an Accelerate-format directory.
        storage_options: fsspec options.
        **options: plugin options.

    Returns:
        The manifest (for an Accelerate directory, a summary with ``format: "accelerate"``).

    Raises:
        StatekitError: as :func:`statekit.load` (``CheckpointNotFoundError``,
            ``IncompleteCheckpointError``, ``CorruptCheckpointError``,
            ``StateMismatchError``, ``PluginError``, ``PluginMissingError``).
        PickleNotAllowedError: an Accelerate-format directory and not ``allow_pickle``.
    """
    _ensure_hooks_plugin(get_plugin_manager())
    return engine.load_objects(
        url,
        collect(accelerator),
        verify=verify,
        storage_options=storage_options,
        options=options,
        accelerator=accelerator,
        allow_pickle=allow_pickle,
    )


class Attachment:
    """Handle returned by :func:`attach`; ``remove()`` undoes the hooks and wrappers.

    Args:
        accelerator: the attached ``accelerate.Accelerator`` (None for the mapping API).
        objects: the run's stateful objects by stable key.
    """

    def __init__(self, accelerator: Any, objects: dict[str, Any]) -> None:
        self.accelerator = accelerator
        self.objects = objects
        self._handles: list[Any] = []
        self._pending: Checkpoint | None = None

    def remove(self) -> None:
        """Unregister the Accelerate hooks and restore ``save_state``/``load_state``.
        Data loaders stay tracked (tracking has no cost and keeps positions exact)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self.accelerator is not None:
            for name in ("save_state", "load_state", "prepare"):
                self.accelerator.__dict__.pop(name, None)
            if self.accelerator.__dict__.get("_statekit_attachment") is self:
                del self.accelerator.__dict__["_statekit_attachment"]


def attach(accelerator: Any = None, objects: Mapping[str, Any] | None = None) -> Attachment:
    """Attach statekit to a run before its training loop starts.

    Tracks every data loader (exact mid-epoch resume, see :mod:`statekit.engine.data`), calls
    the ``statekit_attach`` hooks once, and, with an accelerator, registers Accelerate's
    ``register_save_state_pre_hook``/``register_load_state_pre_hook`` and wraps this
    instance's ``save_state``/``load_state`` so they run the statekit pre- and post-hooks
    and write a manifest. Idempotent per accelerator.

    Args:
        accelerator: an ``accelerate.Accelerator`` after ``prepare()``, or None.
        objects: for runs without Accelerate, the mapping given to :func:`statekit.save`.

    Returns:
        An :class:`Attachment`; ``.remove()`` detaches.

    Raises:
        PluginError: a ``statekit_attach`` implementation failed.
    """
    if accelerator is not None and "_statekit_attachment" in accelerator.__dict__:
        return accelerator.__dict__["_statekit_attachment"]
    attachment = Attachment(accelerator, {})
    if accelerator is not None:
        _adopt(attachment, {e.key: e.obj for e in collect(accelerator) if e.kind != "model"})
        _register_accelerate_hooks(accelerator, attachment)
        _wrap_prepare(accelerator, attachment)
        accelerator.__dict__["_statekit_attachment"] = attachment
    else:
        _adopt(attachment, {k: v for k, v in (objects or {}).items() if not hasattr(v, "parameters")})
    return attachment


def _adopt(attachment: Attachment, table: dict[str, Any]) -> None:
    """Track the loaders among ``table`` and run ``statekit_attach`` for it."""
    for obj in table.values():
        if _is_loader(obj):
            data.track(obj)
    attachment.objects.update(table)
    call_each(get_plugin_manager(), "statekit_attach", None, {"accelerator": attachment.accelerator, "objects": dict(table)})


def _wrap_prepare(accelerator: Any, attachment: Attachment) -> None:
    """Objects prepared after ``attach`` (attach right after ``Accelerator()``, or several
    ``prepare`` calls) join the attachment, so their loaders are tracked before the first
    epoch starts."""
    original = accelerator.prepare

    def prepare(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        table = {e.key: e.obj for e in collect(accelerator) if e.kind != "model"}
        added = {k: v for k, v in table.items() if attachment.objects.get(k) is not v}
        if added:
            _adopt(attachment, added)
        return result

    prepare.__doc__ = getattr(original, "__doc__", None)
    accelerator.__dict__["prepare"] = prepare


def _is_loader(obj: Any) -> bool:
    from torch.utils.data import DataLoader

    return isinstance(obj, DataLoader)


# --------------------------------------------------------------------------- attach mode


def _register_accelerate_hooks(accelerator: Any, attachment: Attachment) -> None:
    """Register Accelerate pre-hooks and wrap this instance's ``save_state``/``load_state``.

    The checkpoint context is built inside the pre-hooks, from the directory Accelerate
    passes them: Accelerate resolves automatic checkpoint naming (``checkpoint_<n>``) and
    ``load_state()`` without an argument (the newest folder) before it calls its hooks, so
    statekit writes and reads exactly where Accelerate does.
    """
    originals = {"save": accelerator.save_state, "load": accelerator.load_state}

    def context(mode: str, directory: Any) -> Checkpoint:
        if attachment._pending is None:  # first hook of this call (or a call through the class)
            attachment._pending = _attach_checkpoint(accelerator, os.fspath(directory), mode, attachment)
        return attachment._pending

    def save_pre_hook(models: list[Any], weights: list[Any], output_dir: str) -> None:
        checkpoint = context("save", output_dir)
        hook_models = list(models)  # plugins get a copy: Accelerate's _models must stay intact
        hook_weights = list(weights)
        owners: dict[str, str] = checkpoint.__dict__.setdefault("attach_owners", {})
        call_each(
            get_plugin_manager(),
            "statekit_save_state_pre",
            checkpoint,
            {"models": hook_models, "weights": hook_weights, "output_dir": checkpoint.url, "checkpoint": checkpoint},
            after_each=engine._track_claims(checkpoint, hook_models, hook_weights, checkpoint._model_keys, owners),
        )
        kept = {id(w) for w in hook_weights}
        weights[:] = [w for w in weights if id(w) in kept]
        checkpoint.plugin = None
        for key, obj in attachment.objects.items():  # exact positions, which Accelerate does not keep
            if _is_loader(obj):
                checkpoint.save_state(f"{key}/rank-{checkpoint.rank:05d}", data.loader_state(obj))

    def load_pre_hook(models: list[Any], input_dir: str) -> None:
        checkpoint = context("load", input_dir)
        _check_statekit_files(checkpoint)  # before Accelerate restores anything
        hook_models = list(models)
        call_each(
            get_plugin_manager(),
            "statekit_load_state_pre",
            checkpoint,
            {"models": hook_models, "input_dir": checkpoint.url, "checkpoint": checkpoint},
        )
        kept = {id(m) for m in hook_models}
        models[:] = [m for m in models if id(m) in kept]

    def finish_save(checkpoint: Checkpoint) -> None:
        accelerator.wait_for_everyone()
        checkpoint.manifest = _commit_attached(accelerator, checkpoint)
        distributed.barrier()
        checkpoint._writable = False
        call_each(
            get_plugin_manager(),
            "statekit_save_state_post",
            checkpoint,
            {"models": list(accelerator._models), "output_dir": checkpoint.url, "checkpoint": checkpoint},
        )

    def finish_load(checkpoint: Checkpoint) -> None:
        for key, obj in attachment.objects.items():
            rel = f"{key}/rank-{checkpoint.rank:05d}.json"
            if _is_loader(obj) and checkpoint.storage.exists(rel):
                data.restore_loader(obj, checkpoint.load_state(rel[: -len(".json")]))
        call_each(
            get_plugin_manager(),
            "statekit_load_state_post",
            checkpoint,
            {"models": list(accelerator._models), "input_dir": checkpoint.url, "checkpoint": checkpoint},
        )

    def wrapper(mode: str, finish: Any) -> Any:
        def call(directory: Any = None, *args: Any, **kwargs: Any) -> Any:
            attachment._pending = None
            try:
                result = originals[mode](directory, *args, **kwargs)
                if attachment._pending is not None:  # None: Accelerate returned before its hooks
                    finish(attachment._pending)
                return result
            finally:
                attachment._pending = None

        call.__name__ = f"{mode}_state"
        call.__doc__ = getattr(originals[mode], "__doc__", None)
        return call

    for hook in (save_pre_hook, load_pre_hook):
        hook.statekit_attach_hook = True  # type: ignore[attr-defined]  # not a user hook: see accelerate_hooks
    attachment._handles.append(accelerator.register_save_state_pre_hook(save_pre_hook))
    attachment._handles.append(accelerator.register_load_state_pre_hook(load_pre_hook))
    accelerator.__dict__["save_state"] = wrapper("save", finish_save)
    accelerator.__dict__["load_state"] = wrapper("load", finish_load)


def _attach_checkpoint(accelerator: Any, url: str, mode: str, attachment: Attachment) -> Checkpoint:
    storage = Storage(url)
    manifest = None
    if mode == "load" and storage.exists(fmt.MANIFEST_NAME):
        manifest = engine.read_manifest(storage)
    models = list(accelerator._models)
    keys = {id(m): f"model_{i}" for i, m in enumerate(models)}
    keys.update({id(engine.unwrap_model(m, accelerator)): f"model_{i}" for i, m in enumerate(models)})
    checkpoint = Checkpoint(
        storage,
        mode=mode,
        rank=accelerator.process_index,
        world_size=accelerator.num_processes,
        step=getattr(accelerator, "step", None),
        accelerator=accelerator,
        objects=dict(attachment.objects),  # read-only in attach mode: Accelerate saves them
        model_keys=keys,
        manifest=manifest,
        verify=False,  # Accelerate reads its own files; statekit's are small
    )
    checkpoint.accelerate_runs_hooks = True  # Accelerate calls its registered hooks itself
    return checkpoint


def _check_statekit_files(checkpoint: Checkpoint) -> None:
    """Fail before Accelerate restores anything if a file statekit or a plugin wrote is
    missing or has the wrong size (a half-restored run is worse than a refused load)."""
    if checkpoint.manifest is None:
        return
    for rel, entry in checkpoint.manifest["files"].items():
        if entry.get("writer") == "accelerate":
            continue
        url = checkpoint.storage.url_of(rel)
        if not checkpoint.storage.exists(rel):
            raise CorruptCheckpointError(f"{url}: file is missing (listed in the manifest); nothing was loaded", path=url)
        size = checkpoint.storage.size(rel)
        if size != entry["size_bytes"]:
            raise CorruptCheckpointError(
                f"{url}: size {size} bytes, the manifest says {entry['size_bytes']}; nothing was loaded", path=url
            )


def _commit_attached(accelerator: Any, checkpoint: Checkpoint) -> dict[str, Any]:
    """Manifest for a directory Accelerate wrote: every file checksummed (rank 0 reads
    back Accelerate's files; statekit's own were checksummed while written)."""
    gathered = distributed.gather_to_rank0(checkpoint.files)
    owners = checkpoint.__dict__.get("attach_owners", {})
    manifest = None
    if checkpoint.rank == 0:
        storage = checkpoint.storage
        for rank_files in gathered or []:
            checkpoint.files.update(rank_files)
        checkpoint.record_unlisted("accelerate")
        files = checkpoint.files
        pm = get_plugin_manager()
        plugins = sorted({f["writer"] for f in files.values()} - {CORE, "accelerate"} | set(checkpoint.all_records()))
        manifest = {
            "format": fmt.FORMAT,
            "statekit_version": __version__,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z"),
            "step": checkpoint.step,
            "world_size": checkpoint.world_size,
            "plugins": {n: (pm.sources[n].version if n in pm.sources and pm.sources[n].version else "unknown") for n in plugins},
            "objects": {
                f"model_{i}": {"kind": "model", "owner": owners.get(f"model_{i}", "accelerate"), "per_rank": False, "files": []}
                for i in range(len(accelerator._models))
            },
            "records": {**checkpoint.all_records(), CORE: {"layout": "accelerate"}},
            "files": files,
            "metadata": {},
        }
        engine._commit(storage, manifest, exclusive=False)
    return distributed.broadcast_from_rank0(manifest)
