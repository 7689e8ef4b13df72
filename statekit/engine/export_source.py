"""What a model to export is, read one tensor at a time: :class:`ModelSource`, and
:class:`TensorFiles`, the reader of a checkpoint's safetensors files that makes one.

The exporter (:mod:`statekit.api.export`, ``docs/export.md``) writes what a source gives; a
plugin whose models are not the core's tensor files offers its own source
(``STATEKIT_EXPORT_SOURCE``, through :mod:`statekit.plugin_api`).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, BinaryIO

import torch

from statekit.engine.context import Checkpoint
from statekit.errors import CorruptCheckpointError
from statekit.format import CHUNK_BYTES, DTYPE_FROM_CODE, NATIVE_DTYPES, read_exactly_into, read_header
from statekit.format.header import TensorEntry
from statekit.engine.references import ResolvedReference
from statekit.storage import Storage, storage_errors

__all__ = ["ExportTensor", "ModelSource", "TensorFiles"]

MAX_OPEN_FILES = 16
"""Files a :class:`TensorFiles` keeps open at once (least recently used are closed)."""


# --------------------------------------------------------------------------- what a source is


@dataclasses.dataclass(frozen=True)
class ExportTensor:
    """One stored tensor of a model to export: ``name`` (as the source reads it), ``dtype``, ``shape``."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Its data size in bytes."""
        return torch.Size(self.shape).numel() * torch.empty((), dtype=self.dtype).element_size()


@dataclasses.dataclass
class ModelSource:
    """A checkpoint's model as the exporter reads it: its tensors one at a time, the files beside them.

    Attributes:
        tensors: the stored tensors, each once (a tied weight under one name), in read order.
        read: ``read(name)`` -> that tensor, a CPU tensor made for the call (the exporter
            drops it once written; at most one is alive at a time).
        aliases: ``alias -> stored name`` of tied weights (not in ``tensors``).
        files: ``file name -> bytes`` written beside the weights (``config.json``,
            ``generation_config.json``, tokenizer files, ``adapter_config.json``).
        weights_name: the weight files' stem: ``"model"`` (transformers), ``"adapter_model"``
            (peft: always one file), ``"diffusion_pytorch_model"`` (diffusers).
        state_paths: the names are the model's state-dict paths, so the checkpoint's
            ``state_digest`` (recorded by those paths) is compared; False where they are not.
        verify: reads every source file through the checkpoint's verifying reader (size and
            XXH3-64 checksum against the manifest); None: nothing to verify.
        close: releases open files.
    """

    tensors: list[ExportTensor]
    read: Callable[[str], torch.Tensor]
    aliases: dict[str, str] = dataclasses.field(default_factory=dict)
    files: dict[str, bytes] = dataclasses.field(default_factory=dict)
    weights_name: str = "model"
    state_paths: bool = True
    verify: Callable[[], None] | None = None
    close: Callable[[], None] = lambda: None


class TensorFiles:
    """The tensors of some safetensors files of a checkpoint, read one at a time by name,
    with the frozen tensors a pretrained folder holds for the model (``reference``).

    Each file's header is parsed once; a read seeks to the tensor and fills a new buffer
    (:func:`statekit.format.read_exactly_into`), so memory holds one tensor; a referenced
    tensor is checked against its recorded checksum as it is read. :meth:`verify` reads each
    file to its end through the checkpoint's verifying reader (size and checksum against the
    manifest).

    Args:
        checkpoint: a load :class:`statekit.Checkpoint` of the committed checkpoint.
        rels: the files, relative to the checkpoint.
        reference: the model's referenced frozen tensors
            (:meth:`statekit.Checkpoint.referenced`), or None.

    Raises:
        CorruptCheckpointError: a file is missing, its header malformed, or a name is in two
            files (names them).
    """

    def __init__(self, checkpoint: Checkpoint, rels: Sequence[str], reference: ResolvedReference | None = None) -> None:
        self.checkpoint = checkpoint
        self.rels = list(rels)
        self.reference = reference
        self.where: dict[str, tuple[Storage, str, int, TensorEntry]] = {}
        self.aliases: dict[str, str] = {}
        self._open: OrderedDict[tuple[str, str], BinaryIO] = OrderedDict()
        storage = checkpoint.storage
        for rel in self.rels:
            url = storage.url_of(rel)
            f = self._file(storage, rel)
            with storage_errors(url, "reading"):
                f.seek(0)
                header = read_header(f, url, self._size(rel))
            for e in header.entries:
                if e.name in self.where or e.name in self.aliases:
                    raise CorruptCheckpointError(f"{url}: tensor {e.name!r} is also in {self.where[e.name][1]}", path=url)
                self.where[e.name] = (storage, rel, header.data_start, e)
            self.aliases.update(header.aliases)
        if reference is not None:
            folder, first_of = reference.folder, {}
            for name, src in reference.reference.tensors.items():
                if (src.file, src.name) in first_of:  # tied names: one stored tensor
                    self.aliases[name] = first_of[src.file, src.name]
                    continue
                first_of[src.file, src.name] = name
                self.where[name] = (folder.storage, src.file, folder.headers[src.file].data_start, folder.tensors[src.name].entry)

    def _size(self, rel: str) -> int | None:
        manifest = self.checkpoint.manifest
        return manifest.size_of(rel) if manifest is not None else None

    def _file(self, storage: Storage, rel: str) -> BinaryIO:
        f = self._open.get((storage.url, rel))
        if f is None:
            try:
                f = storage.open_read(rel)
            except FileNotFoundError:
                url = storage.url_of(rel)
                raise CorruptCheckpointError(f"{url}: file is missing", path=url) from None
            self._open[storage.url, rel] = f
            while len(self._open) > MAX_OPEN_FILES:
                self._open.popitem(last=False)[1].close()
        self._open.move_to_end((storage.url, rel))
        return f

    def entries(self) -> list[ExportTensor]:
        """The stored tensors (aliases left out), in file order (referenced ones last)."""
        return [ExportTensor(name, e.dtype, tuple(e.shape)) for name, (_, _, _, e) in self.where.items()]

    def read(self, name: str) -> torch.Tensor:
        """One stored tensor, in a new CPU buffer.

        Raises:
            KeyError: no such stored tensor.
            CorruptCheckpointError: the file ends inside it (names file and tensor).
            ChangedBaseError: a referenced tensor's bytes differ from the checkpoint's record.
        """
        storage, rel, data_start, e = self.where[name]
        url = storage.url_of(rel)
        buffer = torch.empty(e.stored_shape, dtype=DTYPE_FROM_CODE[e.code])
        if e.end > e.begin:
            f = self._file(storage, rel)
            with storage_errors(url, "reading"):
                f.seek(data_start + e.begin)
                read_exactly_into(f, memoryview(buffer.reshape(-1).view(torch.uint8).numpy()), url, name)
        tensor = buffer.view(e.dtype).reshape(e.shape) if e.dtype not in NATIVE_DTYPES else buffer
        if self.reference is not None and name in self.reference.reference.tensors:
            self.reference.check(name, tensor)
        return tensor

    def verify(self) -> None:
        """Read every file to its end through the checkpoint's verifying reader (a referenced
        folder's headers were checked when it was resolved; its tensors are checked as read).

        Raises:
            CorruptCheckpointError: a file's size or checksum differs from the manifest (names it).
        """
        for rel in self.rels:
            with self.checkpoint.open(rel, "rb") as f:
                while f.read(CHUNK_BYTES):
                    pass

    def close(self) -> None:
        """Close the files kept open."""
        while self._open:
            self._open.popitem()[1].close()

    def source(self, **fields: Any) -> ModelSource:
        """A :class:`ModelSource` reading these files (``fields``: its other attributes)."""
        return ModelSource(tensors=self.entries(), read=self.read, aliases=dict(self.aliases),
                           verify=self.verify, close=self.close, **fields)
