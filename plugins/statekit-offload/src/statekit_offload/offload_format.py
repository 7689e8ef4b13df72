"""Accelerate's disk-offload folder format: ``index.json`` plus one raw ``<name>.dat`` per tensor.

The format ``accelerate.utils.offload`` writes and reads (``offload_weight``,
``save_offload_index``, ``OffloadedWeightsLoader``, Accelerate 1.x), reproduced so tensors
can be streamed into it (``offload_weight`` needs the whole tensor in memory). A ``.dat``
holds the tensor's little-endian bytes in C order, as ``np.memmap`` maps them; the dtype
names (bfloat16 as ``int16``, float8 as ``int8`` bit patterns, 0-dim and empty tensors):
docs/plugins/offload.md (dtypes). This module never imports accelerate.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import torch

INDEX_NAME = "index.json"
"""File name of the offload index inside an offload folder (Accelerate's name)."""

EMPTY_DAT_BYTES = 1
"""Size of the ``.dat`` file of a tensor with no elements: ``np.memmap`` cannot map an
empty file, and writes (and needs) one byte for a zero-size array."""

_NUMPY_NAMES: dict[torch.dtype, str] = {
    torch.bool: "bool",
    torch.uint8: "uint8",
    torch.int8: "int8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.float16: "float16",
    torch.float32: "float32",
    torch.float64: "float64",
    torch.complex64: "complex64",
    torch.complex128: "complex128",
}
for _name in ("uint16", "uint32", "uint64"):
    if isinstance(getattr(torch, _name, None), torch.dtype):
        _NUMPY_NAMES[getattr(torch, _name)] = _name


def offload_dtype_name(dtype: torch.dtype) -> str | None:
    """The ``"dtype"`` value Accelerate's ``offload_weight`` writes for a tensor of ``dtype``
    (``"bfloat16"``, ``"float8_e4m3fn"``, else NumPy's name); None when the format cannot
    hold it (complex32, float4)."""
    if dtype == torch.bfloat16:
        return "bfloat16"
    name = str(dtype).removeprefix("torch.")
    if name.startswith("float8_"):
        return name
    return _NUMPY_NAMES.get(dtype)


def torch_dtype_of(name: str) -> torch.dtype | None:
    """The torch dtype an index ``"dtype"`` value stands for (inverse of :func:`offload_dtype_name`).

    Returns:
        The dtype, or None for a name torch does not know.
    """
    dtype = getattr(torch, name, None)
    return dtype if isinstance(dtype, torch.dtype) else None


def dat_entry(dtype: torch.dtype, shape: tuple[int, ...] | list[int]) -> dict[str, Any]:
    """Index entry of a tensor stored as ``<name>.dat``: ``{"dtype", "shape"}``.

    Raises:
        ValueError: the dtype has no offload encoding (see :func:`offload_dtype_name`).
    """
    name = offload_dtype_name(dtype)
    if name is None:
        raise ValueError(f"dtype {dtype} cannot be stored in Accelerate's offload format")
    return {"dtype": name, "shape": [int(d) for d in shape]}


def safetensors_entry(path: str, weight_name: str, dtype: torch.dtype) -> dict[str, Any]:
    """Index entry of tensor ``weight_name`` read in place from the local safetensors file
    ``path`` (absolute), stored as ``dtype``: ``OffloadedWeightsLoader`` reads it with
    ``safetensors.safe_open(path).get_tensor(weight_name).to(dtype)``."""
    return {"safetensors_file": path, "weight_name": weight_name, "dtype": str(dtype).removeprefix("torch.")}


def dat_path(folder: str, name: str) -> str:
    """Path of the ``.dat`` file of tensor ``name`` in an offload folder (Accelerate's naming)."""
    return os.path.join(folder, f"{name}.dat")


def read_index(folder: str) -> dict[str, Any]:
    """Read ``<folder>/index.json``; an empty dict if there is none."""
    path = os.path.join(folder, INDEX_NAME)
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def write_index(folder: str, index: Mapping[str, Any]) -> None:
    """Merge ``index`` into ``<folder>/index.json``, as ``save_offload_index`` does
    (existing entries of other names are kept; entries of the same name are replaced).
    Nothing is written for an empty index."""
    if not index:
        return
    current = read_index(folder)
    current.update(index)
    path = os.path.join(folder, INDEX_NAME)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(current, f, indent=2)
    os.replace(tmp, path)
