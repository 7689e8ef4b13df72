"""Checkpoint folders of the transformers ``Trainer`` (``checkpoint-<step>/``): their file names,
as ``Trainer._save_checkpoint`` (transformers 4.x/5.x) writes them; recognised by layout, never
by importing transformers (docs/cli.md, "Formats statekit reads")."""

from __future__ import annotations

import re
from collections.abc import Iterable

TRAINER_STATE = "trainer_state.json"
"""The file every Trainer checkpoint holds (``transformers.trainer.TRAINER_STATE_NAME``)."""

_MODEL_FILE = re.compile(r"^(model|pytorch_model|adapter_model)(-\d+-of-\d+)?\.(safetensors|bin)$")
_STATE_FILE = re.compile(r"^(optimizer\.(pt|bin)|scheduler\.pt|scaler\.pt|rng_state(_\d+)?\.pth|training_args\.bin)$")
_STATEKIT_NAMES = frozenset({"training_args.json", "optimizer.json", "optimizer.safetensors", "scheduler.json", "rng"})
"""Names statekit (and statekit-transformers) write in a Trainer-layout checkpoint and Trainer
never does: Trainer pickles the same state (``training_args.bin``, ``optimizer.pt``...)."""
_TENSOR_PICKLES = re.compile(r"^(pytorch_model(-\d+-of-\d+)?\.bin|adapter_model\.bin|optimizer\.(pt|bin)|scaler\.pt)$")


def is_model_file(name: str) -> bool:
    """True for a model weights file (``model.safetensors``, a shard ``model-00001-of-00002.safetensors``,
    ``pytorch_model.bin``, ``adapter_model.safetensors``)."""
    return bool(_MODEL_FILE.match(name))


def is_trainer_checkpoint(names: Iterable[str]) -> bool:
    """True if a folder's names are a Trainer checkpoint's: ``trainer_state.json`` beside model
    weights or training state, and none of the names statekit writes instead of Trainer's pickles
    (``training_args.json``, ``optimizer.safetensors``, ``rng/``...). By name only."""
    names = list(names)
    if any(n in _STATEKIT_NAMES for n in names):  # a statekit checkpoint that lost its manifest is not Trainer's
        return False
    return TRAINER_STATE in names and any(is_model_file(n) or _STATE_FILE.match(n) for n in names)


def tensor_pickles(names: Iterable[str]) -> list[str]:
    """The pickles among ``names`` that hold tensors (``pytorch_model.bin``, ``optimizer.pt``,
    ``scaler.pt``), sorted; the others (``training_args.bin``, ``scheduler.pt``, ``rng_state.pth``)
    are never unpickled for inspection."""
    return sorted(n for n in names if _TENSOR_PICKLES.match(n))
