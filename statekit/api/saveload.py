"""Save through the hooks: :func:`save` (the mapping API) and :func:`save_objects`, which
the Accelerate bridge and the manager call, run the plugins around the engine's write and
commit (the sequence: docs/design-notes.md, "The map"; docs/format.md, "Commit protocol").
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Mapping
from typing import Any

from statekit import distributed, format as fmt
from statekit.api import fingerprint as fingerprints
from statekit.api.asyncsave import PendingSave
from statekit.checks import state_check
from statekit.engine import commit as commits, live_state, write
from statekit.engine.context import CORE, Checkpoint
from statekit.engine.entries import Entry, LazyStateDict, classify, refuse_unclaimed, tensor_bytes, unwrap_model
from statekit.engine.incremental import ReuseBase
from statekit.engine.locking import abandon_save, prepare_target
from statekit.engine.budget import check_host_memory_budget, protected_storages
from statekit.engine.moment import Moment
from statekit.engine.staging import StagingPool
from statekit.errors import InvalidOptionError, PluginError, StatekitError, StatekitWarning, StorageError, UnsupportedValueError, warn_user
from statekit.foreign.detect import describe_folder
from statekit.format.manifest_types import Fingerprint, Lineage, Manifest, StateDigest
from statekit.hooks.registry import track_save_claims
from statekit.hooks.registry import PluginManager, call_each, get_plugin_manager
from statekit.checks import next_batch
from statekit.progress import human
from statekit.storage import Storage

logger = logging.getLogger(__name__)

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
    blocking: bool = True,
    host_memory_budget: int | float | None = None,
    **options: Any,
) -> Manifest | PendingSave:
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
        overwrite: replace a committed statekit checkpoint at ``url`` (its manifest is
            removed first); never a directory statekit did not write.
        per_rank: keys whose state differs per rank (data loaders are per rank by default).
        storage_options: fsspec options for the URL's filesystem.
        blocking: False: return once the state is staged in host memory and write it on a
            background thread (a :class:`~statekit.api.asyncsave.PendingSave`; ``wait()``
            returns the manifest).
        host_memory_budget: an async save's host buffers, at most: bytes (int, at least
            64 KiB) or a fraction of the state (float in (0, 1]); None (default): one buffer
            the size of the state (``docs/concepts.md``, Async saves). Parameters and
            optimizer state are then staged after the call; ``optimizer.step()`` waits for
            them, and an in-place write to one before it is staged fails the save; a
            write that bumps no version counter (through ``p.data``, NumPy or
            ``untyped_storage()``) is not seen: make none before ``wait()``.
        **options: options for plugins (``checkpoint.options``); one that no registered
            plugin reads warns (:meth:`~statekit.hooks.registry.PluginManager.check_options`).

    Returns:
        The committed manifest (a :class:`statekit.format.Manifest`, see ``docs/format.md``),
        or a ``PendingSave`` when not ``blocking``.

    Raises:
        InvalidOptionError: a ``host_memory_budget`` that is not one of the above.
        CheckpointExistsError: a committed checkpoint exists at ``url`` and not
            ``overwrite``; or ``url`` holds files statekit did not write (no manifest, no
            statekit lock: a Trainer or DCP checkpoint), with or without ``overwrite``
            (names the directory and what it holds; nothing is deleted).
        PluginError: a pre-hook failed (nothing committed) or a post-hook failed (committed).
        UnsupportedValueError: a value cannot be stored without pickle (names its key).
        StorageError: the storage failed (names the URL); nothing is committed.
    """
    get_plugin_manager().check_options(options, save)
    entries = [classify(k, v, True if k in per_rank else None) for k, v in state.items()]
    return save_objects(
        url, entries, step=step, metadata=metadata, overwrite=overwrite, storage_options=storage_options, options=options,
        blocking=blocking, host_memory_budget=host_memory_budget,
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
    incremental: bool = False,
    reuse_from: tuple[str, Manifest] | None = None,
    lineage: Lineage | None = None,
    host_memory_budget: int | float | None = None,
    moment: Moment | None = None,
) -> Any:
    """:func:`save` of classified entries (also the Accelerate bridge's and the manager's).

    Args: as :func:`save`, plus
        exclusive: the commit fails with :class:`CheckpointExistsError` if another saver
            committed this checkpoint first.
        blocking: False stages the state to host memory on this thread and writes from a
            background thread (a :class:`statekit.api.asyncsave.PendingSave`), reusing ``staging``.
        after_commit: ``callable(manifest)`` run on every rank after the commit, on the
            writing thread.
        incremental: an incremental save's layout and running checksums
            (docs/incremental.md); ``reuse_from`` is ``(url, manifest)`` of the committed
            checkpoint whose unchanged files it reuses (ignored for ``url`` itself or
            another filesystem).
        lineage: the manifest's ``lineage`` (:mod:`statekit.manager.lineage`), or None.
        host_memory_budget: as :func:`save` (ignored by a blocking save, whose writer holds
            one 16 MiB chunk).
        moment: save this step boundary's state (:class:`statekit.engine.moment.Moment`,
            taken of the same entries) instead of the live one: its state dicts, tensors by
            reference, and the plugins' boundary states; blocking only. Its tensors are
            checked after the files are written, before the commit.

    Returns:
        The committed manifest, or a ``PendingSave`` when not ``blocking``.

    Raises:
        MomentChangedError: (with ``moment``) a tensor changed since its boundary; nothing
            is committed (on every rank).
    """
    started = time.perf_counter()
    check_host_memory_budget(host_memory_budget)
    state_check.mode()  # a misspelled STATEKIT_STATE_CHECK is refused before anything is created
    rank, world_size = distributed.rank_and_world_size()
    storage = _target(url, storage_options, world_size)
    pm = get_plugin_manager()
    metadata = _strict_json(url, metadata)
    commits.agree(lambda: storage.refuse_if_no_space(tensor_bytes(entries, rank), overwrite), url)
    commits.agree(lambda: prepare_target(storage, overwrite, describe_folder) if rank == 0 else None, url)
    if moment is not None and not blocking:
        raise InvalidOptionError(f"{url}: a save of a step boundary's state (moment=) is blocking only")
    staging = None if blocking else (staging if staging is not None else StagingPool())
    checkpoint = context_for(
        storage, "save", entries, accelerator, options, step=step, staging=staging,
        incremental=incremental, reuse_base=_reuse_base(storage, reuse_from, storage_options) if incremental else None,
        moment=moment,
    )
    fingerprint = fingerprints.compute(entries, accelerator, rng=[])  # now: an async save writes this moment's state
    digest = None
    models = [e.obj for e in entries if e.kind == "model"]
    owners: dict[str, str] = {}
    stage_error: Exception | None = None
    if staging is not None:
        _hold(staging, host_memory_budget, entries, step, storage)
    next_batch.claim_witnesses()  # left by a save that failed before it claimed them
    witnesses: list[next_batch.Witness] = []
    try:
        written = _pre_hooks_then_write(pm, checkpoint, entries, models, accelerator, owners)
        # the live values, before save() returns (an async save's too); every rank: DTensors' shards are summed across
        # them (rank 0 gets the digest)
        digest = state_check.record(live_state.live_tensors(
            entries, accelerator, states=written if moment is None else {**moment.states, **written}))
        witnesses = next_batch.claim_witnesses()  # the loaders' next batches, recorded once this save committed
        if moment is not None:
            witnesses = list(moment.witnesses)  # the boundary's loader positions' witnesses
        if staging is not None:
            staging.settle()  # every file's device-to-host copies, waited for once
            staging.stream_rest()  # under a budget: the parameters and optimizer state, staged from now on
    except BaseException as exc:
        if world_size == 1 or not isinstance(exc, Exception):  # (an interrupt too: the pool must not stay held)
            if staging is not None:
                staging.release()
            abandon_save(storage, rank)
            raise
        stage_error = exc  # every rank must still take part in the agreement below

    def finish() -> Manifest:
        def flush() -> None:
            if stage_error is not None:
                raise stage_error
            checkpoint.flush()
            if staging is not None:
                staging.staged()  # under a budget: every tensor staged unchanged (else nothing is committed)
            if moment is not None:  # the files hold the boundary's tensors only if none was written meanwhile
                moment.check(f"after writing the files of {url}, before its commit")

        try:
            commits.agree(flush, url)
            manifest = _commit(pm, checkpoint, entries, owners, metadata, exclusive, fingerprint, digest, lineage)
        except BaseException:
            abandon_save(storage, rank)  # nothing committed; the lock, marked failed, lets a retry (or gc) take it
            raise
        finally:
            if staging is not None:
                staging.release()  # every staged byte is written (or the save failed)
        checkpoint.manifest = manifest
        checkpoint.writer.close()
        record_next_batches(witnesses, storage, rank, manifest)
        if rank == 0:
            log_committed(manifest, storage.url, started, "" if blocking else ", async")
        if after_commit is not None:
            try:
                commits.agree(lambda: after_commit(manifest), url)
            except Exception as exc:  # the checkpoint is committed: reported as what failed after it, by post()
                after_commit_failed.append(exc)
        distributed.barrier()
        return manifest

    after_commit_failed: list[Exception] = []

    def post(manifest: Manifest) -> None:
        _warn_if_no_rng(pm, checkpoint)
        call_each(pm, "statekit_save_state_post", checkpoint, {"models": models, "output_dir": storage.url, "checkpoint": checkpoint})
        if after_commit_failed:
            raise _after_commit_error(after_commit_failed[0], storage.url)

    if not blocking:
        return PendingSave(storage.url, finish, post)
    manifest = finish()
    post(manifest)
    return manifest


def _strict_json(url: str, metadata: dict[str, Any] | None) -> dict[str, Any]:
    """A copy of a save's ``metadata``; :class:`UnsupportedValueError` if it is not strict JSON."""
    metadata = dict(metadata or {})
    try:
        json.dumps(metadata, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise UnsupportedValueError(f"metadata for {url} is not strict JSON: {exc}") from exc
    return metadata


def _hold(staging: StagingPool, budget: int | float | None, entries: list[Entry], step: int | None, storage: Storage) -> None:
    """Take the pool (its buffers are reused: wait until the save that used them last has
    written them) and, under a host-memory budget, start streaming through it."""
    staging.hold()
    if budget is not None:
        optimizers = [e.obj for e in entries if e.kind == "optimizer"]
        what = f"async save of step {step}" if step is not None else "async save"
        staging.begin_budget(budget, protected_storages(optimizers), f"{what} to {storage.url}")


def _after_commit_error(exc: Exception, url: str) -> Exception:
    """What failed after a commit (retention, a ``statekit_checkpoint_committed`` hook),
    raised as itself, its message saying that the checkpoint is committed: an async save's
    ``wait()`` raises it instead of "background save failed"."""
    note = f" (the checkpoint {url} is committed; this failed after its commit)"
    if isinstance(exc, PluginError):
        error: Exception = PluginError(f"{exc}{note}", plugin_name=exc.plugin_name, hook_name=exc.hook_name)
    elif isinstance(exc, StatekitError):
        error = StatekitError(f"{exc}{note}")
    else:
        return exc
    error.__cause__ = exc
    return error


def record_next_batches(witnesses: list[next_batch.Witness], storage: Storage, rank: int, manifest: Manifest) -> None:
    """After the commit: each loader's next-batch record (:class:`statekit.checks.next_batch.Witness`)
    is written beside the checkpoint, to ``next-batch/<key>/rank-<r>.json``, once its batch is seen."""
    for witness in witnesses:
        rel = fmt.next_batch_path(witness.key or "dataloader", rank)
        witness.committed(lambda data, rel=rel: storage.write_bytes(rel, data), manifest.manifest_checksum)


def log_committed(manifest: Manifest, url: str, started: float, how: str = "") -> None:
    """Log one INFO line for a committed save: ``saved step 140 to <url> (12.3 MiB, 0.41 s)``;
    ``started`` is ``time.perf_counter()`` at the save's start, ``how`` goes inside the
    parentheses (``", async"``)."""
    step = manifest.step
    what = f"step {step}" if step is not None else "checkpoint"
    logger.info("saved %s to %s (%s, %.2f s%s)", what, url, human(manifest.size_bytes), time.perf_counter() - started, how)


def _reuse_base(
    storage: Storage, reuse_from: tuple[str, Manifest] | None, storage_options: dict[str, Any] | None
) -> ReuseBase | None:
    """The committed checkpoint an incremental save may reuse files of (see :func:`save_objects`)."""
    if reuse_from is None:
        return None
    url, manifest = reuse_from
    base = Storage(url, storage_options)
    if base.url == storage.url or type(base.fs) is not type(storage.fs):
        return None
    return ReuseBase(base, base.url.rstrip("/").rsplit("/", 1)[-1], manifest)


def _target(url: str | Storage, storage_options: dict[str, Any] | None, world_size: int) -> Storage:
    storage = Storage.of(url, storage_options)
    url = storage.url
    if world_size > 1 and not storage.shared_between_processes:
        raise StorageError(
            f"{url}: memory:// is private to each process and cannot hold a checkpoint written by "
            f"{world_size} ranks; use a local path shared by the ranks or an object store",
            url=url,
        )
    return storage


def context_for(
    storage: Storage, mode: str, entries: list[Entry], accelerator: Any, options: dict[str, Any] | None, **kwargs: Any
) -> Checkpoint:
    """The checkpoint context of a save or load of ``entries``; model keys map both the
    models as given and their unwrapped cores."""
    rank, world_size = distributed.rank_and_world_size()
    model_keys: dict[int, str] = {}
    for e in entries:
        if e.kind == "model":
            model_keys[id(e.obj)] = e.key
            model_keys[id(unwrap_model(e.obj, accelerator))] = e.key
    return Checkpoint(
        storage,
        mode=mode,
        rank=rank,
        world_size=world_size,
        accelerator=accelerator,
        options=options,
        objects={e.key: e.obj for e in entries if e.kind != "model"},
        model_keys=model_keys,
        **kwargs,
    )


def _pre_hooks_then_write(
    pm: PluginManager, checkpoint: Checkpoint, entries: list[Entry], models: list[Any], accelerator: Any, owners: dict[str, str]
) -> dict[str, Mapping[str, Any]]:
    """Pre-hooks one plugin at a time, then the core's own files (or their staged copies).
    Returns the state dicts the core wrote of the models no plugin took, by key (computed
    once: the state digest reuses them)."""
    core_models = [unwrap_model(m, accelerator) for m in models]
    hook_models = list(models)
    moment = checkpoint.moment  # a save of a step boundary: the model state dicts taken there
    weights: list[Mapping[str, Any]] = [
        LazyStateDict(m) if moment is None else moment.state_for(checkpoint.key_of(model))
        for model, m in zip(models, core_models)]
    call_each(
        pm,
        "statekit_save_state_pre",
        checkpoint,
        {"models": hook_models, "weights": weights, "output_dir": checkpoint.url, "checkpoint": checkpoint},
        after_each=track_save_claims(checkpoint, hook_models, weights, checkpoint._model_keys, owners),
    )
    checkpoint.plugin = None
    refuse_unclaimed(entries, checkpoint.objects, "save")
    left = {id(m): w for m, w in zip(hook_models, weights)}
    kept = [(m, c) for m, c in zip(models, core_models) if id(m) in left]
    write.write_core_state(checkpoint, entries, [m for m, _ in kept], [c for _, c in kept], [left[id(m)] for m, _ in kept])
    return {checkpoint.key_of(m): left[id(m)] for m, _ in kept}


def _commit(
    pm: PluginManager,
    checkpoint: Checkpoint,
    entries: list[Entry],
    owners: dict[str, str],
    metadata: dict[str, Any],
    exclusive: bool,
    fingerprint: Fingerprint,
    digest: StateDigest | None,
    lineage: Lineage | None = None,
) -> Manifest:
    """Gather every rank's file entries to rank 0, build and commit the manifest there
    (with the resume ``fingerprint``, its RNG kinds from what the plugins saved, and the
    state ``digest``), share it."""
    plugins = _plugin_versions(pm, owners, checkpoint)
    files = commits.gather_files(checkpoint)
    manifest = None
    if checkpoint.rank == 0:
        distributions = {n: s.distribution for n, s in pm.sources.items() if s.distribution}
        objects = commits.objects_table(entries, owners, files, distributions)
        fingerprint = dataclasses.replace(fingerprint, rng=tuple(fingerprints.rng_saved(checkpoint.all_records(), files)))
        manifest = commits.build_manifest(checkpoint, files, objects, plugins=plugins, metadata=metadata,
                                          fingerprint=fingerprint, state_digest=digest, lineage=lineage,
                                          saved={**checkpoint.objects, **{e.key: e.obj for e in entries}})
    storage = checkpoint.storage
    return commits.agree(
        lambda: commits.commit(storage, manifest, exclusive) if checkpoint.rank == 0 else None, storage.url, broadcast=True
    )


def plugin_versions(pm: PluginManager, names: set[str]) -> dict[str, str]:
    """``{plugin name: version}`` for the named plugins ("unknown" where the plugin
    manager has no version), merged over every rank."""
    versions = {}
    for name in sorted(names - {CORE}):
        source = pm.sources.get(name)
        versions[name] = source.version if source and source.version else "unknown"
    merged: dict[str, str] = {}
    for v in distributed.gather_to_rank0(versions) or []:
        merged.update(v)
    return merged


def _plugin_versions(pm: PluginManager, owners: dict[str, str], checkpoint: Checkpoint) -> dict[str, str]:
    names = set(owners.values()) | {f.writer for f in checkpoint.files.values()} | set(checkpoint.all_records())
    if checkpoint.record_unlisted_at_commit:
        names.add(checkpoint.record_unlisted_at_commit)
    return plugin_versions(pm, names)


def _warn_if_no_rng(pm: PluginManager, checkpoint: Checkpoint) -> None:
    global _warned_rng
    if not _warned_rng and not pm.manages_rng() and not checkpoint.handles_rng:
        _warned_rng = True
        warn_user(
            "no installed plugin saves random-number-generator state (install statekit-rng): "
            "a resume from this checkpoint will not be bit-exact",
            StatekitWarning,
        )
