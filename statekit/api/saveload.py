"""Save and load a mapping of stateful objects, rank-aware, through the hooks and the format.

``save(url, {"model": m, "optim": o})`` and ``load(url, {...})`` are the engine; the
Accelerate bridge and the manager build their mappings and call :func:`save_objects` /
:func:`load_objects`.

Save sequence (every rank): check the target, run ``statekit_save_state_pre`` one plugin
at a time, write what no plugin took (replicated state on rank 0 only, per-rank state
everywhere), agree on success, gather every rank's file entries to rank 0, commit the
manifest, barrier, run ``statekit_save_state_post``.
"""

from __future__ import annotations

import datetime
import json
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from statekit._version import __version__
from statekit import distributed, format as fmt
from statekit.engine.context import CORE, Checkpoint
from statekit.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    PluginError,
    PluginMissingError,
    StatekitError,
    StatekitWarning,
    StateMismatchError,
    StorageError,
    UnsupportedValueError,
)
from statekit.engine.entries import Entry, LazyStateDict, _rank_base, _state_of, check_fit, classify, unwrap_model  # noqa: F401
from statekit.engine.locking import LOCK_NAME, prepare_target, release_lock  # noqa: F401
from statekit.hooks.registry import call_each, get_plugin_manager
from statekit.engine.staging import StagingPool
from statekit.storage import Storage

_warned_rng = False


# --------------------------------------------------------------------------- save


def save(
    url: str,
    state: Mapping[str, Any],
    *,
    step: int | None = None,
    metadata: dict[str, Any] | None = None,
    overwrite: bool = False,
    per_rank: tuple[str, ...] | list[str] = (),
    storage_options: dict[str, Any] | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Save a mapping of stateful objects and tensors as one committed checkpoint.

    Call it on every rank when torch.distributed is initialised: every rank writes its
    per-rank files, rank 0 writes replicated state once and commits the manifest.

    Args:
        url: checkpoint directory URL (``/path``, ``file://``, ``memory://``, ``s3://``...).
        state: ``key -> object``: ``nn.Module``, optimizer, LR scheduler, ``DataLoader``,
            ``GradScaler``, tensor, dict, or anything with ``state_dict()`` /
            ``load_state_dict()``. Keys name the files (file-name-safe strings).
        step: training step recorded in the manifest.
        metadata: JSON-able user metadata recorded in the manifest (``{"loss": 0.1}``).
        overwrite: replace a committed checkpoint at ``url`` (its manifest is removed first).
        per_rank: keys whose state differs per rank (data loaders are per rank by default).
        storage_options: fsspec options for the URL's filesystem.
        **options: options for plugins (``checkpoint.options``).

    Returns:
        The committed manifest (a dict, see ``docs/format.md``).

    Raises:
        CheckpointExistsError: a committed checkpoint exists at ``url`` and not ``overwrite``.
        PluginError: a pre-hook failed (nothing committed) or a post-hook failed (committed).
        UnsupportedValueError: a value cannot be stored without pickle (names its key).
        StorageError: the storage failed (names the URL); nothing is committed.
    """
    entries = [classify(k, v, True if k in per_rank else None) for k, v in state.items()]
    return save_objects(
        url, entries, step=step, metadata=metadata, overwrite=overwrite, storage_options=storage_options, options=options
    )


def save_objects(
    url: str,
    entries: list[Entry],
    *,
    step: int | None = None,
    metadata: dict[str, Any] | None = None,
    overwrite: bool = False,
    storage_options: dict[str, Any] | None = None,
    options: dict[str, Any] | None = None,
    accelerator: Any = None,
    exclusive: bool = False,
    blocking: bool = True,
    staging: StagingPool | None = None,
    after_commit: Any = None,
) -> Any:
    """Save classified entries (the engine behind :func:`save` and the Accelerate bridge).

    Args: as :func:`save`, plus
        accelerator: passed to hooks as ``checkpoint.accelerator``.
        exclusive: the commit fails with :class:`CheckpointExistsError` if another saver
            committed this checkpoint first (the manager sets it).
        blocking: False stages the state to host memory on this thread and writes from a
            background thread; returns a :class:`statekit.api.asyncsave.PendingSave`.
        staging: the :class:`StagingPool` to reuse for an async save.
        after_commit: ``callable()`` run after the commit on the writing thread (the
            manager updates ``latest`` and applies retention there).

    Returns:
        The committed manifest, or a ``PendingSave`` when not ``blocking``.
    """
    rank, world_size = distributed.rank_and_world_size()
    storage = Storage(url, storage_options)
    if world_size > 1 and storage.protocol == "memory":
        raise StorageError(
            f"{url}: memory:// is private to each process and cannot hold a checkpoint written by "
            f"{world_size} ranks; use a local path shared by the ranks or an object store",
            url=url,
        )
    pm = get_plugin_manager()
    metadata = dict(metadata or {})
    try:
        json.dumps(metadata, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise UnsupportedValueError(f"metadata for {url} is not strict JSON: {exc}") from exc

    _agree(lambda: prepare_target(storage, overwrite) if rank == 0 else None, url)

    models = [e.obj for e in entries if e.kind == "model"]
    model_entries = [e for e in entries if e.kind == "model"]
    core_models = [unwrap_model(m, accelerator) for m in models]
    model_keys = {id(m): e.key for m, e in zip(models, model_entries)}
    model_keys.update({id(m): e.key for m, e in zip(core_models, model_entries)})
    checkpoint = Checkpoint(
        storage,
        mode="save",
        rank=rank,
        world_size=world_size,
        step=step,
        accelerator=accelerator,
        options=options,
        objects={e.key: e.obj for e in entries if e.kind != "model"},
        model_keys=model_keys,
        staging=None if blocking else (staging if staging is not None else StagingPool()),
    )
    owners: dict[str, str] = {}
    stage_error: Exception | None = None
    try:
        _run_pre_hooks_and_write(pm, checkpoint, entries, models, core_models, model_entries, model_keys, owners)
    except Exception as exc:
        if world_size == 1:
            release_lock(storage, rank)
            raise
        stage_error = exc  # every rank must still take part in the agreement below

    def finish() -> dict[str, Any]:
        def flush() -> None:
            if stage_error is not None:
                raise stage_error
            checkpoint.flush()

        try:
            _agree(flush, url)
            manifest = _commit_all(pm, storage, checkpoint, entries, owners, step, metadata, exclusive)
        except BaseException:
            release_lock(storage, rank)  # nothing committed; a retry may take the directory
            raise
        checkpoint.manifest = manifest
        checkpoint._writable = False
        if after_commit is not None:
            _agree(after_commit, url)
        distributed.barrier()
        return manifest

    def post(manifest: dict[str, Any]) -> None:
        _warn_if_no_rng(pm, checkpoint)
        call_each(pm, "statekit_save_state_post", checkpoint, {"models": models, "output_dir": storage.url, "checkpoint": checkpoint})

    if not blocking:
        from statekit.api.asyncsave import PendingSave

        return PendingSave(storage.url, finish, post)
    manifest = finish()
    post(manifest)
    return manifest


def _run_pre_hooks_and_write(
    pm: Any,
    checkpoint: Checkpoint,
    entries: list[Entry],
    models: list[Any],
    core_models: list[Any],
    model_entries: list[Entry],
    model_keys: dict[int, str],
    owners: dict[str, str],
) -> None:
    """Pre-hooks one plugin at a time, then the core's own files (or their staged copies)."""
    rank = checkpoint.rank
    hook_models = list(models)
    weights: list[Mapping[str, Any]] = [LazyStateDict(m) for m in core_models]
    call_each(
        pm,
        "statekit_save_state_pre",
        checkpoint,
        {"models": hook_models, "weights": weights, "output_dir": checkpoint.url, "checkpoint": checkpoint},
        after_each=_track_claims(checkpoint, hook_models, weights, model_keys, owners),
    )
    checkpoint.plugin = None
    remaining = {id(m) for m in hook_models}
    for m, core_model, entry, weight in zip(models, core_models, model_entries, _weights_of(hook_models, weights, models)):
        if id(m) not in remaining or rank != 0:
            continue
        _save_model(checkpoint, entry.key, weight if weight is not None else LazyStateDict(core_model))
    for entry in entries:
        if entry.kind == "model" or entry.key not in checkpoint.objects or (rank != 0 and not entry.per_rank):
            continue
        checkpoint.save_state(_rank_base(entry, rank), _state_of(entry))


def _commit_all(
    pm: Any,
    storage: Storage,
    checkpoint: Checkpoint,
    entries: list[Entry],
    owners: dict[str, str],
    step: int | None,
    metadata: dict[str, Any],
    exclusive: bool,
) -> dict[str, Any]:
    """Gather every rank's file entries to rank 0, write the manifest there, share it."""
    rank = checkpoint.rank
    plugin_versions = _plugin_versions(pm, owners, checkpoint)
    gathered = distributed.gather_to_rank0(checkpoint.files)
    manifest = None
    if rank == 0:
        for rank_files in gathered or []:
            checkpoint.files.update(rank_files)
        if checkpoint.record_unlisted_at_commit:  # files Accelerate's registered hooks wrote
            checkpoint.record_unlisted(checkpoint.record_unlisted_at_commit)
        files = checkpoint.files
        manifest = {
            "format": fmt.FORMAT,
            "statekit_version": __version__,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z"),
            "step": step,
            "world_size": checkpoint.world_size,
            "plugins": plugin_versions,
            "objects": _objects_table(entries, owners, files, pm),
            "records": checkpoint.all_records(),
            "files": files,
            "metadata": metadata,
        }
    return _agree(lambda: _commit(storage, manifest, exclusive) if rank == 0 else None, storage.url, broadcast=True)


def _weights_of(hook_models: list[Any], weights: list[Any], models: list[Any]) -> list[Any]:
    by_id = {id(m): w for m, w in zip(hook_models, weights)}
    return [by_id.get(id(m)) for m in models]


def _track_claims(
    checkpoint: Checkpoint, hook_models: list[Any], weights: list[Any], model_keys: dict[int, str], owners: dict[str, str]
) -> Any:
    """Return an ``after_each`` callback attributing removed models and objects to the plugin."""
    before_models = {id(m) for m in hook_models}
    before_objects = set(checkpoint.objects)
    state = {"models": before_models, "objects": before_objects}

    def after_each(plugin: str) -> None:
        if len(weights) != len(hook_models):
            raise PluginError(
                f"plugin {plugin!r} left models ({len(hook_models)}) and weights ({len(weights)}) out of step: "
                "remove a model and its weights entry together",
                plugin_name=plugin,
                hook_name="statekit_save_state_pre",
            )
        now_models = {id(m) for m in hook_models}
        for removed in state["models"] - now_models:
            owners[model_keys[removed]] = plugin
        now_objects = set(checkpoint.objects)
        for removed in state["objects"] - now_objects:
            owners[removed] = plugin
        state["models"], state["objects"] = now_models, now_objects

    return after_each


def _save_model(checkpoint: Checkpoint, key: str, weights: Mapping[str, Any]) -> None:
    if all(isinstance(v, torch.Tensor) for v in weights.values()):
        checkpoint.save_tensors(f"{key}.safetensors", weights)
    else:  # modules with extra (non-tensor) state: the codec keeps it, still no pickle
        checkpoint.save_state(key, dict(weights))


def _commit(storage: Storage, manifest: dict[str, Any], exclusive: bool) -> dict[str, Any]:
    data = json.dumps(manifest, indent=1, allow_nan=False).encode("utf-8")
    storage.commit(fmt.MANIFEST_NAME, data, exclusive=exclusive)
    storage.remove(LOCK_NAME)  # committed: the lock has done its job
    return manifest


def _agree(fn: Any, url: str, broadcast: bool = False) -> Any:
    """Run ``fn`` on this rank; if any rank failed, every rank raises (no rank hangs)."""
    rank, world = distributed.rank_and_world_size()
    error: BaseException | None = None
    result = None
    try:
        result = fn()
    except Exception as exc:
        if world == 1:
            raise
        error = exc
    if world == 1:
        return result
    failures = distributed.gather_to_rank0(None if error is None else (rank, f"{type(error).__name__}: {error}"))
    verdict = [f for f in failures or [] if f is not None] if rank == 0 else None
    verdict = distributed.broadcast_from_rank0(verdict)
    if error is not None:
        raise error
    if verdict:
        first_rank, message = verdict[0]
        raise StatekitError(f"{url}: rank {first_rank} failed: {message}")
    return distributed.broadcast_from_rank0(result) if broadcast else result


def _plugin_versions(pm: Any, owners: dict[str, str], checkpoint: Checkpoint) -> dict[str, str]:
    names = set(owners.values()) | {f["writer"] for f in checkpoint.files.values()} | set(checkpoint.all_records())
    if checkpoint.record_unlisted_at_commit:
        names.add(checkpoint.record_unlisted_at_commit)
    names.discard(CORE)
    versions = {}
    for name in sorted(names):
        source = pm.sources.get(name)
        versions[name] = (source.version if source and source.version else "unknown")
    gathered = distributed.gather_to_rank0(versions)
    merged: dict[str, str] = {}
    for v in gathered or []:
        merged.update(v)
    return merged


def _objects_table(entries: list[Entry], owners: dict[str, str], files: dict[str, Any], pm: Any) -> dict[str, Any]:
    table = {}
    for e in entries:
        owner = owners.get(e.key, CORE)
        prefix = f"{e.key}/" if e.per_rank else f"{e.key}."
        item: dict[str, Any] = {
            "kind": e.kind,
            "owner": owner,
            "per_rank": e.per_rank,
            "files": sorted(p for p in files if p.startswith(prefix)) if owner == CORE else [],
        }
        if owner != CORE:
            source = pm.sources.get(owner)
            item["owner_distribution"] = source.distribution if source and source.distribution else f"statekit-{owner}"
        table[e.key] = item
    return table


def _warn_if_no_rng(pm: Any, checkpoint: Checkpoint) -> None:
    global _warned_rng
    if not _warned_rng and not pm.manages_rng() and not checkpoint.handles_rng:
        _warned_rng = True
        warnings.warn(
            "no installed plugin saves random-number-generator state (install statekit-rng): "
            "a resume from this checkpoint will not be bit-exact",
            StatekitWarning,
            stacklevel=3,
        )


# --------------------------------------------------------------------------- load


def read_manifest(storage: Storage) -> dict[str, Any]:
    """Read and validate the manifest of a checkpoint directory.

    Raises:
        CheckpointNotFoundError: nothing exists at the URL.
        IncompleteCheckpointError: the directory exists without a manifest.
        CorruptCheckpointError: the manifest is not valid JSON or not format 1.
        FormatVersionError: the manifest is of a newer format.
    """
    url = storage.url_of(fmt.MANIFEST_NAME)
    storage.invalidate()
    try:
        data = storage.read_bytes(fmt.MANIFEST_NAME)
    except FileNotFoundError:
        if storage.exists():
            raise IncompleteCheckpointError(
                f"{storage.url} has no {fmt.MANIFEST_NAME}: the save that wrote it never committed"
            ) from None
        raise CheckpointNotFoundError(f"no checkpoint at {storage.url}") from None
    try:
        manifest = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptCheckpointError(f"{url}: manifest is not valid JSON: {exc}", path=url) from None
    return fmt.validate_manifest(manifest, url)


def load(
    url: str,
    state: Mapping[str, Any],
    *,
    verify: bool = True,
    allow_pickle: bool = False,
    per_rank: tuple[str, ...] | list[str] = (),
    storage_options: dict[str, Any] | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Restore a mapping of stateful objects from a committed checkpoint, in place.

    Args:
        url: checkpoint directory URL.
        state: ``key -> object`` as given to :func:`save`; every key must be in the
            checkpoint. Models are filled in place (the optimizer keeps its parameters).
        verify: check every file's size and checksum against the manifest while reading.
        allow_pickle: permit pickle files of foreign (Accelerate) checkpoints.
        per_rank: as for :func:`save`.
        storage_options: fsspec options.
        **options: options for plugins (``checkpoint.options``), e.g. ``device_map=``.

    Returns:
        The manifest.

    Raises:
        CheckpointNotFoundError, IncompleteCheckpointError, FormatVersionError: see
            :func:`read_manifest`.
        CorruptCheckpointError: a file fails verification or is malformed (names it).
        StateMismatchError: keys, shapes or dtypes differ (listed); the model is untouched.
        PluginMissingError: an object was saved by a plugin that is not installed.
        PluginError: a plugin failed, or did not take an object it owns.
    """
    entries = [classify(k, v, True if k in per_rank else None) for k, v in state.items()]
    return load_objects(url, entries, verify=verify, storage_options=storage_options, options=options, allow_pickle=allow_pickle)


def load_objects(
    url: str,
    entries: list[Entry],
    *,
    verify: bool = True,
    storage_options: dict[str, Any] | None = None,
    options: dict[str, Any] | None = None,
    accelerator: Any = None,
    allow_pickle: bool = False,
) -> dict[str, Any]:
    """Load classified entries (the engine behind :func:`load` and the Accelerate bridge).

    Returns:
        The manifest.
    """
    storage = Storage(url, storage_options)
    try:
        manifest = read_manifest(storage)
    except IncompleteCheckpointError:
        from statekit.foreign import accelerate as accelerate_format

        if accelerate_format.is_accelerate_checkpoint(storage):
            return accelerate_format.load(storage, entries, allow_pickle=allow_pickle, accelerator=accelerator)
        raise
    if manifest["records"].get(CORE, {}).get("layout") == "accelerate":  # written by an attached accelerator
        from statekit.foreign import accelerate as accelerate_format

        return accelerate_format.load(storage, entries, allow_pickle=allow_pickle, accelerator=accelerator)
    rank, world_size = distributed.rank_and_world_size()
    pm = get_plugin_manager()
    saved_objects = manifest["objects"]
    missing = [e.key for e in entries if e.key not in saved_objects]
    if missing:
        raise StateMismatchError(f"checkpoint {storage.url}", missing=missing)
    for e in entries:
        owner = saved_objects[e.key]["owner"]
        if owner != CORE and pm.get_plugin(owner) is None:
            dist_name = saved_objects[e.key].get("owner_distribution", f"statekit-{owner}")
            blocked = " (it is blocked by STATEKIT_DISABLE_PLUGINS)" if pm.is_blocked(owner) else ""
            raise PluginMissingError(
                f"{storage.url}: {e.key!r} was saved by plugin {owner!r}, which is not available{blocked}; "
                f"pip install {dist_name}",
                plugin_name=owner,
                distribution=dist_name,
            )

    models = [e.obj for e in entries if e.kind == "model"]
    model_entries = [e for e in entries if e.kind == "model"]
    core_models = [unwrap_model(m, accelerator) for m in models]
    model_keys = {id(m): e.key for m, e in zip(models, model_entries)}
    model_keys.update({id(m): e.key for m, e in zip(core_models, model_entries)})
    checkpoint = Checkpoint(
        storage,
        mode="load",
        rank=rank,
        world_size=world_size,
        step=manifest.get("step"),
        accelerator=accelerator,
        options=options,
        objects={e.key: e.obj for e in entries if e.kind != "model"},
        model_keys=model_keys,
        manifest=manifest,
        verify=verify,
    )
    hook_models = list(models)
    taken: dict[str, str] = {}

    def after_each(plugin: str) -> None:
        for m, e in zip(models, model_entries):
            if e.key not in taken and all(m is not x for x in hook_models):
                taken[e.key] = plugin
        for e in entries:
            if e.kind != "model" and e.key not in taken and e.key not in checkpoint.objects:
                taken[e.key] = plugin

    call_each(
        pm,
        "statekit_load_state_pre",
        checkpoint,
        {"models": hook_models, "input_dir": storage.url, "checkpoint": checkpoint},
        after_each=after_each,
    )
    for e in entries:
        owner = saved_objects[e.key]["owner"]
        if owner != CORE and taken.get(e.key) != owner:
            raise PluginError(
                f"{storage.url}: {e.key!r} was saved by plugin {owner!r}, which did not load it in statekit_load_state_pre",
                plugin_name=owner,
                hook_name="statekit_load_state_pre",
            )
    not_restored: list[str] = []
    for m, core_model, e in zip(models, core_models, model_entries):
        if e.key not in taken:
            _load_model(checkpoint, e.key, core_model, saved_objects[e.key])
    for e in entries:
        if e.kind == "model" or e.key in taken:
            continue
        _load_entry(checkpoint, e, saved_objects[e.key], not_restored)
    _restore_accelerate_rng(checkpoint, saved_objects)
    saved_world = manifest.get("world_size", 1)
    if saved_world > world_size and rank == 0:
        per_rank_keys = [k for k, o in saved_objects.items() if o.get("per_rank")]
        if per_rank_keys:
            not_restored.append(
                f"per-rank state of ranks {world_size}..{saved_world - 1} for {', '.join(per_rank_keys)} "
                f"(saved with world size {saved_world}, loaded with {world_size})"
            )
    if not_restored:
        warnings.warn(f"{storage.url}: not restored: " + "; ".join(not_restored), StatekitWarning, stacklevel=3)
    call_each(pm, "statekit_load_state_post", checkpoint, {"models": models, "input_dir": storage.url, "checkpoint": checkpoint})
    return manifest


def _restore_accelerate_rng(checkpoint: Checkpoint, saved_objects: dict[str, Any]) -> None:
    """A checkpoint converted from Accelerate carries its random states: restore this
    rank's, as ``Accelerator.load_state`` of the source would (statekit-rng, which runs
    later, leaves a checkpoint without its records alone)."""
    from statekit.foreign import accelerate as accelerate_format

    entry = saved_objects.get(accelerate_format.ACCELERATE_RNG)
    base = f"{accelerate_format.ACCELERATE_RNG}/rank-{checkpoint.rank:05d}"
    if entry is not None and entry.get("owner") == CORE and f"{base}.json" in checkpoint.manifest["files"]:
        accelerate_format.restore_rng(checkpoint.load_state(base))


def _load_model(checkpoint: Checkpoint, key: str, model: torch.nn.Module, saved: dict[str, Any]) -> None:
    files = saved.get("files") or [f"{key}.safetensors"]
    targets = model.state_dict()
    if f"{key}.json" in files:  # a model with extra (non-tensor) state, stored through the codec
        state = checkpoint.load_state(key)
        shapes = {k: (tuple(v.shape), v.dtype) for k, v in state.items() if isinstance(v, torch.Tensor)}
        _check_model_state(checkpoint, key, f"{key}.json", targets, shapes, set(state))
        model.load_state_dict(state)
        return
    rel = f"{key}.safetensors"
    header = _header(checkpoint, rel)
    shapes = {e.name: (e.shape, e.dtype) for e in header.entries}
    for alias, name in header.aliases.items():
        shapes[alias] = shapes[name]
    _check_model_state(checkpoint, key, rel, targets, shapes, set(shapes))
    try:
        with torch.no_grad():
            checkpoint.load_tensors(rel, into=targets)
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(
            f"{exc} (model {key!r} is partly overwritten: load a good checkpoint into it before use)", path=exc.path
        ) from exc


def _check_model_state(
    checkpoint: Checkpoint,
    key: str,
    rel: str,
    targets: Mapping[str, Any],
    saved_shapes: dict[str, tuple[tuple[int, ...], torch.dtype]],
    saved_keys: set[str],
) -> None:
    """Raise :class:`StateMismatchError` before anything is written into the model."""
    meta = sorted(k for k, t in targets.items() if isinstance(t, torch.Tensor) and t.device.type == "meta")
    if meta:
        raise StateMismatchError(
            f"model {key!r} ({checkpoint.url}/{rel}) has parameters on the meta device (built under "
            "init_empty_weights?); the core cannot fill them: pass device_map=/max_memory= with statekit-offload installed",
            mismatched={k: "meta tensor" for k in meta},
        )
    saved = {k: saved_shapes.get(k, (None, None)) for k in saved_keys}
    check_fit(f"model {key!r} ({checkpoint.url}/{rel}; the model is untouched)", targets, saved)


def _header(checkpoint: Checkpoint, rel: str) -> fmt.TensorHeader:
    url = f"{checkpoint.url}/{rel}"
    with checkpoint.open(rel, "rb") as f:
        size = checkpoint.manifest["files"].get(rel, {}).get("size_bytes") if checkpoint.manifest else None
        header, _ = fmt.parse_header(f.read(8), f.read, size, url)
    return header


def _load_entry(checkpoint: Checkpoint, e: Entry, saved: dict[str, Any], not_restored: list[str]) -> None:
    per_rank = bool(saved.get("per_rank"))  # as saved: the caller need not repeat per_rank=
    base = f"{e.key}/rank-{checkpoint.rank:05d}" if per_rank else e.key
    if per_rank and f"{base}.json" not in checkpoint.manifest["files"]:
        not_restored.append(f"{e.key} for rank {checkpoint.rank} (the checkpoint has no state for this rank)")
        return
    state = checkpoint.load_state(base)
    where = f"{e.kind} {e.key!r} ({checkpoint.url}/{base}.json)"
    if e.kind == "tensor":
        value = state.get(e.key) if isinstance(state, dict) else None
        if not isinstance(value, torch.Tensor):
            raise StateMismatchError(where, missing=[e.key])
        if value.shape != e.obj.shape or value.dtype != e.obj.dtype:
            raise StateMismatchError(
                where, mismatched={e.key: f"saved {list(value.shape)} {value.dtype} vs target {list(e.obj.shape)} {e.obj.dtype}"}
            )
        with torch.no_grad():
            e.obj.copy_(value)
        return
    try:
        if e.kind == "dict":
            e.obj.clear()
            e.obj.update(state)
        elif e.kind == "dataloader":
            from statekit.engine import data

            data.restore_loader(e.obj, state)
        else:
            e.obj.load_state_dict(state)
    except (KeyError, ValueError, RuntimeError, TypeError) as exc:
        raise StateMismatchError(f"{where}: {type(exc).__name__}: {exc}") from exc


def verify(url: str, *, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Check every file of a committed checkpoint against its manifest (size and checksum).

    Reads each file once, streaming (the checkpoint's verifying reader checks size and
    checksum at the end of each file); nothing is loaded into objects. Shows a progress
    bar on a terminal (:mod:`statekit.progress`).

    Args:
        url: checkpoint directory URL.
        storage_options: fsspec options.

    Returns:
        The manifest.

    Raises:
        CheckpointNotFoundError, IncompleteCheckpointError, FormatVersionError: as
            :func:`read_manifest`.
        CorruptCheckpointError: the first file that is missing, or whose size or
            checksum differs; ``.path`` names it.
    """
    from statekit.progress import progress

    storage = Storage(url, storage_options)
    manifest = read_manifest(storage)
    checkpoint = Checkpoint(storage, mode="load", manifest=manifest, verify=True)
    total = sum(entry["size_bytes"] for entry in manifest["files"].values())
    with progress(total, "verify") as advance:
        for rel in sorted(manifest["files"]):
            with checkpoint.open(rel, "rb") as f:
                while chunk := f.read(fmt.CHUNK_BYTES):
                    advance(len(chunk))
                f.read()  # end of file: the reader compares size and checksum here
    return manifest
