"""Attach mode: ``statekit.attach(accelerator)`` and the code that keeps calling
``accelerator.save_state`` / ``load_state``.

``attach`` tracks the run's data loaders (exact mid-epoch resume, :mod:`statekit.loaders.data`),
runs the ``statekit_attach`` hooks, and for an accelerator registers Accelerate's own
pre-hooks and wraps this instance's ``save_state``, ``load_state`` and ``prepare``:

- the checkpoint context is built inside the pre-hooks, from the directory Accelerate
  hands them: Accelerate resolves automatic checkpoint naming (``checkpoint_<n>``) and
  ``load_state()`` without an argument (the newest folder) before it calls its hooks, so
  statekit writes and reads exactly where Accelerate does;
- statekit's pre-hooks run around the user's: a first one (the save lock; on load every
  check, every file's checksum included) before them, the plugins after them, on what the
  user's hooks left (diffusers' scripts save and pop their UNet themselves); so the random
  state statekit-rng saves is taken where Accelerate takes it;
- after Accelerate's save, the manifest lists and checksums every file (Accelerate's own,
  untouched, included) and the post-hooks run; after its load, statekit's exact loader
  positions replace Accelerate's and the post-hooks run;
- objects prepared after ``attach`` join the attachment.

accelerate is never imported here: the accelerator is used through its attributes.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Mapping
from typing import Any

from statekit import distributed, format as fmt
from statekit.api import fingerprint as fingerprints, skip_batches
from statekit.api.accelerate_hooks import HOOKS_PLUGIN, accelerate_directory, require_user_load_hooks
from statekit.api.bridge import collect
from statekit.api.loading import (
    apply_own_states, check_accelerate_load, check_loaded_state, check_owners_installed, check_statekit_files,
    read_own_states,
)
from statekit.api.saveload import log_committed, plugin_versions, record_next_batches
from statekit.checks import audit, next_batch, random_check, state_check
from statekit.engine import commit as commits, live_state
from statekit.loaders import data, own_skip, tracking
from statekit.engine.context import ACCELERATE_WRITER, CORE, Checkpoint
from statekit.engine.entries import unwrap_model
from statekit.engine.gradients import AccumulatedGradients, check_can_save
from statekit.engine.locking import lock_accelerate_save, mark_save_failed
from statekit.engine.read import verify_files
from statekit.errors import InvalidOptionError, StatekitWarning, warn_user
from statekit.format.manifest import MANIFEST_NAME, read_manifest
from statekit.format.manifest_types import Manifest, ObjectEntry
from statekit.hooks.claims import track_save_claims
from statekit.hooks.registry import call_each, get_plugin_manager
from statekit.progress import human
from statekit.storage import Storage

logger = logging.getLogger(__name__)


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
        self._started = 0.0  # time.perf_counter() when the current save_state/load_state began (log lines)
        self._step_counter: _StepCounter | None = None  # an accelerator's optimizer steps (_attached_step)

    def remove(self) -> None:
        """Unregister the Accelerate hooks and restore ``save_state``/``load_state``/``prepare``.
        Data loaders stay tracked (tracking has no cost and keeps positions exact)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._step_counter is not None:
            self._step_counter.remove()
        if self.accelerator is not None:
            for name in ("save_state", "load_state", "prepare", "skip_first_batches"):
                self.accelerator.__dict__.pop(name, None)
            if self.accelerator.__dict__.get("_statekit_attachment") is self:
                del self.accelerator.__dict__["_statekit_attachment"]


def attach(accelerator: Any = None, objects: Mapping[str, Any] | None = None) -> Attachment:
    """Attach statekit to a run before its training loop starts.

    Tracks every data loader, calls the ``statekit_attach`` hooks, and, with an
    accelerator, registers Accelerate's ``register_save_state_pre_hook`` /
    ``register_load_state_pre_hook`` and wraps this instance's ``save_state`` /
    ``load_state`` / ``prepare`` (see the module docstring). Call it right after
    ``Accelerator()`` or after ``prepare()``. Idempotent per accelerator.

    Args:
        accelerator: an ``accelerate.Accelerator``, or None.
        objects: for runs without Accelerate, the mapping given to :func:`statekit.save`.

    Returns:
        An :class:`Attachment`; ``.remove()`` detaches.

    Warns:
        StatekitWarning: the accelerator belongs to a transformers ``Trainer``, which never
            calls ``accelerator.save_state``: attaching changes nothing there (the warning
            names statekit-transformers, ``docs/plugins/transformers.md``).

    Raises:
        InvalidOptionError: ``accelerator`` is a transformers ``Trainer`` (names what to use).
        PluginError: a ``statekit_attach`` implementation failed.
    """
    if accelerator is not None and "_statekit_attachment" in accelerator.__dict__:
        return accelerator.__dict__["_statekit_attachment"]
    if accelerator is not None:
        _refuse_a_trainer(accelerator)
        _warn_if_owner_never_saves(accelerator)
    attachment = Attachment(accelerator, {})
    # accelerate.skip_first_batches (the function) after a resume: a mapping's loader may be
    # one Accelerate prepared (transformers' Trainer skips with it)
    skip_batches.install()
    if accelerator is None:
        _adopt(attachment, {k: v for k, v in (objects or {}).items() if not hasattr(v, "parameters")})
        return attachment
    _adopt(attachment, _non_models(accelerator))
    _AttachedCalls(accelerator, attachment).install()
    accelerator.__dict__["_statekit_attachment"] = attachment
    return attachment


_TRAINER_HELP = (
    "transformers' Trainer never calls accelerator.save_state/load_state, so statekit attached to its "
    "accelerator changes nothing: Trainer's checkpoints are statekit checkpoints with "
    "statekit_transformers.StatekitTrainer in place of Trainer, which needs no attach "
    "(pip install statekit-transformers; docs/plugins/transformers.md)"
)


def _is_trainer(obj: Any) -> bool:
    """A transformers ``Trainer`` (or subclass), told by class name and module, not imported."""
    return any(c.__name__ == "Trainer" and c.__module__.startswith("transformers.") for c in type(obj).__mro__)


def _refuse_a_trainer(obj: Any) -> None:
    if _is_trainer(obj):
        raise InvalidOptionError(f"statekit.attach() takes an accelerate.Accelerator, not a {type(obj).__name__}: {_TRAINER_HELP}")


def _warn_if_owner_never_saves(accelerator: Any) -> None:
    """Warn when a transformers ``Trainer`` holds ``accelerator`` (``trainer.accelerator``).

    The owner is found among the objects referring to the accelerator (one scan of the
    garbage collector's objects, once per attach).
    """
    import gc

    for holder in gc.get_referrers(accelerator):
        if not isinstance(holder, dict):
            continue
        for owner in gc.get_referrers(holder):
            if getattr(owner, "__dict__", None) is holder and _is_trainer(owner):
                warn_user(f"statekit.attach({type(accelerator).__name__}) of a {type(owner).__name__}: {_TRAINER_HELP}", StatekitWarning)
                return


def _non_models(accelerator: Any) -> dict[str, Any]:
    return {e.key: e.obj for e in collect(accelerator) if e.kind != "model"}


def _adopt(attachment: Attachment, table: dict[str, Any]) -> None:
    """Track the loaders among ``table`` and run ``statekit_attach`` for it."""
    for obj in table.values():
        if data.is_loader(obj):
            tracking.track(obj)
    attachment.objects.update(table)
    call_each(get_plugin_manager(), "statekit_attach", None, {"accelerator": attachment.accelerator, "objects": dict(table)})


class _AttachedCalls:
    """The pre-hooks registered with Accelerate and the wrappers of one attached accelerator."""

    def __init__(self, accelerator: Any, attachment: Attachment) -> None:
        self.accelerator = accelerator
        self.attachment = attachment
        self.originals = {name: getattr(accelerator, name) for name in ("save_state", "load_state", "prepare")}
        self.originals["skip_first_batches"] = getattr(accelerator, "skip_first_batches", None)

    def install(self) -> None:
        """Register the pre-hooks and put the wrappers on the instance."""
        hooks = (self.save_first_hook, self.save_pre_hook, self.load_first_hook, self.load_pre_hook)
        for hook in hooks:
            hook.__func__.statekit_attach_hook = True  # not a user hook: see api.accelerate_hooks
        handles = self.attachment._handles
        for hook in hooks[:2]:
            handles.append(self.accelerator.register_save_state_pre_hook(hook))
        for hook in hooks[2:]:
            handles.append(self.accelerator.register_load_state_pre_hook(hook))
        self.accelerator.__dict__["save_state"] = self._wrapper("save", self.finish_save)
        self.accelerator.__dict__["load_state"] = self._wrapper("load", self.finish_load)
        self.accelerator.__dict__["prepare"] = self.prepare
        if self.originals["skip_first_batches"] is not None:
            self.accelerator.__dict__["skip_first_batches"] = self.skip_first_batches
        self.attachment._step_counter = _StepCounter(self.accelerator)

    def _order_hooks(self, mode: str) -> None:
        """Put statekit's first hook before and its main hook after every hook the user
        registered, before each ``save_state``/``load_state`` (the user may register hooks
        at any time): user hooks get Accelerate's own ``models``/``weights`` lists, and the
        plugins see what the user's hooks left (docs/design-notes.md, "Attach mode under the scripts users run")."""
        table = getattr(self.accelerator, "_save_model_state_pre_hook" if mode == "save" else "_load_model_state_pre_hook", None)
        if not hasattr(table, "move_to_end"):
            return
        first, last = self.attachment._handles[:2] if mode == "save" else self.attachment._handles[2:4]
        if first.id in table:
            table.move_to_end(first.id, last=False)
        if last.id in table:
            table.move_to_end(last.id, last=True)

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """``Accelerator.skip_first_batches``, except after a resume of a tracked loader:
        statekit's restored position already skips the consumed batches (and replays the
        epoch's permutation), so the loader itself is returned (see
        :func:`statekit.loaders.data.skip_after_resume`)."""
        same = data.skip_after_resume(dataloader, num_batches)
        return dataloader if same else self.originals["skip_first_batches"](dataloader, num_batches)

    def prepare(self, *args: Any, **kwargs: Any) -> Any:
        """``Accelerator.prepare``; the objects it adds join the attachment."""
        result = self.originals["prepare"](*args, **kwargs)
        self.attachment._step_counter.watch()
        added = {k: v for k, v in _non_models(self.accelerator).items() if self.attachment.objects.get(k) is not v}
        if added:
            _adopt(self.attachment, added)
        return result

    def _wrapper(self, mode: str, finish: Any) -> Any:
        original = self.originals[f"{mode}_state"]
        attachment = self.attachment

        def call(directory: Any = None, *args: Any, **kwargs: Any) -> Any:
            if directory is None:  # accelerator.save_state(output_dir=...) / load_state(input_dir=...)
                directory = kwargs.pop("output_dir" if mode == "save" else "input_dir", None)
            directory = accelerate_directory(directory, mode)  # file:// -> local path; other URLs refused
            state_check.mode()  # a misspelled STATEKIT_STATE_CHECK: refused before Accelerate writes or loads
            attachment._pending = None
            attachment._started = time.perf_counter()
            attachment._strict = bool(kwargs.get("strict", True))  # load_state(dir, strict=False) reaches load_model
            self._order_hooks(mode)
            try:
                result = original(directory, *args, **kwargs)
                if attachment._pending is not None:  # None: Accelerate returned before its hooks
                    finish(attachment._pending)
                return result
            except BaseException:
                if mode == "save" and attachment._pending is not None:
                    _abandon_save(attachment._pending)
                raise
            finally:
                attachment._pending = None

        call.__name__ = f"{mode}_state"
        call.__doc__ = getattr(original, "__doc__", None)
        return call

    def context(self, mode: str, directory: Any) -> Checkpoint:
        """The checkpoint of the call in progress, built by its first pre-hook."""
        if self.attachment._pending is None:
            self.attachment._pending = _attach_checkpoint(self.accelerator, os.fspath(directory), mode, self.attachment)
        return self.attachment._pending

    def save_first_hook(self, models: list[Any], weights: list[Any], output_dir: str) -> None:
        """Accelerate's first save pre-hook: lock the directory and note the ``weights`` list
        Accelerate built (parallel to ``models``), before any user hook pops from it."""
        check_can_save(self.accelerator)
        next_batch.claim_witnesses()  # left by a save that failed before it claimed them
        checkpoint = self.context("save", output_dir)
        _lock_save(self.accelerator, checkpoint)  # before Accelerate writes: nothing loadable until committed
        checkpoint.__dict__["accelerate_weights"] = list(weights)

    def save_pre_hook(self, models: list[Any], weights: list[Any], output_dir: str) -> None:
        """Accelerate's last save pre-hook: the statekit pre-hooks on the models the user's
        hooks left to Accelerate, then what Accelerate does not keep (loader positions,
        accumulated gradients). Runs after the user's hooks, so the random state statekit-rng
        saves is the one Accelerate saves and the run continues with."""
        checkpoint = self.context("save", output_dir)
        owners: dict[str, str] = checkpoint.__dict__.setdefault("attach_owners", {})
        built = checkpoint.__dict__.pop("accelerate_weights", None)
        if built is not None and len(built) == len(models):
            kept = _models_left_by_user_hooks(built, weights)
            for i in sorted(set(range(len(models))) - set(kept)):
                owners[f"model_{i}"] = HOOKS_PLUGIN  # a user hook saved it (save_pretrained) and popped its weights
        else:  # Accelerate wrote no weights for these models (FSDP, DeepSpeed save them themselves)
            kept = []
        # plugins get parallel copies: Accelerate's _models must stay intact
        hook_models = [models[i] for i in kept]
        hook_weights = list(weights) if kept else []
        before = list(weights)
        call_each(
            get_plugin_manager(),
            "statekit_save_state_pre",
            checkpoint,
            {"models": hook_models, "weights": hook_weights, "output_dir": checkpoint.url, "checkpoint": checkpoint},
            after_each=track_save_claims(checkpoint, hook_models, hook_weights, checkpoint._model_keys, owners),
        )
        if kept:
            left = {id(w) for w in hook_weights}
            weights[:] = [w for w in before if id(w) in left]
        checkpoint.plugin = None
        for key, obj in self.attachment.objects.items():  # what Accelerate does not keep: exact positions, gradients
            if data.is_loader(obj):
                checkpoint.save_state(fmt.rank_path(key, checkpoint.rank), data.loader_state(obj, key))
            elif isinstance(obj, AccumulatedGradients):
                checkpoint.save_state(fmt.rank_path(key, checkpoint.rank), obj.state_dict())
        checkpoint.__dict__["next_batch_witnesses"] = next_batch.claim_witnesses()  # recorded once committed

    def load_first_hook(self, models: list[Any], input_dir: str) -> None:
        """Accelerate's first load pre-hook: refuse a damaged or unfitting checkpoint before
        any hook (the user's or a plugin's) or Accelerate restores anything: every file the
        manifest lists is read and its checksum compared."""
        checkpoint = self.context("load", input_dir)
        check_statekit_files(checkpoint)
        if checkpoint.manifest is not None:
            commits.agree(lambda: verify_files(checkpoint.storage, checkpoint.manifest, checkpoint.rank), checkpoint.url)
        check_owners_installed(checkpoint)  # a model a plugin took has no Accelerate file
        require_user_load_hooks(checkpoint, self.accelerator)
        check_accelerate_load(checkpoint, self.accelerator, strict=getattr(self.attachment, "_strict", True))
        if checkpoint.manifest is not None:  # warns per difference (Accelerate's load_state has no strict_resume)
            live = fingerprints.compute(collect(self.accelerator), self.accelerator)
            fingerprints.check(checkpoint.manifest, live, checkpoint.url)

    def load_pre_hook(self, models: list[Any], input_dir: str) -> None:
        """Accelerate's last load pre-hook: the statekit pre-hooks on the models the user's
        hooks left (a model a user hook popped is the user's to load)."""
        checkpoint = self.context("load", input_dir)
        hook_models = list(models)
        call_each(
            get_plugin_manager(),
            "statekit_load_state_pre",
            checkpoint,
            {"models": hook_models, "input_dir": checkpoint.url, "checkpoint": checkpoint},
        )
        kept = {id(m) for m in hook_models}
        models[:] = [m for m in models if id(m) in kept]

    def finish_save(self, checkpoint: Checkpoint) -> None:
        """After Accelerate's save: commit the manifest, then the post-hooks."""
        self.accelerator.wait_for_everyone()
        # Accelerate has saved: the run continues with the random states it has now
        checkpoint.__dict__["random_states"] = random_check.record_all_ranks()
        checkpoint.manifest = _commit_attached(self.accelerator, checkpoint)
        record_next_batches(checkpoint.__dict__.pop("next_batch_witnesses", []), checkpoint.storage, checkpoint.rank, checkpoint.manifest)
        if checkpoint.rank == 0:
            log_committed(checkpoint.manifest, checkpoint.url, self.attachment._started, ", attached")
        distributed.barrier()
        checkpoint.writer.close()
        call_each(
            get_plugin_manager(),
            "statekit_save_state_post",
            checkpoint,
            {"models": list(self.accelerator._models), "output_dir": checkpoint.url, "checkpoint": checkpoint},
        )

    def finish_load(self, checkpoint: Checkpoint) -> None:
        """After Accelerate's load: statekit's loader positions and gradients, then the post-hooks."""
        # the resume audit's verdict of this resume (statekit.checks.audit)
        audit.begin(checkpoint.url, checkpoint.manifest.step if checkpoint.manifest is not None else None)
        if checkpoint.manifest is None and any(data.is_loader(obj) for obj in self.attachment.objects.values()):
            warn_user(
                f"{checkpoint.url} holds no {MANIFEST_NAME}: it was written without statekit (or its manifest was "
                "removed), so no data-loader position of statekit's is read: each loader resumes as Accelerate "
                "restores it (a save inside an epoch: that epoch restarts from its first batch, in a new order, and "
                "this resume is not bit-exact); the checkpoints saved from now on resume exactly", StatekitWarning)
        apply_own_states(read_own_states(checkpoint, list(self.attachment.objects.items())))
        if self.accelerator._models and self.accelerator._optimizers:  # a training run's script may skip batches itself
            for obj in self.attachment.objects.values():
                if data.is_loader(obj):
                    own_skip.expect(obj)
        call_each(
            get_plugin_manager(),
            "statekit_load_state_post",
            checkpoint,
            {"models": list(self.accelerator._models), "input_dir": checkpoint.url, "checkpoint": checkpoint},
        )
        manifest = checkpoint.manifest
        if manifest is not None:  # the state check, as every statekit load (Accelerate's own load has no strict_resume)
            # (what a plugin took is compared where the save digested it: state_check.record)
            check_loaded_state(checkpoint.url, manifest, None, collect(self.accelerator), self.accelerator,
                               strict_resume=False)
            random_check.check((manifest.records.get(CORE) or {}).get(random_check.RECORD_KEY), checkpoint.url,
                               checkpoint.rank, checkpoint.world_size)
            if manifest.step is not None:
                self.attachment._step_counter.steps = manifest.step
        where = f", rank {checkpoint.rank}" if checkpoint.world_size > 1 else ""
        logger.info(
            "loaded %s (step %s, %s, %.2f s, attached%s)", checkpoint.url, manifest.step if manifest is not None else None,
            human(manifest.size_bytes) if manifest is not None and manifest.files else "-",
            time.perf_counter() - self.attachment._started, where,
        )


def _models_left_by_user_hooks(built: list[Any], now: list[Any]) -> list[int]:
    """Indices into Accelerate's ``_models`` of the models whose ``weights`` entry the user's
    save hooks left, parallel to ``now``.

    Args:
        built: the ``weights`` list Accelerate built, one entry per model.
        now: the list after the user's hooks (diffusers' hooks ``weights.pop()`` what they
            saved with ``save_pretrained``).

    Returns:
        ``len(now)`` indices. Accelerate writes ``now[j]`` as its ``j``-th model file either
        way; an entry a hook replaced keeps its position.
    """
    if len(now) == len(built):
        return list(range(len(built)))
    position = {id(w): i for i, w in enumerate(built)}
    kept = [position.get(id(w)) for w in now]
    if None in kept or kept != sorted(kept):  # entries replaced as well as popped: only positions are left
        return list(range(len(now)))
    return kept  # type: ignore[return-value]


def _lock_save(accelerator: Any, checkpoint: Checkpoint) -> None:
    """Rank 0 takes the directory's save lock and uncommits an earlier checkpoint there
    (:func:`statekit.engine.locking.lock_accelerate_save`); every rank waits for it, so no
    rank writes a file into a directory that still loads (``docs/design-notes.md``)."""
    def lock() -> None:
        if checkpoint.rank == 0:
            lock_accelerate_save(checkpoint.storage)
            checkpoint.__dict__["attach_locked"] = True

    commits.agree(lock, checkpoint.url)


def _abandon_save(checkpoint: Checkpoint) -> None:
    """A save that failed before its commit leaves its lock, marked failed: Accelerate's
    partly written files are never loaded as a checkpoint."""
    if checkpoint.__dict__.get("attach_locked") and checkpoint.manifest is None:
        mark_save_failed(checkpoint.storage)


_STEP_NAME = re.compile(r"(?:checkpoint|global_step|step|ckpt|iter)[-_]?(\d+)", re.IGNORECASE)


class _StepCounter:
    """The optimizer steps of an attached run, for the step of a checkpoint whose folder name
    carries none (``epoch_3``, Accelerate's automatic ``checkpoint_<n>``, which counts saves).

    Counts the steps the first prepared optimizer took since the attach (a step GradScaler
    skipped for inf gradients is not one), continued from the step of a checkpoint loaded.
    """

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator
        self.steps = 0
        self._watched: Any = None
        self.watch()

    def watch(self) -> None:
        """Count the first prepared optimizer's steps (called at attach and after each ``prepare``)."""
        optimizers = getattr(self.accelerator, "_optimizers", None) or []
        if not optimizers or self._watched is not None:
            return
        inner = getattr(optimizers[0], "optimizer", optimizers[0])  # AcceleratedOptimizer: the step that ran
        if hasattr(inner, "register_step_post_hook"):
            self._watched = inner.register_step_post_hook(self._count)

    def remove(self) -> None:
        """Stop counting."""
        if self._watched is not None:
            self._watched.remove()
            self._watched = None

    def _count(self, *_: Any) -> None:
        self.steps += 1


def _attached_step(accelerator: Any, url: str, attachment: Attachment) -> int | None:
    """The step an attach-mode save records: the number in the folder's name when it names a
    step (``checkpoint-500``: diffusers' scripts; ``step_500``: Accelerate's and transformers'
    examples), else the optimizer steps taken (:class:`_StepCounter`).

    ``Accelerator.step`` is not it: it counts micro-steps within an epoch (``_do_sync`` resets it
    at the end of each data loader pass).
    """
    naming = getattr(getattr(accelerator, "project_configuration", None), "automatic_checkpoint_naming", False)
    match = _STEP_NAME.fullmatch(os.path.basename(os.path.normpath(url)))
    if match is not None and not naming:
        return int(match.group(1))
    counter = getattr(attachment, "_step_counter", None)
    return counter.steps if counter is not None else None


def _attach_checkpoint(accelerator: Any, url: str, mode: str, attachment: Attachment) -> Checkpoint:
    storage = Storage(url)
    manifest = None
    if mode == "load" and storage.exists(fmt.MANIFEST_NAME):
        manifest = read_manifest(storage)
    models = list(accelerator._models)
    keys = {id(m): f"model_{i}" for i, m in enumerate(models)}
    keys.update({id(unwrap_model(m, accelerator)): f"model_{i}" for i, m in enumerate(models)})
    checkpoint = Checkpoint(
        storage,
        mode=mode,
        rank=accelerator.process_index,
        world_size=accelerator.num_processes,
        step=_attached_step(accelerator, url, attachment) if mode == "save" else (manifest.step if manifest is not None else None),
        accelerator=accelerator,
        objects=dict(attachment.objects),  # read-only in attach mode: Accelerate saves them
        model_keys=keys,
        manifest=manifest,
        verify=False,  # Accelerate reads its own files; statekit's are small
    )
    checkpoint.accelerate_runs_hooks = True  # Accelerate calls its registered hooks itself
    return checkpoint


def _commit_attached(accelerator: Any, checkpoint: Checkpoint) -> Manifest:
    """Manifest for a directory Accelerate wrote, through the one manifest builder: every
    file checksummed (rank 0 reads back Accelerate's files; statekit's own were
    checksummed while written)."""
    checkpoint.record_unlisted_at_commit = ACCELERATE_WRITER
    owners = checkpoint.__dict__.get("attach_owners", {})
    names = {f.writer for f in checkpoint.files.values()} | set(checkpoint.all_records()) | set(owners.values())
    plugins = plugin_versions(get_plugin_manager(), names - {ACCELERATE_WRITER})
    files = commits.gather_files(checkpoint)
    entries = collect(accelerator)
    digest = state_check.record(live_state.live_tensors(entries, accelerator))  # every rank: DTensors' shards are summed across them
    manifest = None
    if checkpoint.rank == 0:
        objects = {
            f"model_{i}": ObjectEntry(kind="model", owner=owners.get(f"model_{i}", ACCELERATE_WRITER), per_rank=False, files=())
            for i in range(len(accelerator._models))
        }
        records = {**checkpoint.all_records(), CORE: {"layout": "accelerate"}}
        if checkpoint.__dict__.get("random_states"):
            records[CORE][random_check.RECORD_KEY] = checkpoint.__dict__["random_states"]
        fingerprint = fingerprints.compute(collect(accelerator), accelerator, rng=fingerprints.rng_saved(records, files))
        manifest = commits.build_manifest(checkpoint, files, objects, plugins=plugins, records=records,
                                          fingerprint=fingerprint, state_digest=digest,
                                          saved={**checkpoint.objects, **{e.key: e.obj for e in entries}})
        manifest = commits.commit(checkpoint.storage, manifest, exclusive=False)
    return distributed.broadcast_from_rank0(manifest)
