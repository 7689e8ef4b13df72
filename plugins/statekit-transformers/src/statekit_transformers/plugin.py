"""The statekit-transformers hooks: a Trainer checkpoint's own files, written through statekit.

They act only on saves and loads that carry the plugin option ``transformers_trainer`` (the
``Trainer`` being checkpointed; :class:`statekit_transformers.StatekitTrainerMixin` passes
it). Elsewhere a transformers model is an ordinary ``nn.Module`` for statekit (its key names
its files, frozen parameters are reused by incremental saves): this plugin claims only the
models of Trainer checkpoints, where ``from_pretrained`` and the Hub expect Trainer's layout.

In a Trainer checkpoint:

* the object under :data:`MODEL_KEY`, a ``PreTrainedModel`` or peft model, is taken out of
  the core's path and written in its library's folder layout (:mod:`statekit_transformers.layout`);
  another module stays with the core;
* the object under :data:`STATE_KEY` (a :class:`TrainerStateFile`) is written as
  ``trainer_state.json``, the bytes ``TrainerState.save_to_json`` writes (Trainer reads
  that file itself on resume), and the training arguments as ``training_args.json``
  (``TrainingArguments.to_json_string``; Trainer's pickled ``training_args.bin`` is not
  written);
* optimizer, scheduler, scaler and the random states stay with the core and statekit-rng
  (safetensors and JSON).

Importing this module imports neither transformers nor peft.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

from statekit.plugin_api import MANIFEST_NAME, Checkpoint, CorruptCheckpointError, ModelSource, TensorFiles, hookimpl, unwrap_model
from statekit_transformers import layout

__all__ = [
    "MANIFEST_NAME",
    "MODEL_KEY",
    "OPTION",
    "STATE_KEY",
    "STATEKIT_EXPORT_SOURCE",
    "STATEKIT_OPTIONS",
    "TRAINER_STATE_NAME",
    "TRAINING_ARGS_NAME",
    "TrainerStateFile",
    "statekit_load_state_pre",
    "statekit_save_state_pre",
]

OPTION = "transformers_trainer"
"""The plugin option naming the ``Trainer`` whose checkpoint is saved or loaded."""
STATEKIT_OPTIONS = frozenset({OPTION})
MODEL_KEY = "model"
STATE_KEY = "trainer_state"
TRAINER_STATE_NAME = "trainer_state.json"
TRAINING_ARGS_NAME = "training_args.json"


def STATEKIT_EXPORT_SOURCE(checkpoint: Checkpoint, key: str) -> ModelSource | None:  # noqa: N802 - the attribute statekit looks up
    """``statekit.export_pretrained`` of a Trainer checkpoint's model folder: its weight files
    read one tensor at a time, and its other files (``config.json``, ``generation_config.json``,
    the tokenizer's, ``adapter_config.json``) as they are. None for another key.

    Raises:
        CorruptCheckpointError: the plugin's record of the model is malformed.
    """
    records = (checkpoint.manifest.records.get("transformers") if checkpoint.manifest is not None else None) or {}
    if key != MODEL_KEY or MODEL_KEY not in records:
        return None
    record = layout.ModelRecord.from_json(records[MODEL_KEY], checkpoint.url)
    files = {}
    for rel in record.files:
        with checkpoint.open(rel, "rb") as f:
            files[rel] = f.read()
    adapter = record.layout == layout.ADAPTER
    return TensorFiles(checkpoint, list(record.shards)).source(
        files=files, weights_name="adapter_model" if adapter else "model", state_paths=not adapter
    )


class TrainerStateFile:
    """The ``TrainerState`` of a Trainer, as a stateful object of the checkpoint.

    Saved by this plugin as ``trainer_state.json`` (Trainer's own file); loading it only
    checks the file (Trainer reads it itself). ``state_dict`` exists so that the object is
    a valid checkpoint entry; it is the JSON content.

    Args:
        trainer: the ``transformers.Trainer``.
    """

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return json.loads(self.json_text())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = dict(state)

    def json_text(self) -> str:
        """``trainer_state.json`` as ``TrainerState.save_to_json`` writes it."""
        with tempfile.TemporaryDirectory(prefix="statekit-transformers-") as tmp:
            path = os.path.join(tmp, TRAINER_STATE_NAME)
            self.trainer.state.save_to_json(path)
            with open(path, encoding="utf-8") as f:
                return f.read()


def _processing_class(trainer: Any) -> Any:
    """What Trainer's ``_save`` writes beside the model: ``processing_class``, else the collator's tokenizer."""
    if getattr(trainer, "processing_class", None) is not None:
        return trainer.processing_class
    return getattr(getattr(trainer, "data_collator", None), "tokenizer", None)


@hookimpl(tryfirst=True)  # before statekit-diffusers, which would take a transformers model too
def statekit_save_state_pre(models: list[Any], weights: list[Any], output_dir: str, checkpoint: Checkpoint) -> None:
    """Write a Trainer checkpoint's model folder, ``trainer_state.json`` and ``training_args.json``.

    Only with the option ``transformers_trainer``; see the module docstring.

    Raises:
        StatekitError: a model with a weight-conversion mapping (names the class).
    """
    trainer = checkpoint.options.get(OPTION)
    if trainer is None:
        return
    for i, model in enumerate(models):
        inner = unwrap_model(model)
        if checkpoint.key_of(model) != MODEL_KEY or layout.layout_of(inner) is None:
            continue
        processing = _processing_class(trainer) if checkpoint.rank == 0 else None
        record = layout.write_model(checkpoint, inner, processing) if checkpoint.rank == 0 else None
        if record is not None:
            checkpoint.records[MODEL_KEY] = record.to_json()
        models.pop(i)
        weights.pop(i)
        break
    state = checkpoint.objects.pop(STATE_KEY, None)
    if state is not None and checkpoint.rank == 0:
        with checkpoint.open(TRAINER_STATE_NAME, "w") as f:
            f.write(state.json_text())
        with checkpoint.open(TRAINING_ARGS_NAME, "w") as f:
            f.write(trainer.args.to_json_string())


@hookimpl(tryfirst=True)
def statekit_load_state_pre(models: list[Any], input_dir: str, checkpoint: Checkpoint) -> None:
    """Load the model folder of a Trainer checkpoint into the live model, verified, and take it;
    check ``trainer_state.json`` and hand its content to the :class:`TrainerStateFile`.

    Raises:
        StateMismatchError: the model does not fit its saved weights (names listed).
        CorruptCheckpointError: a file is missing, malformed or fails verification.
    """
    records = checkpoint.records
    if MODEL_KEY in records:
        record = layout.ModelRecord.from_json(records[MODEL_KEY], checkpoint.url)
        for i, model in enumerate(models):
            if checkpoint.key_of(model) == MODEL_KEY:
                layout.read_model(checkpoint, unwrap_model(model), record, strict=checkpoint.options.get("strict", True))
                models.pop(i)
                break
    if STATE_KEY in checkpoint.objects and checkpoint.owner_of(STATE_KEY) == checkpoint.plugin:
        data = checkpoint.read_bytes(TRAINER_STATE_NAME)
        try:
            content = json.loads(data)
        except ValueError as exc:
            raise CorruptCheckpointError(f"{checkpoint.url}/{TRAINER_STATE_NAME}: not JSON: {exc}") from exc
        checkpoint.objects.pop(STATE_KEY).load_state_dict(content)
