"""Writing what no plugin took: the core's model files (rank 0) and object state
(replicated state on rank 0, per-rank state on every rank), through the checkpoint.

No plugin code runs here: :mod:`statekit.api.saveload` calls the hooks first.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from statekit.engine.context import Checkpoint
from statekit.engine.entries import Entry, LazyStateDict, _rank_base, _state_of
from statekit.engine.incremental import split_model


def write_core_state(
    checkpoint: Checkpoint,
    entries: list[Entry],
    models: list[Any],
    core_models: list[torch.nn.Module],
    weights: list[Mapping[str, Any] | None],
) -> None:
    """Write (or, during an async save, stage) the core's share of a save.

    In an incremental save, the tensor files that the base checkpoint also holds are
    compared with it on worker threads from the start (:meth:`Checkpoint.comparing_ahead`)
    and saved last, so that hashing them overlaps the writes of everything else.

    Args:
        checkpoint: the save's context; ``checkpoint.objects`` holds the objects no plugin took.
        entries: every entry of the save.
        models: the models no plugin took (as given, possibly wrapped).
        core_models: the same models unwrapped, in the same order.
        weights: per model, the state dict the hooks left (None: compute it).
    """
    rank = checkpoint.rank
    tensor_files: dict[str, Mapping[str, torch.Tensor]] = {}
    if rank == 0:
        for model, core_model, weight in zip(models, core_models, weights):
            key = checkpoint.key_of(model)
            state = weight if weight is not None else LazyStateDict(core_model)
            if all(isinstance(v, torch.Tensor) for v in state.values()):
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
            checkpoint.save_state(_rank_base(entry, rank), _state_of(entry))
        for rel in compared:
            checkpoint.save_tensors(rel, tensor_files[rel])


def tensor_files_of_model(
    checkpoint: Checkpoint, key: str, weights: Mapping[str, torch.Tensor], model: torch.nn.Module | None = None
) -> dict[str, Mapping[str, torch.Tensor]]:
    """The tensor files of one model's state dict (all tensors): ``<key>.safetensors``, or in
    an incremental save, with the frozen tensors of a model with trainable ones in files of
    their own (:func:`statekit.engine.incremental.split_model`).

    Args:
        checkpoint: the save's context (``checkpoint.incremental`` decides the split).
        key: the model's stable key.
        weights: its state dict, tensors only.
        model: the unwrapped model (what requires gradients); None: one file.

    Returns:
        ``{relative path: {name: tensor}}``, ``<key>.safetensors`` first.
    """
    return split_model(key, weights, model) if checkpoint.incremental else {f"{key}.safetensors": weights}
