"""The dtype tables of the format: torch dtype <-> safetensors dtype code, byte-view dtypes.

Dtypes safetensors knows are stored natively under their code (``"F32"``, ``"BF16"``...,
as ``safetensors.torch._TYPES``). Dtypes it does not know (complex128, the fnuz float8s...)
are stored as byte views: code ``"U8"`` with a trailing itemsize dimension, the true dtype
named in ``__metadata__["statekit.dtypes"]``.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch

NATIVE_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint64: "U64",
    torch.uint32: "U32",
    torch.uint16: "U16",
    torch.complex64: "C64",
}
"""torch dtype -> safetensors dtype code, for the dtypes stored natively."""

DTYPE_FROM_CODE: dict[str, torch.dtype] = {code: dtype for dtype, code in NATIVE_DTYPES.items()}
"""safetensors dtype code -> torch dtype (the inverse of :data:`NATIVE_DTYPES`)."""

SAFETENSORS_CODES: Mapping[torch.dtype, str] = MappingProxyType(NATIVE_DTYPES)
"""torch dtype -> safetensors dtype code, for the dtypes stored natively (read-only)."""

CODE_ITEMSIZE: dict[str, int] = {
    code: torch.empty((), dtype=dtype).element_size() for dtype, code in NATIVE_DTYPES.items()
}
"""safetensors dtype code -> bytes per element."""

BYTE_VIEW_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "complex128",
        "complex32",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
        "float4_e2m1fn_x2",
    )
    if isinstance(getattr(torch, name, None), torch.dtype)
}
"""dtype name -> torch dtype, for the dtypes stored as ``U8`` byte views (those this torch has)."""


def dtype_name(dtype: torch.dtype) -> str:
    """The dtype's name without the ``torch.`` prefix (``"float32"``), as listings and metadata use it.

    Args:
        dtype: a torch dtype.

    Returns:
        Its name.
    """
    return str(dtype).removeprefix("torch.")
