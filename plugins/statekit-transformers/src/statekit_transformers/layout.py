"""A Trainer checkpoint's model folder, written through the checkpoint: what ``save_pretrained`` writes.

Trainer's ``checkpoint-<step>/`` holds the model as ``PreTrainedModel.save_pretrained``
writes it (``config.json``, ``model.safetensors``, ``generation_config.json``, the
tokenizer's files) or, for a peft model, as ``PeftModel.save_pretrained`` does
(``adapter_config.json``, ``adapter_model.safetensors``). Users load it with
``from_pretrained`` and push it to the Hub; this module keeps that layout, with two
differences that do not change what ``from_pretrained`` reads:

* every file goes through the :class:`statekit.plugin_api.Checkpoint` (size and checksum
  in the manifest, verified on read, atomic commit, any fsspec storage, async saves);
* the weights of a model with frozen parameters are split into two shards, frozen then
  trainable, with the ``model.safetensors.index.json`` that transformers writes for a
  sharded model: an incremental save then reuses the frozen shard's bytes (a frozen
  embedding is not rewritten at every checkpoint). A model without frozen parameters is
  one ``model.safetensors``, exactly as ``save_pretrained`` names it.

The tensors written are those ``save_pretrained`` writes: the model's state dict without
``_keys_to_ignore_on_save`` and without tied duplicates (transformers'
``remove_tied_weights_from_state_dict``; the tie is rebuilt by the live model on resume,
and by ``from_pretrained``). Small files (configs, the tokenizer) are produced by the
library's own ``save_pretrained`` into a temporary directory and copied in, so their
content is the library's. A model with a weight-conversion mapping (names on disk differ
from the names in memory, transformers ``revert_weight_conversion``) is refused at save
with the class named: its resume through the in-memory names is not verified here.

Nothing here imports transformers or peft at module import; both are imported when a
model of theirs is saved or loaded.
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from statekit.plugin_api import Checkpoint, CorruptCheckpointError, StateMismatchError, StatekitError, custom_load

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PRETRAINED = "pretrained"
"""``layout`` of a ``PreTrainedModel`` (``config.json`` + ``model*.safetensors``)."""
ADAPTER = "adapter"
"""``layout`` of a peft model (``adapter_config.json`` + ``adapter_model.safetensors``)."""


@dataclass
class ModelRecord:
    """What the manifest records of the model folder (this plugin's record of the key).

    Attributes:
        layout: :data:`PRETRAINED` or :data:`ADAPTER`.
        shards: weight file -> the tensor names it holds, in write order.
        files: every other file written (configs, tokenizer), relative to the checkpoint.
    """

    layout: str
    shards: dict[str, list[str]] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"layout": self.layout, "shards": self.shards, "files": self.files}

    @classmethod
    def from_json(cls, data: Any, source: str) -> ModelRecord:
        try:
            return cls(str(data["layout"]), {str(k): [str(n) for n in v] for k, v in data["shards"].items()}, list(data["files"]))
        except (KeyError, TypeError, AttributeError) as exc:
            raise CorruptCheckpointError(f"{source}: malformed statekit-transformers model record: {exc!r}") from exc


def _in_mro(obj: Any, module_prefix: str, name: str) -> bool:
    return any(c.__name__ == name and c.__module__.startswith(module_prefix) for c in type(obj).__mro__)


def layout_of(model: torch.nn.Module) -> str | None:
    """:data:`ADAPTER` for a peft ``PeftModel``, :data:`PRETRAINED` for a transformers
    ``PreTrainedModel``, None for another module (by class, without importing either library)."""
    if _in_mro(model, "peft", "PeftModel"):
        return ADAPTER
    if _in_mro(model, "transformers", "PreTrainedModel"):
        return PRETRAINED
    return None


def _copy_dir_in(checkpoint: Checkpoint, directory: str) -> list[str]:
    """Copy every file a library wrote into ``directory`` into the checkpoint (checksummed)."""
    written = []
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb") as src, checkpoint.open(name, "wb") as dst:
            dst.write(src.read())
        written.append(name)
    return written


def pretrained_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors ``PreTrainedModel.save_pretrained`` writes for ``model`` (transformers 5).

    Raises:
        StatekitError: the model has a weight-conversion mapping (names on disk would differ).
    """
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    state = model.state_dict()
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        state.pop(key, None)
    state = remove_tied_weights_from_state_dict(state, model)
    reverted = revert_weight_conversion(model, dict(state))
    # a model loaded with from_pretrained carries its conversion list even when it is empty
    # (GPT-2): the result is then the same tensors under the same names in sorted order,
    # which is no conversion
    if set(reverted) != set(state) or any(reverted[k] is not state[k] for k in state):
        raise StatekitError(
            f"{type(model).__name__} has a weight-conversion mapping (save_pretrained renames its tensors): "
            "statekit-transformers does not write it yet; save it with Trainer alone"
        )
    return state


def write_model(checkpoint: Checkpoint, model: torch.nn.Module, processing_class: Any = None) -> ModelRecord:
    """Write ``model`` (unwrapped) in its library's folder layout at the checkpoint's root.

    Args:
        checkpoint: the save's context.
        model: a ``PreTrainedModel`` or a peft ``PeftModel`` (:func:`layout_of` not None).
        processing_class: the tokenizer or processor whose ``save_pretrained`` files go
            beside the model (Trainer's ``processing_class``), or None.

    Returns:
        The record to keep in the manifest.

    Raises:
        StatekitError: see :func:`pretrained_tensors`.
        UnsupportedDtypeError, StorageError: a weight file cannot be written.
    """
    kind = layout_of(model)
    record = ModelRecord(kind or PRETRAINED)
    with tempfile.TemporaryDirectory(prefix="statekit-transformers-") as tmp:
        if kind == ADAPTER:
            from peft import get_peft_model_state_dict

            name = getattr(model, "active_adapter", "default")
            config = copy.copy(model.peft_config[name])
            config.inference_mode = True  # as PeftModel.save_pretrained writes it
            if config.base_model_name_or_path is None:
                config.base_model_name_or_path = getattr(model.get_base_model(), "name_or_path", None)
            config.save_pretrained(tmp)
            tensors = get_peft_model_state_dict(model, adapter_name=name)
            record.shards[ADAPTER_WEIGHTS] = list(tensors)
            checkpoint.save_tensors(ADAPTER_WEIGHTS, tensors, {"format": "pt"})
        else:
            config = copy.deepcopy(model.config)
            config.architectures = [type(model).__name__]
            config.save_pretrained(tmp)
            generation = getattr(model, "generation_config", None)
            if generation is not None and model.can_generate():
                generation.save_pretrained(tmp)
            _write_weights(checkpoint, model, record)
        if processing_class is not None:
            processing_class.save_pretrained(tmp)
        record.files = _copy_dir_in(checkpoint, tmp)
    return record


def _write_weights(checkpoint: Checkpoint, model: torch.nn.Module, record: ModelRecord) -> None:
    state = pretrained_tensors(model)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    frozen_names = [n for n in state if n not in trainable and n in dict(model.named_parameters())]
    if not frozen_names or len(frozen_names) == len(state):
        record.shards[SAFE_WEIGHTS] = list(state)
        checkpoint.save_tensors(SAFE_WEIGHTS, state, {"format": "pt"})
        return
    # frozen first: an incremental save reuses that shard's bytes (docs/incremental.md)
    groups = [frozen_names, [n for n in state if n not in set(frozen_names)]]
    weight_map = {}
    total = 0
    for i, names in enumerate(groups, start=1):
        shard = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        tensors = {n: state[n] for n in names}
        checkpoint.save_tensors(shard, tensors, {"format": "pt"})
        record.shards[shard] = names
        weight_map.update(dict.fromkeys(names, shard))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    with checkpoint.open(SAFE_INDEX, "w") as f:  # transformers' own index format (json.dumps, indent=2, sort_keys)
        f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")


def read_model(checkpoint: Checkpoint, model: torch.nn.Module, record: ModelRecord, strict: bool = True) -> None:
    """Load the weights of :func:`write_model` into ``model`` (unwrapped), in place, verified.

    Every shard is read and checked against the manifest before the first tensor is copied,
    so a corrupt file or a mismatch leaves the model untouched. Tied parameters stay tied
    (the values are copied into the live parameters).

    Raises:
        StateMismatchError: ``strict`` and the names or shapes differ (listed).
        CorruptCheckpointError: a shard is missing or fails verification.
    """
    tensors: dict[str, torch.Tensor] = {}
    for shard in record.shards:
        tensors.update(checkpoint.load_tensors(shard))
    if record.layout == ADAPTER:
        from peft import set_peft_model_state_dict

        _check_shapes(checkpoint, _adapter_targets(model), tensors, strict)
        result = set_peft_model_state_dict(model, tensors, adapter_name=getattr(model, "active_adapter", "default"))
        if strict and getattr(result, "unexpected_keys", None):
            raise StateMismatchError(f"{checkpoint.url}: adapter weights the model does not have: {result.unexpected_keys[:8]}")
        return
    live = model.state_dict()
    _check_shapes(checkpoint, live, tensors, strict)
    missing = [n for n in pretrained_tensors_names(model, live) if n not in tensors]
    if strict and missing:
        raise StateMismatchError(f"{checkpoint.url}: the checkpoint lacks {len(missing)} weights of the model: {missing[:8]}")
    if custom_load(model) is not None:  # its load hooks or _load_from_state_dict run, as in Trainer's own load
        model.load_state_dict(tensors, strict=False)  # (the tied names the folder leaves out: checked above)
        return
    with torch.no_grad():
        for name, value in tensors.items():
            live[name].copy_(value)


def _adapter_targets(model: torch.nn.Module) -> Mapping[str, torch.Tensor]:
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model, adapter_name=getattr(model, "active_adapter", "default"))


def pretrained_tensors_names(model: torch.nn.Module, live: Mapping[str, torch.Tensor]) -> list[str]:
    """The names :func:`pretrained_tensors` would write (the state dict's without ties)."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    state = dict(live)
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        state.pop(key, None)
    return list(remove_tied_weights_from_state_dict(state, model))


def _check_shapes(checkpoint: Checkpoint, live: Mapping[str, torch.Tensor], saved: Mapping[str, torch.Tensor], strict: bool) -> None:
    unexpected = [n for n in saved if n not in live]
    differ = [
        f"{n}: saved {tuple(t.shape)} {t.dtype}, model {tuple(live[n].shape)} {live[n].dtype}"
        for n, t in saved.items()
        if n in live and (t.shape != live[n].shape or t.dtype != live[n].dtype)
    ]
    if differ or (strict and unexpected):
        problems = differ + [f"{n}: not in the model" for n in unexpected[:8]]
        raise StateMismatchError(f"{checkpoint.url}: the model does not fit its saved weights: " + "; ".join(problems[:8]))
