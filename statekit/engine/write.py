"""Writing what no plugin took: the core's model files (rank 0) and object state
(replicated state on rank 0, per-rank state on every rank), through the checkpoint; no
plugin code runs here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from statekit import format as fmt
from statekit.engine.context import Checkpoint
from statekit.engine.entries import Entry, LazyStateDict
from statekit.engine import pretrained, references
from statekit.engine.incremental import split_model
from statekit.loaders import data


def write_core_state(
    checkpoint: Checkpoint,
    entries: list[Entry],
    models: list[Any],
    core_models: list[torch.nn.Module],
    weights: list[Mapping[str, Any] | None],
) -> None:
    """Write (or, during an async save, stage) the core's share of a save: the ``models`` no
    plugin took (as given; ``core_models`` unwrapped, ``weights`` the state dicts the hooks
    left, None: compute it) and the entries still in ``checkpoint.objects``. Files the base
    holds are compared ahead and saved last (:meth:`Checkpoint.comparing_ahead`)."""
    rank = checkpoint.rank
    tensor_files: dict[str, Mapping[str, torch.Tensor]] = {}
    if rank == 0:
        for model, core_model, weight in zip(models, core_models, weights):
            key = checkpoint.key_of(model)
            state = weight if weight is not None else LazyStateDict(core_model)
            if all(isinstance(v, torch.Tensor) for v in state.values()):
                source = pretrained.source_of((model, core_model))
                if source is not None:  # a frozen base recorded as references, not written
                    reference, state = references.reference_frozen(key, state, core_model, source)
                    if reference is not None:
                        checkpoint.references[key] = reference
                tensor_files.update(tensor_files_of_model(checkpoint, key, state, core_model))
            else:  # modules with extra (non-tensor) state: the codec keeps it, still no pickle
                checkpoint.save_state(key, dict(state))
    with checkpoint.comparing_ahead(tensor_files) as compared:
        for rel, tensors in tensor_files.items():
            if rel not in compared:
                checkpoint.save_tensors(rel, tensors)
        for entry in entries:
            if entry.kind == "model" or entry.key not in checkpoint.objects or (rank != 0 and not entry.per_rank):
                continue
            moment = checkpoint.moment  # a save of a step boundary's state (engine/moment.py)
            checkpoint.save_state(_rank_base(entry, rank), moment.state_for(entry.key) if moment else state_of(entry))
        for rel in compared:
            checkpoint.save_tensors(rel, tensor_files[rel])


def tensor_files_of_model(
    checkpoint: Checkpoint, key: str, weights: Mapping[str, torch.Tensor], model: torch.nn.Module | None = None
) -> dict[str, Mapping[str, torch.Tensor]]:
    """``{relative path: {name: tensor}}`` of one model's state dict (tensors only):
    ``<key>.safetensors``, or in an incremental save :func:`statekit.engine.incremental.split_model`."""
    return split_model(key, weights, model) if checkpoint.incremental else {f"{key}.safetensors": weights}


def state_of(entry: Entry) -> Any:
    """The state an entry other than a model is saved as (a tensor's ``{key: tensor}``, a
    dict itself, a data loader's position, else ``state_dict()``)."""
    if entry.kind == "tensor":
        return {entry.key: entry.obj}
    if entry.kind == "dict":
        return entry.obj
    if entry.kind == "dataloader":
        return data.loader_state(entry.obj, entry.key)
    return entry.obj.state_dict()


def _rank_base(entry: Entry, rank: int) -> str:
    return fmt.rank_path(entry.key, rank) if entry.per_rank else entry.key
