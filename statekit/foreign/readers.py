"""The readers of statekit checkpoints, Accelerate directories, safetensors files and torch files.

The DCP reader is :mod:`statekit.foreign.dcp`. Accelerate file names and the pickle gate
come from :mod:`statekit.foreign.accelerate`, so inspection and ``load``/``convert`` read
the same files the same way.
"""

from __future__ import annotations

import re

import torch

from statekit import format as fmt
from statekit.foreign import accelerate
from statekit.foreign.base import CheckpointReader, TensorInfo, basename, tensor_infos
from statekit.foreign.pickles import PickleFiles, load_pickle
from statekit.storage import Storage


# An Accelerate file of one numbered object (group 1: kind, group 2: ``_<i>``, None for object 0)
_OBJECT_FILE = re.compile(r"^(model|pytorch_model|optimizer|scheduler)(_\d+)?\.(safetensors|bin)$")


class StatekitReader(CheckpointReader):
    """A committed statekit checkpoint (``statekit.json``); metadata is the manifest."""

    format = "statekit"
    keyed_by_file = True

    def __init__(self, storage: Storage, allow_pickle: bool) -> None:
        super().__init__(storage, allow_pickle)
        self.manifest = fmt.read_manifest(storage)
        self.metadata = self.manifest

    def files(self) -> dict[str, int]:
        """Files as listed in the manifest (plus the manifest itself is not counted)."""
        return {rel: e["size_bytes"] for rel, e in sorted(self.manifest["files"].items())}

    def _list(self) -> list[TensorInfo]:
        out: list[TensorInfo] = []
        for rel in sorted(self.manifest["files"]):
            if rel.endswith(".safetensors"):
                out += self._safetensors_infos(rel)
        return out

    def _load(self, info: TensorInfo) -> torch.Tensor:
        return self._safetensors_load(info.file, info.name)


class AccelerateReader(CheckpointReader):
    """A directory written by ``Accelerator.save_state``.

    Model files are listed without the ``_orig_mod.``/``module.`` prefixes Accelerate
    keeps for compiled or wrapped models (as ``load`` and ``convert`` read them).
    """

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
        """``model.safetensors:w`` -> ``model_0.safetensors:w``, ``optimizer_1.bin:state.0.step`` ->
        ``optimizer_1.safetensors:state.0.step``: the file names of a statekit checkpoint of the
        same Accelerate run (``statekit.save_state``, ``CheckpointManager``, ``statekit convert``)."""
        rel, sep, name = key.partition(":")
        match = _OBJECT_FILE.match(rel)
        if not sep or match is None:
            return key
        kind = "model" if match.group(1) == "pytorch_model" else match.group(1)
        index = int(match.group(2)[1:]) if match.group(2) else 0
        return f"{kind}_{index}.safetensors:{name}"

    def _list(self) -> list[TensorInfo]:
        out: list[TensorInfo] = []
        for rel in self._names:
            if rel.endswith(".safetensors"):
                out += self._safetensors_infos(rel, model=accelerate.is_model_file(rel))
            elif self.allow_pickle:
                out += tensor_infos(self._pickles.tensors(rel), rel)
        return out

    def _load(self, info: TensorInfo) -> torch.Tensor:
        if info.file.endswith(".safetensors"):
            return self._safetensors_load(info.file, info.name)
        return self._pickles.tensors(info.file)[info.name]


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
