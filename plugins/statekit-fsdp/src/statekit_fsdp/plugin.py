"""The statekit-fsdp hooks: sharded save and resharding load of FSDP models and their optimizers.

Which models are taken, the files under ``<key>/``, the records and the load checks:
docs/plugins/fsdp.md. ``torch.distributed.checkpoint`` and FSDP are imported inside the
hooks; DCP's collectives run on statekit's own gloo group, never the training's.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

from statekit.plugin_api import (
    CorruptCheckpointError,
    StatekitError,
    StateMismatchError,
    encode,
    hookimpl,
    rank_and_world_size,
    statekit_group,
)

logger = logging.getLogger("statekit_fsdp")

RECORD_FORMAT = 1
"""Version of what this plugin records per model in the manifest (``records["fsdp"][key]``)."""


def _convert_to_safetensors(src_url: str, out_url: str, *, storage_options: dict[str, Any] | None = None) -> None:
    """``statekit convert SRC OUT --to safetensors``: see :func:`statekit_fsdp.consolidation.consolidate`."""
    from statekit_fsdp.consolidation import consolidate

    consolidate(src_url, out_url, storage_options=storage_options)


STATEKIT_CONVERTERS = {"safetensors": _convert_to_safetensors}
"""Converters offered to ``statekit convert`` (name -> ``fn(src_url, out_url, *, storage_options=None)``)."""

def STATEKIT_EXPORT_SOURCE(checkpoint: Any, key: str) -> Any:  # noqa: N802 - the attribute statekit looks up
    """``statekit.export_pretrained`` of a model saved sharded: see
    :func:`statekit_fsdp.consolidation.export_source`."""
    from statekit_fsdp.consolidation import export_source

    return export_source(checkpoint, key)


STATEKIT_OPTIONS: frozenset[str] = frozenset()
"""The ``checkpoint.options`` this plugin reads: none."""


# --------------------------------------------------------------------------- helpers


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _group() -> Any:
    """statekit's gloo group when torch.distributed runs, else None (DCP then runs locally)."""
    if not _distributed():
        return None
    return statekit_group()


def _run_dcp(fn: Any, what: str) -> Any:
    """Run a DCP call; turn its ``CheckpointException`` (a ``BaseException``) into a statekit error.

    If this rank's own failure is a statekit error it is re-raised as is; otherwise a
    :class:`statekit.CorruptCheckpointError` (when any rank found a corrupt file) or a
    :class:`statekit.StatekitError` lists every rank's failure.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():
            # one process without torch.distributed: DCP runs locally, as intended
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            return fn()
    except CheckpointException as exc:
        failures = {}
        for rank, failure in sorted(exc.failures.items()):
            failures[rank] = failure[0] if isinstance(failure, tuple) else failure
        summary = f"{what} failed on rank(s) {sorted(failures)}: " + "; ".join(
            f"rank {r}: {type(e).__name__}: {e}" for r, e in failures.items()
        )
        own = failures.get(_rank())
        if isinstance(own, StatekitError):
            raise own from None
        corrupt = [e for e in failures.values() if isinstance(e, CorruptCheckpointError)]
        if corrupt:
            raise CorruptCheckpointError(summary, path=getattr(corrupt[0], "path", None)) from None
        raise StatekitError(summary) from None


def _rank() -> int:
    return rank_and_world_size()[0]


# --------------------------------------------------------------------------- save


@hookimpl(tryfirst=True)
def statekit_save_state_pre(models: list[Any], weights: list[Any], output_dir: str, checkpoint: Any) -> None:
    """Take every sharded model (and its optimizers) and write it with DCP, on every rank."""
    if not models or not _distributed():
        return  # FSDP and DTensors need torch.distributed: nothing to take
    from statekit_fsdp.state import sharding_kind, strip_wrappers

    for model in list(models):
        core = strip_wrappers(model)
        kind = sharding_kind(core)
        if kind is None:
            continue  # replicated (plain or DDP): the core writes it once, from rank 0
        key = checkpoint.key_of(model)
        index = next(i for i, m in enumerate(models) if m is model)
        models.pop(index)
        weights.pop(index)  # never computes the lazy (gathering) state dict
        _save_sharded(checkpoint, key, core, kind)


def _save_sharded(checkpoint: Any, key: str, model: Any, kind: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    from statekit_fsdp.dcp_storage import StatekitStorageWriter
    from statekit_fsdp.state import frozen_keys, optimizers_of, split_state, unique

    optimizers = optimizers_of(model, checkpoint.objects, key) if _objects_writable(checkpoint) else []
    for okey, _ in optimizers:
        checkpoint.objects.pop(okey)
    if optimizers:
        model_sd, optim_sd = get_state_dict(model, unique([o for _, o in optimizers]))
        state = {"model": model_sd, "optim": optim_sd}
    else:
        state = {"model": get_model_state_dict(model)}
    skeleton, tensors = split_state(state)
    encode(skeleton)  # every rank checks the non-tensor state before any collective (names the bad key)
    _run_dcp(
        lambda: dcp.save(
            tensors,
            storage_writer=StatekitStorageWriter(checkpoint, key, frozen_keys(model, "model") if checkpoint.incremental else frozenset()),
            planner=dcp.DefaultSavePlanner(),
            process_group=_group(),
        ),
        f"{checkpoint.url}: sharded save of {key!r}",
    )
    if checkpoint.rank == 0:
        checkpoint.save_state(f"{key}/state", skeleton)
    checkpoint.records[key] = {
        "format": RECORD_FORMAT,
        "sharding": kind,
        "world_size": checkpoint.world_size,
        "optimizers": [okey for okey, _ in optimizers],
        "tensors": len(tensors),
    }


def _objects_writable(checkpoint: Any) -> bool:
    """False in Accelerate's attach mode, where ``checkpoint.objects`` is read-only."""
    return isinstance(checkpoint.objects, dict)


# --------------------------------------------------------------------------- load


@hookimpl(tryfirst=True)
def statekit_load_state_pre(models: list[Any], input_dir: str, checkpoint: Any) -> None:
    """Take back every model this plugin saved (and its optimizers) and load it, resharding."""
    from statekit_fsdp.state import strip_wrappers

    mine = checkpoint.plugin
    for model in list(models):
        key = checkpoint.key_of(model)
        if checkpoint.owner_of(key) != mine:
            continue
        models.remove(model)
        _load_sharded(checkpoint, key, strip_wrappers(model))
    if _objects_writable(checkpoint):
        for okey in list(checkpoint.objects):
            if checkpoint.owner_of(okey) == mine:
                model_key = next((k for k, r in checkpoint.records.items() if okey in r.get("optimizers", [])), None)
                raise StatekitError(
                    f"{checkpoint.url}: optimizer {okey!r} was saved sharded together with model {model_key!r}; "
                    f"load it together with that model"
                )


def _load_sharded(checkpoint: Any, key: str, model: Any) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_model_state_dict, set_state_dict

    from statekit_fsdp.dcp_metadata import read_metadata
    from statekit_fsdp.dcp_storage import StatekitStorageReader
    from statekit_fsdp.state import fill_state, refs_of, split_state

    record = _record(checkpoint, key)
    optimizers = _saved_optimizers(checkpoint, key, record)
    metadata = read_metadata(checkpoint, key)
    saved = checkpoint.load_state(f"{key}/state")
    if not isinstance(saved, dict) or "model" not in saved:
        raise CorruptCheckpointError(f"{checkpoint.url}/{key}/state.json: no model state", path=f"{checkpoint.url}/{key}/state.json")
    if not optimizers:
        saved = {"model": saved["model"]}
        target = {"model": get_model_state_dict(model)}
    else:
        model_sd, optim_sd = get_state_dict(model, optimizers)
        target = {"model": model_sd, "optim": optim_sd}
    _, target_tensors = split_state(target)

    saved_refs = refs_of(saved)
    _check_target(checkpoint, key, metadata, saved_refs, target_tensors)
    saved_world = record.get("world_size")
    if saved_world != checkpoint.world_size and checkpoint.rank == 0:
        logger.info(
            "statekit-fsdp: resharding %r from %s to %s processes (%s)", key, saved_world, checkpoint.world_size, checkpoint.url
        )
    load_state = {k: target_tensors[k] for k in saved_refs}
    _run_dcp(
        lambda: dcp.load(
            load_state,
            storage_reader=StatekitStorageReader(checkpoint, key, metadata),
            planner=dcp.DefaultLoadPlanner(),
            process_group=_group(),
        ),
        f"{checkpoint.url}: sharded load of {key!r}",
    )
    filled = fill_state(saved, load_state)
    if optimizers:
        set_state_dict(model, optimizers, model_state_dict=filled["model"], optim_state_dict=filled["optim"])
    else:
        set_model_state_dict(model, filled["model"])


def _record(checkpoint: Any, key: str) -> dict[str, Any]:
    """This plugin's record of model ``key`` (see :func:`_save_sharded`)."""
    record = checkpoint.records.get(key)
    if not isinstance(record, dict) or record.get("format") != RECORD_FORMAT:
        raise CorruptCheckpointError(
            f"{checkpoint.url}: manifest has no statekit-fsdp record (format {RECORD_FORMAT}) for {key!r}",
            path=f"{checkpoint.url}/statekit.json",
        )
    return record


def _saved_optimizers(checkpoint: Any, key: str, record: dict[str, Any]) -> list[Any]:
    """Take the optimizers saved with model ``key`` from ``checkpoint.objects``: all of them, or none."""
    from statekit_fsdp.state import inner_optimizer, unique

    saved_optims = list(record.get("optimizers", []))
    present = [k for k in saved_optims if k in checkpoint.objects] if _objects_writable(checkpoint) else []
    if present and present != saved_optims:
        raise StatekitError(
            f"{checkpoint.url}: model {key!r} was saved with optimizers {saved_optims}; load all of them or none "
            f"(got {present})"
        )
    optimizers = unique([inner_optimizer(checkpoint.objects.pop(k)) for k in present])
    if None in optimizers:
        raise StatekitError(f"{checkpoint.url}: {present} must be optimizers (saved as the optimizers of model {key!r})")
    return optimizers


def _check_target(checkpoint: Any, key: str, metadata: Any, saved_refs: list[str], target_tensors: dict[str, Any]) -> None:
    """Compare the saved tensors (global shapes from DCP's metadata) with the load's targets,
    before anything is read. Optimizer state may be missing (an optimizer without state yet);
    model tensors may not."""
    from statekit_fsdp.state import global_shape

    saved_set = set(saved_refs)
    missing = [k for k in target_tensors if k.startswith("model.") and k not in saved_set]
    unexpected = [k for k in saved_refs if k not in target_tensors]
    mismatched = {}
    for k in saved_refs:
        md = metadata.state_dict_metadata.get(k)
        if md is None or not hasattr(md, "size"):
            raise CorruptCheckpointError(f"{checkpoint.url}/{key}/metadata.json: no tensor entry for {k!r}", path=f"{checkpoint.url}/{key}/metadata.json")
        t = target_tensors.get(k)
        if t is not None and (tuple(md.size) != global_shape(t) or md.properties.dtype != t.dtype):
            mismatched[k] = f"saved {list(md.size)} {md.properties.dtype} vs target {list(global_shape(t))} {t.dtype}"
    if missing or unexpected or mismatched:
        raise StateMismatchError(f"model {key!r} ({checkpoint.url}/{key}/; the model is untouched)", missing, unexpected, mismatched)
