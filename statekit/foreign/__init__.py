"""Read-only access to checkpoints of several formats, for inspection and diffs (a facade).

Formats (detected automatically by :func:`detect_format`):

- ``statekit``: a directory with ``statekit.json`` (the manifest); tensors are listed
  from the safetensors headers of every file in the manifest.
- ``accelerate``: a directory written by ``Accelerator.save_state`` (file names as in
  :mod:`statekit.foreign.accelerate`); ``model*.safetensors`` headers are read directly,
  the pickle files (``optimizer.bin``, ``pytorch_model.bin``...) only with ``allow_pickle``
  (without it they are listed in :attr:`CheckpointReader.skipped`). Model tensors are
  listed without the ``_orig_mod.``/``module.`` prefixes of compiled or wrapped models.
- ``dcp``: a ``torch.distributed.checkpoint`` directory (``.metadata`` + ``*.distcp``).
  ``.metadata`` is a pickle: it is read only with ``allow_pickle`` (locally through
  ``torch.distributed.checkpoint.FileSystemReader(path).read_metadata()``); tensor
  chunks are read with ranged reads at the offsets the metadata gives and assembled.
- ``safetensors``: one safetensors file (https://github.com/huggingface/safetensors#format);
  the header gives the listing, one tensor is read by seeking to its offsets.
- ``torch``: one ``torch.save`` file (``.pt``/``.bin``/``.pth``), pickle: only with
  ``allow_pickle`` (``torch.load(weights_only=True, mmap=True)`` locally, the full
  unpickler only where the restricted one refuses the file).

Any location is an fsspec URL (local path, ``memory://``, ``s3://``...). Listing reads
metadata only; :meth:`CheckpointReader.load_tensor` reads one tensor.

Submodules: :mod:`~statekit.foreign.detect` (detection, opening), :mod:`~statekit.foreign.base`
(the reader interface), :mod:`~statekit.foreign.readers` and :mod:`~statekit.foreign.dcp`
(one reader per format), :mod:`~statekit.foreign.pickles` (the pickle gate),
:mod:`~statekit.foreign.compare` (:func:`diff`), :mod:`~statekit.foreign.accelerate`
(Accelerate directories: file names, ``load``, ``convert``).

Call sequence: :func:`open_checkpoint` -> :func:`detect_format` -> the format's
:class:`CheckpointReader` (``tensors()`` lists from headers or metadata, ``load_tensor``
reads one) -> :func:`diff` compares two readers tensor by tensor. Loading an Accelerate
folder (:func:`statekit.api.loading.load_objects` falls back to it) goes through
:func:`statekit.foreign.accelerate.load`; ``statekit convert`` through
:func:`statekit.foreign.accelerate_convert.convert`, which commits through :mod:`statekit.engine.commit`.
"""

from __future__ import annotations

from statekit.foreign.base import CheckpointReader, TensorInfo
from statekit.foreign.compare import diff
from statekit.foreign.detect import FORMATS, detect_format, open_checkpoint

__all__ = [
    "FORMATS",
    "CheckpointReader",
    "TensorInfo",
    "detect_format",
    "diff",
    "open_checkpoint",
]
