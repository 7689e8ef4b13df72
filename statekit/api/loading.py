"""Load through the hooks: which kind of directory a load reads, and the hooks around it
(the mapping API's :func:`load`, the Accelerate bridge, the manager's resume).

What a native load reads and in what order is the engine's
(:class:`statekit.engine.read.LoadPlan`); this module picks the reader of the directory
(statekit's, attach mode's, :func:`statekit.foreign.accelerate.load` for one
``Accelerator.save_state`` wrote), checks that the owners of the saved objects are
installed, and runs the load hooks between the plan's steps. The sequence is drawn in
``docs/design-notes.md`` ("Where a save and a load live").
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Mapping
from typing import Any

from statekit import distributed
from statekit.api import fingerprint as fingerprints
from statekit.api.accelerate_hooks import HOOKS_PLUGIN
from statekit.api.saveload import context_for
from statekit.checks import audit, state_check
from statekit.engine import live_state, read
from statekit.loaders import data
from statekit.engine.context import ACCELERATE_WRITER, CORE, Checkpoint
from statekit.engine.entries import Entry, classify, refuse_unclaimed, unwrap_model
from statekit.engine.optimizer_fit import parameter_names
from statekit.engine.gradients import AccumulatedGradients
from statekit.engine.locking import LOCK_NAME, live_save_lock
from statekit.errors import CorruptCheckpointError, IncompleteCheckpointError, PluginError, StatekitWarning, StateMismatchError, warn_user
from statekit.foreign import accelerate as accelerate_format
from statekit.foreign.accelerate_convert import loaders_left_as_they_are
from statekit.foreign.accelerate_rng import restore_rng
from statekit.foreign.base import ForeignObject, ForeignSummary
from statekit.foreign.detect import describe_kind, folder_kind
from statekit.format.layout import rank_path
from statekit.format.manifest import MANIFEST_NAME, read_manifest
from statekit.format.manifest_types import Manifest, ObjectEntry
from statekit.hooks.claims import track_load_claims
from statekit.hooks.registry import PluginManager, call_each, get_plugin_manager
from statekit.progress import human
from statekit.storage import Storage

logger = logging.getLogger(__name__)


def load(
    url: str,
    state: Mapping[str, Any],
    *,
    verify: bool = True,
    allow_pickle: bool = False,
    per_rank: tuple[str, ...] | list[str] = (),
    storage_options: dict[str, Any] | None = None,
    strict: bool = True,
    strict_resume: bool = False,
    **options: Any,
) -> Manifest | ForeignSummary:
    """Restore a mapping of stateful objects from a committed checkpoint, in place.

    A training state (the mapping holds an optimizer, LR scheduler or data loader) is a
    resume: the checkpoint's resume fingerprint is compared with the live objects first
    (``docs/concepts.md``, Resume fingerprint); loading weights alone is not compared.

    Args:
        url: checkpoint directory URL.
        state: ``key -> object`` as given to :func:`save`; every key must be in the
            checkpoint. Models are filled in place (the optimizer keeps its parameters).
        verify: check every file's size and checksum against the manifest while reading.
        allow_pickle: permit pickle files of foreign (Accelerate) checkpoints.
        per_rank: as for :func:`save`.
        storage_options: fsspec options.
        strict: False (the name torch and Accelerate use) loads what matches: a model
            gets the state dict keys it shares with the checkpoint, an object the
            checkpoint lacks is left alone; shapes and dtypes must still match.
        strict_resume: raise :class:`ResumeMismatchError` for a fingerprint difference
            instead of warning :class:`ResumeFingerprintWarning` (and compare even
            when the mapping holds no training state); and a difference the state check
            finds after the load is a :class:`StateMismatchError` instead of a
            :class:`StateCheckWarning` (``docs/concepts.md``, State check).
        **options: options for plugins (``checkpoint.options``), e.g. ``device_map=``; one
            that no registered plugin reads warns.

    Returns:
        The manifest (:class:`statekit.format.Manifest`). Not ``strict``: its
        ``incompatible_keys`` holds stable key -> ``{"missing_keys": [...],
        "unexpected_keys": [...]}`` for every model the core loaded, and
        ``missing_objects`` the keys the checkpoint did not hold. A directory
        ``Accelerator.save_state`` wrote (no statekit manifest, or attach mode's) gives
        a :class:`statekit.ForeignSummary` instead.

    Raises:
        CheckpointNotFoundError, IncompleteCheckpointError, FormatVersionError: see
            :func:`read_manifest`.
        CorruptCheckpointError: a file fails verification or is malformed (names it).
        StateMismatchError: keys, shapes or dtypes differ (listed); the model is untouched.
        PluginMissingError: an object was saved by a plugin that is not installed.
        PluginError: a plugin failed, or did not take an object it owns.
        ResumeMismatchError: see :func:`statekit.api.fingerprint.check`; nothing loaded.
        StateMismatchError: also with ``strict_resume``, when a loaded tensor differs from
            the state saved (the load completed; the message names each tensor).
        InvalidOptionError: ``STATEKIT_STATE_CHECK`` holds an unknown mode.
    """
    get_plugin_manager().check_options(options, load)
    entries = [classify(k, v, True if k in per_rank else None) for k, v in state.items()]
    resume = strict_resume or any(e.kind in ("optimizer", "scheduler", "dataloader") for e in entries)
    return load_objects(
        url, entries, verify=verify, storage_options=storage_options, options=options, allow_pickle=allow_pickle,
        strict=strict, compare_fingerprint=resume, strict_resume=strict_resume,
    )


def _logged(load_fn: Any) -> Any:
    """One INFO line per load that returns: ``loaded <url> (step 140, 12.3 MiB, 0.20 s)``."""

    @functools.wraps(load_fn)
    def wrapper(url: str, *args: Any, **kwargs: Any) -> Manifest | ForeignSummary:
        started = time.perf_counter()
        manifest = load_fn(url, *args, **kwargs)
        rank, world_size = distributed.rank_and_world_size()
        where = f", rank {rank}" if world_size > 1 else ""
        size = human(manifest.size_bytes) if isinstance(manifest, Manifest) and manifest.files else "-"
        logger.info("loaded %s (step %s, %s, %.2f s%s)", url, manifest.step, size, time.perf_counter() - started, where)
        return manifest

    return wrapper


@_logged
def load_objects(
    url: str,
    entries: list[Entry],
    *,
    verify: bool = True,
    storage_options: dict[str, Any] | None = None,
    options: dict[str, Any] | None = None,
    accelerator: Any = None,
    allow_pickle: bool = False,
    strict: bool = True,
    compare_fingerprint: bool = True,
    strict_resume: bool = False,
) -> Manifest | ForeignSummary:
    """Load classified entries (the engine behind :func:`load` and the Accelerate bridge).

    A directory written by ``Accelerator.save_state`` (no manifest, or a manifest of
    attach mode) is read by :func:`statekit.foreign.accelerate.load`, all or nothing.
    With ``compare_fingerprint`` the manifest's resume fingerprint is compared with the
    live run before anything is loaded (:func:`statekit.api.fingerprint.check`). The
    steps of a native load are :func:`_load_native`'s (``docs/design-notes.md``).

    Args:
        url, verify, storage_options, allow_pickle, strict, strict_resume: as :func:`load`.
        entries: the classified objects (:func:`statekit.engine.entries.classify`).
        options: options for plugins (``checkpoint.options``).
        accelerator: the run's Accelerator (the bridge), or None.
        compare_fingerprint: compare the resume fingerprint (a training state's resume).

    Returns:
        The manifest, or a :class:`statekit.ForeignSummary` for a directory Accelerate
        wrote (as :func:`load`).

    Raises:
        As :func:`load`.
    """
    state_check.mode()  # a misspelled STATEKIT_STATE_CHECK is refused before anything is loaded
    storage = Storage.of(url, storage_options)
    loaders = any(data.is_loader(e.obj) for e in entries)
    manifest = _manifest_of(storage)
    if manifest is None:  # a directory Accelerate wrote
        if loaders:  # the resume audit: an Accelerate folder holds no record of the next batch
            audit.begin(storage.url, None, strict_resume)
        return accelerate_format.load(storage, entries, allow_pickle=allow_pickle, accelerator=accelerator)
    if loaders:  # the resume audit's verdict of this resume (statekit.checks.audit)
        audit.begin(storage.url, manifest.step, strict_resume)
    if compare_fingerprint:
        fingerprints.check(manifest, fingerprints.compute(entries, accelerator), storage.url, strict_resume=strict_resume)
    if manifest.layout(CORE) == "accelerate":  # written by an attached accelerator
        loaded: Manifest | ForeignSummary = _load_attached(
            storage, manifest, entries, accelerator, options, allow_pickle=allow_pickle, verify=verify)
        warn_unbuilt_ddp_buckets([(e.key, e.obj) for e in entries if e.kind == "model"])
    else:
        loaded = _load_native(storage, manifest, entries, accelerator, options, verify=verify, strict=strict)
    check_loaded_state(storage.url, manifest, loaded, entries, accelerator, strict_resume)
    return loaded


def check_loaded_state(
    url: str, manifest: Manifest, loaded: Manifest | ForeignSummary | None, entries: list[Entry], accelerator: Any,
    strict_resume: bool,
) -> None:
    """The state check of a completed load (:mod:`statekit.checks.state_check`): the live
    objects against the saved digests, recorded for the next save's ``resume_audit``
    (every load path calls it: :func:`load_objects`, attach mode's ``load_state``).

    Args:
        url: the checkpoint.
        manifest: its manifest.
        loaded: what the load returned (a non-strict load's ``incompatible_keys``), or None.
        entries: the objects the load restored.
        accelerator: the run's Accelerator, or None.
        strict_resume: raise a difference instead of warning.

    Raises:
        StateMismatchError: ``strict_resume`` and a tensor differs (after it was recorded).
        InvalidOptionError: ``STATEKIT_STATE_CHECK`` holds an unknown mode.
    """
    incompatible = loaded.incompatible_keys if isinstance(loaded, Manifest) else None
    left_out = {key: keys.get("unexpected_keys", []) for key, keys in (incompatible or {}).items()}
    models = {e.key: unwrap_model(e.obj, accelerator) for e in entries if e.kind == "model"}
    if len(models) > 1:  # an optimizer may span models: "enc.weight" and "dec.weight", not "weight" twice
        param_names: dict[int, str] = {}
        for key, model in models.items():
            for pid, name in parameter_names([model]).items():
                param_names.setdefault(pid, f"{key}.{name}")
    else:
        param_names = parameter_names(models.values())
    names = {e.key: state_check.optimizer_names(e.obj, param_names) for e in entries if e.kind == "optimizer"}
    live = live_state.live_tensors(entries, accelerator) if manifest.state_digest is not None else []
    verdict = state_check.check(manifest, live, url, strict=strict_resume, left_out=left_out, names=names)
    if verdict.verdict != "not recorded":  # recorded first: a raised mismatch still reaches the next save
        audit.state_checked(url, manifest.step, verdict.to_json(), [e.obj for e in entries])
    if strict_resume:
        state_check.raise_mismatch(verdict, url)


def _manifest_of(storage: Storage) -> Manifest | None:
    """The checkpoint's manifest, or None for a directory ``Accelerator.save_state`` wrote.

    Raises:
        IncompleteCheckpointError: no manifest: being saved, another tool's checkpoint
            (a Trainer's, DCP's), or a save that never committed.
        CheckpointNotFoundError, FormatVersionError: as :func:`read_manifest`.
    """
    try:
        return read_manifest(storage)
    except IncompleteCheckpointError:
        if accelerate_format.is_accelerate_checkpoint(storage):
            return None
        _refuse_save_in_progress(storage)
        kind = folder_kind(storage)
        if kind in ("trainer", "dcp"):  # not a save that never committed: another tool's checkpoint
            raise IncompleteCheckpointError(
                f"{storage.url} is {describe_kind(kind)}, not a statekit checkpoint (no {MANIFEST_NAME}): statekit "
                "does not load it; show it with `statekit inspect`"
            ) from None
        raise


def _entries_to_load(storage: Storage, manifest: Manifest, entries: list[Entry], strict: bool) -> tuple[list[Entry], list[str]]:
    """The entries a native load reads, and the keys of those the checkpoint lacks: an
    optional entry (or a loader a converted checkpoint leaves as it is) the checkpoint
    lacks is dropped; not ``strict``, every entry it lacks is."""
    saved_objects = manifest.objects
    left = {e.key for e in loaders_left_as_they_are(manifest, entries, storage.url)}  # converted: as its source loads
    entries = [e for e in entries if e.key in saved_objects or not (e.optional or e.key in left)]
    missing_objects = sorted(e.key for e in entries if e.key not in saved_objects)
    if not strict:  # load what the checkpoint holds
        entries = [e for e in entries if e.key in saved_objects]
    return entries, missing_objects


def _load_native(
    storage: Storage,
    manifest: Manifest,
    entries: list[Entry],
    accelerator: Any,
    options: dict[str, Any] | None,
    *,
    verify: bool,
    strict: bool,
) -> Manifest:
    """A statekit checkpoint: check what is loadable, then :class:`statekit.engine.read.LoadPlan`
    with the load pre-hooks between its check and its read, then the post-hooks."""
    pm = get_plugin_manager()
    entries, missing_objects = _entries_to_load(storage, manifest, entries, strict)
    saved_objects = manifest.objects
    _check_loadable(pm, storage, entries, saved_objects)
    # an object only a plugin can load, saved by the core: nothing could load into it
    refuse_unclaimed([e for e in entries if saved_objects[e.key].owner == CORE], {e.key for e in entries}, "load")
    checkpoint = context_for(storage, "load", entries, accelerator, options, step=manifest.step, manifest=manifest, verify=verify)
    plan = read.LoadPlan(checkpoint, entries, accelerator, strict)
    with plan.files_open():
        plan.check_before_hooks()
        models, taken = _run_load_pre_hooks(pm, checkpoint, storage, entries)
        _check_owners_took(storage, entries, saved_objects, taken)
        plan.read(models, taken)
    _restore_accelerate_rng(checkpoint, saved_objects)
    warn_unbuilt_ddp_buckets([(e.key, e.obj) for e in entries if e.kind == "model"])
    not_restored = plan.not_restored + _ranks_not_restored(manifest, checkpoint)
    if not_restored:
        warn_user(f"{storage.url}: not restored: " + "; ".join(not_restored), StatekitWarning)
    call_each(pm, "statekit_load_state_post", checkpoint, {"models": models, "input_dir": storage.url, "checkpoint": checkpoint})
    if not strict:
        manifest = dataclasses.replace(manifest, incompatible_keys=plan.incompatible, missing_objects=tuple(missing_objects))
    return manifest


def warn_unbuilt_ddp_buckets(models: list[tuple[str, Any]]) -> None:
    """Warn about each model whose DDP gradient buckets are still in their first layout
    (:func:`statekit.distributed.ddp_buckets_unbuilt`): the resumed run's next step sums
    its gradients in another order than the uninterrupted run did.

    Args:
        models: ``(key, model as passed)`` of the load. Only a model passed as its DDP
            wrapper can be checked: Accelerate keeps the unwrapped module in
            ``accelerator._models`` and hands the wrapper to the caller only, so an
            Accelerate resume is not checked (docs/concepts.md gives the recipe).

    Warns:
        StatekitWarning: one per such model, with the remedy.
    """
    for key, model in models:
        if distributed.ddp_buckets_unbuilt(model):
            world = distributed.rank_and_world_size()[1]
            warn_user(
                f"model {key!r} is a DistributedDataParallel over {world} ranks that has not run a backward pass yet: "
                "its first step after this resume sums the gradients in the first bucket layout, where the uninterrupted "
                "run used the rebuilt one, so with more than 2 ranks the weights differ in the last bits from then on "
                "(docs/concepts.md, 'More than two ranks'). For a bit-exact resume run one forward and backward of the "
                "prepared model on every rank before resuming, then optimizer.zero_grad(set_to_none=True)",
                StatekitWarning,
            )


def _refuse_save_in_progress(storage: Storage) -> None:
    """A directory without a manifest whose save lock is live is being saved (natively, or
    by an attached ``accelerator.save_state``): say so, rather than "never committed"."""
    holder = live_save_lock(storage)
    if holder is not None:
        raise IncompleteCheckpointError(
            f"{storage.url} is being saved (host {holder.get('host')} pid {holder.get('pid')}) and is not committed "
            "yet: nothing was loaded; load it after the save commits"
        ) from None


def _run_load_pre_hooks(
    pm: PluginManager, checkpoint: Checkpoint, storage: Storage, entries: list[Entry]
) -> tuple[list[Any], dict[str, str]]:
    """Call ``statekit_load_state_pre`` with the entries' models (a plugin takes a model or
    object by removing it, :func:`statekit.hooks.claims.track_load_claims`).

    Returns:
        The models, in the entries' order, and ``{key: plugin}`` of what plugins took.
    """
    models = [e.obj for e in entries if e.kind == "model"]
    hook_models = list(models)
    taken: dict[str, str] = {}
    keys = [e.key for e in entries if e.kind == "model"]
    others = [e.key for e in entries if e.kind != "model"]
    call_each(
        pm,
        "statekit_load_state_pre",
        checkpoint,
        {"models": hook_models, "input_dir": storage.url, "checkpoint": checkpoint},
        after_each=track_load_claims(checkpoint, hook_models, models, keys, others, taken),
    )
    return models, taken


_DISTINCT_KINDS = ("model", "optimizer", "scheduler", "dataloader", "scaler")
"""Object kinds that never load into one another (a model's state is no optimizer's)."""


def _check_loadable(pm: PluginManager, storage: Storage, entries: list[Entry], saved_objects: Mapping[str, ObjectEntry]) -> None:
    """Every entry is in the checkpoint, of the kind saved there, and every plugin that owns
    one is installed."""
    missing = [e.key for e in entries if e.key not in saved_objects]
    if missing:
        held = ", ".join(sorted(saved_objects)) or "nothing"
        raise StateMismatchError(
            f"the objects to load from {storage.url}",
            missing=missing,
            reason=f"the checkpoint holds no object under {'that key' if len(missing) == 1 else 'those keys'} (it "
            f"holds: {held}): pass each object under the key it was saved with (`statekit inspect "
            f"{storage.url}` lists them), or strict=False to load only what it holds",
        )
    for e in entries:
        saved_kind = saved_objects[e.key].kind
        if e.kind != saved_kind and e.kind in _DISTINCT_KINDS and saved_kind in _DISTINCT_KINDS:
            raise StateMismatchError(
                f"{e.key!r} ({storage.url}; nothing was loaded)",
                reason=f"the checkpoint saved {_a(saved_kind)} under {e.key!r}, and {_a(e.kind)} "
                f"({type(e.obj).__name__}) was given for it: pass the {saved_kind} under {e.key!r} "
                f"(`statekit inspect {storage.url}` lists every key and kind)",
            )
    for e in entries:
        saved = saved_objects[e.key]
        if saved.owner not in (CORE, ACCELERATE_WRITER):
            pm.require_owner(saved.owner, saved.owner_distribution, f"{storage.url}: {e.key!r}")


def _a(word: str) -> str:
    return f"{'an' if word[:1] in 'aeiou' else 'a'} {word}"


def _check_owners_took(storage: Storage, entries: list[Entry], saved_objects: Mapping[str, ObjectEntry], taken: dict[str, str]) -> None:
    for e in entries:
        owner = saved_objects[e.key].owner
        if owner != CORE and taken.get(e.key) != owner:
            raise PluginError(
                f"{storage.url}: {e.key!r} was saved by plugin {owner!r}, which did not load it in statekit_load_state_pre",
                plugin_name=owner,
                hook_name="statekit_load_state_pre",
            )


def _ranks_not_restored(manifest: Manifest, checkpoint: Checkpoint) -> list[str]:
    saved_world = manifest.world_size
    if saved_world <= checkpoint.world_size or checkpoint.rank != 0:
        return []
    # data loader positions of every saved rank are read by each live rank (loaders/elastic.py)
    per_rank_keys = [k for k, o in manifest.objects.items() if o.per_rank and o.kind != "dataloader"]
    if not per_rank_keys:
        return []
    return [
        f"per-rank state of ranks {checkpoint.world_size}..{saved_world - 1} for {', '.join(per_rank_keys)} "
        f"(saved with world size {saved_world}, loaded with {checkpoint.world_size})"
    ]


def _restore_accelerate_rng(checkpoint: Checkpoint, saved_objects: Mapping[str, ObjectEntry]) -> None:
    """A checkpoint converted from Accelerate carries its random states: restore this
    rank's, as ``Accelerator.load_state`` of the source would (statekit-rng, which runs
    later, leaves a checkpoint without its records alone)."""
    entry = saved_objects.get(accelerate_format.ACCELERATE_RNG)
    base = rank_path(accelerate_format.ACCELERATE_RNG, checkpoint.rank)
    if entry is not None and entry.owner == CORE and f"{base}.json" in checkpoint.manifest.files:
        restore_rng(checkpoint.load_state(base), checkpoint.storage.url)


def check_statekit_files(checkpoint: Checkpoint) -> None:
    """Fail before anything is restored if a file statekit or a plugin wrote next to
    Accelerate's (attach mode) is missing or has the wrong size (a half-restored run is
    worse than a refused load).

    Raises:
        CorruptCheckpointError: naming the file, its size and the manifest's.
    """
    if checkpoint.manifest is None:
        return
    for rel, entry in checkpoint.manifest.files.items():
        if entry.writer == ACCELERATE_WRITER:
            continue
        url = checkpoint.storage.url_of(rel)
        if not checkpoint.storage.exists(rel):
            raise CorruptCheckpointError(f"{url}: file is missing (listed in the manifest); nothing was loaded", path=url)
        size = checkpoint.storage.size(rel)
        if size != entry.size_bytes:
            raise CorruptCheckpointError(
                f"{url}: size {size} bytes, the manifest says {entry.size_bytes}; nothing was loaded", path=url
            )


def check_owners_installed(checkpoint: Checkpoint) -> None:
    """Fail before anything is restored if an object of an attach-mode checkpoint was saved
    by a plugin that is not installed (or blocked): Accelerate would otherwise stop on a
    missing model file (``pytorch_model.bin``) without naming the plugin.

    Raises:
        PluginMissingError: naming the object, the plugin and the distribution to install.
    """
    if checkpoint.manifest is None:
        return
    pm = get_plugin_manager()
    for key, obj in checkpoint.manifest.objects.items():
        owner = obj.owner
        if owner not in (CORE, ACCELERATE_WRITER, HOOKS_PLUGIN):  # the user's hooks: require_user_load_hooks
            pm.require_owner(owner, obj.owner_distribution, f"{checkpoint.url}: {key!r}", " (nothing was loaded)")


def check_accelerate_load(checkpoint: Checkpoint, accelerator: Any, strict: bool = True) -> None:
    """Fail before ``Accelerator.load_state`` restores anything (attach mode) if the
    directory is an attach-mode save not committed (a save lock and no manifest: being
    written, or failed), or if a model, optimizer or scheduler does not fit Accelerate's files:
    Accelerate fills the models first, and an optimizer that refuses its state (a
    parameter frozen since the save) would leave them overwritten
    (:func:`statekit.foreign.accelerate.check_fit_before_load`).

    Args:
        checkpoint: the attach-mode load's context (its manifest says which models a
            plugin saved: Accelerate numbers its files among the others).
        accelerator: the run's Accelerator.
        strict: as ``Accelerator.load_state(strict=...)`` for the models.

    Raises:
        IncompleteCheckpointError: the directory is being saved, or its save failed.
        StateMismatchError: a model or optimizer does not fit (names it and the file).
        CorruptCheckpointError: a file cannot be read (names it).
    """
    if checkpoint.manifest is None and checkpoint.storage.exists(LOCK_NAME):
        _refuse_save_in_progress(checkpoint.storage)
        raise IncompleteCheckpointError(
            f"{checkpoint.url} has no {MANIFEST_NAME}: the save that wrote it never committed (it failed); nothing was loaded"
        )
    objects = checkpoint.manifest.objects if checkpoint.manifest is not None else {}
    owned = {k for k, o in objects.items() if o.owner not in (CORE, ACCELERATE_WRITER)}
    left = [m for i, m in enumerate(accelerator._models) if f"model_{i}" not in owned]
    entries = [Entry(f"model_{i}", "model", m) for i, m in enumerate(left)]
    entries += [Entry(f"optimizer_{i}", "optimizer", o) for i, o in enumerate(accelerator._optimizers)]
    entries += [Entry(f"scheduler_{i}", "scheduler", o) for i, o in enumerate(accelerator._schedulers)]
    accelerate_format.check_fit_before_load(checkpoint.storage, entries, accelerator, strict=strict)


def read_own_states(checkpoint: Checkpoint, objects: list[tuple[str, Any]]) -> list[tuple[str, Any, Any, Any]]:
    """What statekit wrote next to Accelerate's files in attach mode, read before anything is
    applied: each data loader's position (this rank's and, for an elastic plan with another
    world size, every saved rank's: :func:`statekit.engine.read.loader_positions`) and the
    accumulated gradients.

    Args:
        checkpoint: the attach-mode checkpoint being loaded.
        objects: ``(key, object)`` of the run (``dataloader_<i>``, ``gradients``...).

    Returns:
        ``(key, object, state, ranks)`` for each object with a saved state (``ranks`` None
        unless an elastic plan needs them), for :func:`apply_own_states`.

    Raises:
        CorruptCheckpointError: a file fails verification (names it).
    """
    if checkpoint.manifest is None:  # no manifest lists (and verifies) a file of statekit's: none is used
        return []
    files = checkpoint.manifest.files
    states = []
    for key, obj in objects:
        base = rank_path(key, checkpoint.rank)
        saved = f"{base}.json" in files
        if data.is_loader(obj):
            own, ranks = read.loader_positions(checkpoint, key)
            if own is not None or ranks is not None:
                states.append((key, obj, own, ranks))
        elif isinstance(obj, AccumulatedGradients) and saved:
            states.append((key, obj, checkpoint.load_state(base), None))
    return states


def apply_own_states(states: list[tuple[str, Any, Any, Any]]) -> None:
    """Put back what :func:`read_own_states` read: loader positions (replacing the one
    Accelerate restored) and accumulated gradients.

    Raises:
        StateMismatchError: a position or the gradients do not fit this run (see
            :func:`statekit.loaders.data.restore_loader`, ``AccumulatedGradients.load_state_dict``).
    """
    for key, obj, state, ranks in states:
        if data.is_loader(obj):
            data.restore_loader(obj, state, name=key, ranks=ranks)
        else:
            obj.load_state_dict(state)


def _load_attached(
    storage: Storage,
    manifest: Manifest,
    entries: list[Entry],
    accelerator: Any,
    options: dict[str, Any] | None,
    *,
    allow_pickle: bool,
    verify: bool,
) -> ForeignSummary:
    """A directory an attached accelerator's ``save_state`` wrote, loaded as attach mode's
    ``accelerator.load_state`` loads it: the load pre-hooks (a model a plugin takes is its
    to load), Accelerate's files for the rest (all or nothing; the models left keep
    Accelerate's positional file names), then statekit's own files (exact loader
    positions, accumulated gradients) and the load post-hooks (statekit-rng's generators)."""
    pm = get_plugin_manager()
    checkpoint = context_for(storage, "load", entries, accelerator, options, step=manifest.step, manifest=manifest, verify=verify)
    check_statekit_files(checkpoint)
    check_owners_installed(checkpoint)
    pickled = accelerate_format.pickle_files(accelerate_format.accelerate_files(storage.listdir()))
    if pickled and not allow_pickle:  # before any hook loads anything
        accelerate_format.read_pickle(storage, pickled[0], allow_pickle)  # raises, naming the file
    model_entries = [e for e in entries if e.kind == "model"]
    models, taken = _run_load_pre_hooks(pm, checkpoint, storage, entries)
    _check_owners_took(storage, _plugin_owned(model_entries, manifest.objects), manifest.objects, taken)
    left = [e for e in model_entries if e.key not in taken]
    # Accelerate numbers the weights it wrote by position among the models no hook took
    by_position = [Entry(f"model_{i}", "model", e.obj) for i, e in enumerate(left)]
    key_of = {f"model_{i}": e.key for i, e in enumerate(left)}
    rest = [e for e in entries if e.kind != "model" and e.key not in taken]
    own = read_own_states(checkpoint, [(e.key, e.obj) for e in rest])  # read before anything is applied
    gradients = any(isinstance(obj, AccumulatedGradients) for _, obj, _, _ in own)
    summary = accelerate_format.load(
        storage, by_position + rest, allow_pickle=allow_pickle, accelerator=accelerator, gradients_restored=gradients
    )
    apply_own_states(own)  # statekit's exact positions replace Accelerate's
    call_each(pm, "statekit_load_state_post", checkpoint, {"models": models, "input_dir": storage.url, "checkpoint": checkpoint})
    objects = {key_of.get(k, k): v for k, v in summary.objects.items()}  # the caller's keys, not Accelerate's positions
    objects.update({e.key: ForeignObject(e.kind, owner=taken[e.key]) for e in model_entries if e.key in taken})
    return dataclasses.replace(summary, objects=objects)


def _plugin_owned(entries: list[Entry], saved_objects: Mapping[str, ObjectEntry]) -> list[Entry]:
    """The entries a plugin saved (neither the core nor Accelerate wrote them)."""
    return [e for e in entries if e.key in saved_objects and saved_objects[e.key].owner not in (CORE, ACCELERATE_WRITER)]
