"""Read-only access to checkpoints of several formats, for inspection and diffs (a facade).

Formats (detected automatically by :func:`detect_format`):

- ``statekit``: a directory with ``statekit.json`` (the manifest); tensors are listed
  from the safetensors headers of every file in the manifest.
- ``accelerate``: a directory written by ``Accelerator.save_state`` (file names as in
  :mod:`statekit.foreign.accelerate`); ``model*.safetensors`` headers are read directly,
  the pickle files (``optimizer.bin``, ``pytorch_model.bin``...) only with ``allow_pickle``
  (without it they are listed in :attr:`CheckpointReader.skipped`). Model tensors are
  listed without the ``_orig_mod.``/``module.`` prefixes of compiled or wrapped models.
- ``trainer``: a ``checkpoint-<step>/`` folder of transformers' ``Trainer`` (recognised
  by ``trainer_state.json``, file names as in :mod:`statekit.foreign.trainer`); its
  safetensors headers are read directly, the pickles holding tensors only with
  ``allow_pickle``.
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

Modules:

- :mod:`~statekit.foreign.detect`: format detection (:func:`detect_format`), opening
  (:func:`open_checkpoint`), what a folder under a root is (``folder_kind``), ``survey``.
- :mod:`~statekit.foreign.base`: the reader interface (:class:`CheckpointReader`, :class:`TensorInfo`).
- :mod:`~statekit.foreign.readers`: the readers of statekit, Accelerate, Trainer,
  safetensors and torch checkpoints.
- :mod:`~statekit.foreign.dcp`: the reader of ``torch.distributed.checkpoint`` directories.
- :mod:`~statekit.foreign.pickles`: the one ``allow_pickle`` gate and unpickler.
- :mod:`~statekit.foreign.compare`: tensor-by-tensor comparison (:func:`diff`).
- :mod:`~statekit.foreign.accelerate`: Accelerate directories: file names, ``load``.
- :mod:`~statekit.foreign.accelerate_convert`: ``statekit convert`` of an Accelerate directory.
- :mod:`~statekit.foreign.accelerate_rng`: Accelerate's random states: restore, snapshot.
- :mod:`~statekit.foreign.trainer`: transformers ``Trainer`` checkpoint folders: their file names.

Call sequences: docs/design-notes.md, "Call sequences through each package" (foreign).
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
