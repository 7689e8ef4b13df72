"""Read-only access to checkpoints of several formats, for inspection and diffs (a facade).

Formats (:data:`FORMATS`, detected by :func:`detect_format`): ``statekit``, ``accelerate``,
``trainer``, ``dcp``, ``safetensors``, ``torch``; what each is, how it is recognised and
which files need ``allow_pickle``: docs/cli.md, "Formats statekit reads". Any location is an
fsspec URL; listing reads metadata only, :meth:`CheckpointReader.load_tensor` one tensor.
Modules and call sequences: docs/design-notes.md, "Call sequences through each package"
(foreign)."""

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
