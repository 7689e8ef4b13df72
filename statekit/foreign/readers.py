"""The readers of statekit checkpoints, Accelerate directories, Trainer checkpoint folders,
safetensors files and torch files (DCP: :mod:`statekit.foreign.dcp`), reading Accelerate's
files through :mod:`statekit.foreign.accelerate` as ``load`` and ``convert`` do.
"""

from __future__ import annotations

import json
import re
from typing import Any

import torch

from statekit import format as fmt
from statekit.engine.context import ACCELERATE_WRITER, CORE
from statekit.errors import StatekitError
from statekit.foreign import accelerate, trainer
from statekit.foreign.base import CheckpointReader, TensorInfo, basename, tensor_infos
from statekit.foreign.pickles import PickleFiles, load_pickle
from statekit.storage import Storage


# An Accelerate file of one numbered object (group 1: kind, group 2: ``_<i>``, None for object 0)
_OBJECT_FILE = re.compile(r"^(model|pytorch_model|optimizer|scheduler|custom_checkpoint)(_\d+)?\.(safetensors|bin|pkl)$")
_STATEKIT_NAME = {"pytorch_model": "model", "custom_checkpoint": "custom"}


def accelerate_match_key(key: str) -> str:
    """The key, in a statekit checkpoint of the same run, of ``"file:tensor"`` of an Accelerate
    file, as ``statekit convert`` names them (``model.safetensors:w`` -> ``model_0.safetensors:w``,
    ``random_states_1.pkl:x`` -> ``accelerate_rng/rank-00001.safetensors:x``); others unchanged."""
    rel, sep, name = key.partition(":")
    if not sep:
        return key
    if rel == "scaler.pt":
        return f"scaler.safetensors:{name}"
    rng = re.match(r"^random_states_(\d+)\.pkl$", rel)
    if rng:
        return f"{fmt.rank_path(accelerate.ACCELERATE_RNG, int(rng.group(1)))}.safetensors:{name}"
    match = _OBJECT_FILE.match(rel)
    if match is None:
        return key
    kind = _STATEKIT_NAME.get(match.group(1), match.group(1))
    index = int(match.group(2)[1:]) if match.group(2) else 0
    return f"{kind}_{index}.safetensors:{name}"


class _FolderOfFilesReader(CheckpointReader):
    """A folder of safetensors files and pickles: a tensor comes from its safetensors file,
    or from its pickle (listed only with ``allow_pickle``)."""

    _pickles: Any

    def _load(self, info: TensorInfo) -> torch.Tensor:
        if info.file.endswith(".safetensors"):
            return self._safetensors_load(info.file, info.name)
        return self._pickles.tensors(info.file)[info.name]


class StatekitReader(_FolderOfFilesReader):
    """A committed statekit checkpoint (``statekit.json``); metadata is the manifest. An
    attach-mode one's Accelerate files are read as :class:`AccelerateReader` reads them.
    """

    format = "statekit"
    keyed_by_file = True

    def __init__(self, storage: Storage, allow_pickle: bool) -> None:
        super().__init__(storage, allow_pickle)
        self.manifest = fmt.read_manifest(storage)
        self.metadata = self.manifest.to_json()  # the reader's metadata is JSON, as every reader's
        self.layout = self.manifest.layout(CORE)
        files = self.manifest.files
        foreign = accelerate.accelerate_files(rel for rel, e in files.items() if e.writer == ACCELERATE_WRITER)
        self.superseded = [rel for rel in foreign if _superseded(rel, files)]
        self._accelerate = [rel for rel in foreign if rel not in self.superseded]
        self._pickles = PickleFiles(
            lambda rel: accelerate.read_pickle(storage, rel, allow_pickle, mmap=True), accelerate.is_model_file
        )
        if not allow_pickle:
            self.skipped = accelerate.pickle_files(self._accelerate)

    def files(self) -> dict[str, int]:
        """Files as listed in the manifest (plus the manifest itself is not counted)."""
        return {rel: e.size_bytes for rel, e in sorted(self.manifest.files.items())}

    def match_key(self, key: str) -> str:
        """Keys of Accelerate's files (attach mode) as :func:`accelerate_match_key` maps them."""
        return accelerate_match_key(key) if key.partition(":")[0] in self._accelerate else key

    def _list(self) -> list[TensorInfo]:
        out: list[TensorInfo] = []
        for rel in sorted(self.manifest.files):
            if rel in self._accelerate and not rel.endswith(".safetensors"):
                out += tensor_infos(self._pickles.tensors(rel), rel) if self.allow_pickle else []
            elif rel.endswith(".safetensors"):
                out += self._safetensors_infos(rel, model=rel in self._accelerate and accelerate.is_model_file(rel))
        return out


def _superseded(rel: str, files: dict) -> bool:
    """Whether an attach-mode load replaces Accelerate's file ``rel`` with statekit's own state."""
    rng = re.match(r"^random_states_(\d+)\.pkl$", rel)
    if rng:
        return f"{fmt.rank_path('rng', int(rng.group(1)))}.json" in files
    loader = re.match(r"^dl_state_dict(?:_(\d+))?\.bin$", rel)
    if loader:
        key = f"dataloader_{int(loader.group(1) or 0)}/"
        return any(other.startswith(key) for other in files)
    return False


class AccelerateReader(_FolderOfFilesReader):
    """A directory written by ``Accelerator.save_state`` (model keys without ``_orig_mod.``/``module.``)."""

    format = "accelerate"
    keyed_by_file = True

    def __init__(self, storage: Storage, allow_pickle: bool) -> None:
        super().__init__(storage, allow_pickle)
        self._names = accelerate.accelerate_files(storage.listdir())
        self._pickles = PickleFiles(
            lambda rel: accelerate.read_pickle(storage, rel, allow_pickle, mmap=True), accelerate.is_model_file
        )
        if not allow_pickle:
            self.skipped = accelerate.pickle_files(self._names)

    def match_key(self, key: str) -> str:
        """The key of the same tensor in a statekit checkpoint of the same run (:func:`accelerate_match_key`)."""
        return accelerate_match_key(key)

    def _list(self) -> list[TensorInfo]:
        out: list[TensorInfo] = []
        for rel in self._names:
            if rel.endswith(".safetensors"):
                out += self._safetensors_infos(rel, model=accelerate.is_model_file(rel))
            elif self.allow_pickle:
                out += tensor_infos(self._pickles.tensors(rel), rel)
        return out


class TrainerReader(_FolderOfFilesReader):
    """A checkpoint folder of the transformers ``Trainer`` (:mod:`statekit.foreign.trainer`):
    safetensors listed from headers, tensor pickles only with ``allow_pickle`` (else :attr:`skipped`);
    metadata is ``trainer_state.json``'s ``global_step``, ``epoch`` and ``max_steps``."""

    format = "trainer"
    keyed_by_file = True

    def __init__(self, storage: Storage, allow_pickle: bool) -> None:
        super().__init__(storage, allow_pickle)
        names = storage.listdir()
        self._safetensors = sorted(n for n in names if n.endswith(".safetensors"))
        self._pickled = trainer.tensor_pickles(names)
        self._pickles = PickleFiles(lambda rel: load_pickle(storage, rel, allow_pickle, mmap=True), trainer.is_model_file)
        if not allow_pickle:
            self.skipped = list(self._pickled)
        try:
            state = json.loads(storage.read_bytes(trainer.TRAINER_STATE))
        except (ValueError, OSError, StatekitError):
            state = None  # a damaged trainer_state.json: the files are still listed
        if isinstance(state, dict):
            self.metadata = {k: state[k] for k in ("global_step", "epoch", "max_steps") if k in state}

    def match_key(self, key: str) -> str:
        """``model.safetensors:w`` (or ``pytorch_model.bin:w``) -> ``model_0.safetensors:w``: the
        model of a statekit checkpoint of the same run (:func:`accelerate_match_key`)."""
        return accelerate_match_key(key)

    def _list(self) -> list[TensorInfo]:
        out: list[TensorInfo] = []
        for rel in self._safetensors:
            out += self._safetensors_infos(rel, model=trainer.is_model_file(rel))
        if self.allow_pickle:
            for rel in self._pickled:
                out += tensor_infos(self._pickles.tensors(rel), rel)
        return out


class SafetensorsReader(CheckpointReader):
    """One safetensors file; metadata is its ``__metadata__``."""

    format = "safetensors"

    def __init__(self, storage: Storage, allow_pickle: bool) -> None:
        super().__init__(storage, allow_pickle)
        self.metadata = dict(self.header("").metadata)

    def files(self) -> dict[str, int]:
        """The file itself."""
        return {basename(self.url): self.storage.size("")}

    def _list(self) -> list[TensorInfo]:
        return self._safetensors_infos("")

    def _load(self, info: TensorInfo) -> torch.Tensor:
        return self._safetensors_load("", info.name)


class TorchReader(CheckpointReader):
    """One ``torch.save`` file (pickle: only with ``allow_pickle``)."""

    format = "torch"

    def __init__(self, storage: Storage, allow_pickle: bool) -> None:
        super().__init__(storage, allow_pickle)
        self._pickles = PickleFiles(lambda rel: load_pickle(storage, rel, allow_pickle, mmap=True))
        self._pickles.tensors("")  # raises PickleNotAllowedError before anything else

    def files(self) -> dict[str, int]:
        """The file itself."""
        return {basename(self.url): self.storage.size("")}

    def _list(self) -> list[TensorInfo]:
        return tensor_infos(self._pickles.tensors(""), basename(self.url))

    def _load(self, info: TensorInfo) -> torch.Tensor:
        return self._pickles.tensors("")[info.name]
