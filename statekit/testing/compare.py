"""State comparison for tests: :func:`assert_state_equal`, stricter than ``==``.

torch and NumPy are never imported here: values are recognised through ``sys.modules``
(a tensor cannot exist unless torch is loaded), so ``import statekit.testing`` stays light.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from typing import Any

__all__ = ["assert_state_equal"]


def assert_state_equal(a: Any, b: Any, path: str = "state") -> None:
    """Assert that two nested states are exactly equal, naming the first difference.

    Rules (stricter than ``==``):

    * tensors: both ``torch.Tensor``, same dtype, same shape and identical bytes
      (so NaN equals NaN with the same bits, ``-0.0`` differs from ``0.0``; bool tensors
      compare by value; compared on the CPU, device and ``requires_grad`` are ignored);
    * NumPy arrays and scalars: same type, dtype, shape and bytes;
    * floats: equal, or both NaN; the sign of zero must match;
    * mappings: same keys in the same order with the same key types (``1`` vs ``"1"``
      vs ``True`` differ); any two mappings compare by items (a ``dict`` equals an
      ``OrderedDict`` or a lazy state dict with the same items in the same order);
    * lists, tuples, ``torch.Size``, sets, frozensets: the exact type must match;
    * everything else: the exact type must match and ``==`` must hold.

    Args:
        a: the expected state.
        b: the actual state.
        path: the name of the root in messages (``state['optim'][0]``).

    Raises:
        AssertionError: the states differ; the message gives the key path of the first
            difference and both values.
    """
    __tracebackhide__ = True
    problem = _first_difference(a, b, path)
    if problem is not None:
        raise AssertionError(problem)


def _short(v: Any, limit: int = 200) -> str:
    text = repr(v)
    return text if len(text) <= limit else text[:limit] + "..."


def _type_name(v: Any) -> str:
    t = type(v)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _first_difference(a: Any, b: Any, path: str) -> str | None:
    torch = sys.modules.get("torch")
    np = sys.modules.get("numpy")
    if torch is not None and (isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor)):
        return _tensor_difference(torch, a, b, path)
    if np is not None and (isinstance(a, (np.ndarray, np.generic)) or isinstance(b, (np.ndarray, np.generic))):
        return _numpy_difference(np, a, b, path)
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return _mapping_difference(a, b, path)
    if type(a) is not type(b):
        return f"{path}: type {_type_name(a)} != {_type_name(b)} ({_short(a)} vs {_short(b)})"
    if isinstance(a, float):
        return _float_difference(a, b, path)
    if isinstance(a, (list, tuple)):  # includes torch.Size (same type checked above)
        return _sequence_difference(a, b, path)
    if isinstance(a, (set, frozenset)):
        if a != b:
            return f"{path}: {_type_name(a)} differs: only in first {_short(a - b)}, only in second {_short(b - a)}"
        return None
    try:
        equal = bool(a == b)
    except Exception as exc:  # an object whose == raises
        return f"{path}: cannot compare {_short(a)} and {_short(b)}: {type(exc).__name__}: {exc}"
    return None if equal else f"{path}: {_short(a)} != {_short(b)}"


def _float_difference(a: float, b: float, path: str) -> str | None:
    if math.isnan(a) and math.isnan(b):
        return None
    if a != b or math.copysign(1.0, a) != math.copysign(1.0, b):
        return f"{path}: {a!r} != {b!r}"
    return None


def _sequence_difference(a: list[Any] | tuple[Any, ...], b: Any, path: str) -> str | None:
    if len(a) != len(b):
        return f"{path}: length {len(a)} != {len(b)} ({_short(a)} vs {_short(b)})"
    for i, (x, y) in enumerate(zip(a, b)):
        problem = _first_difference(x, y, f"{path}[{i}]")
        if problem is not None:
            return problem
    return None


def _mapping_difference(a: Mapping[Any, Any], b: Mapping[Any, Any], path: str) -> str | None:
    keys_a, keys_b = list(a), list(b)
    typed_a = [(type(k), k) for k in keys_a]
    typed_b = [(type(k), k) for k in keys_b]
    if typed_a != typed_b:
        only_a = [k for k in keys_a if (type(k), k) not in typed_b]
        only_b = [k for k in keys_b if (type(k), k) not in typed_a]
        if only_a or only_b:
            return f"{path}: keys differ: only in first {_short(only_a)}, only in second {_short(only_b)}"
        for x, y in zip(keys_a, keys_b):
            if type(x) is not type(y) or x != y:
                break
        return f"{path}: key order differs: {_short(keys_a)} vs {_short(keys_b)}"
    for k in keys_a:
        problem = _first_difference(a[k], b[k], f"{path}[{k!r}]")
        if problem is not None:
            return problem
    return None


def _tensor_difference(torch: Any, a: Any, b: Any, path: str) -> str | None:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return f"{path}: type {_type_name(a)} != {_type_name(b)}"
    if a.dtype != b.dtype:
        return f"{path}: dtype {a.dtype} != {b.dtype}"
    if tuple(a.shape) != tuple(b.shape):
        return f"{path}: shape {list(a.shape)} != {list(b.shape)} ({a.dtype})"
    if a.device.type == "meta" or b.device.type == "meta":
        return None if a.device.type == b.device.type else f"{path}: device {a.device} != {b.device}"
    if a.dtype == torch.bool:  # compare values: a bool's byte may be any non-zero value
        if torch.equal(_flat(torch, a), _flat(torch, b)):
            return None
        ba, bb = _flat(torch, a), _flat(torch, b)
    else:
        ba, bb = _tensor_bytes(torch, a), _tensor_bytes(torch, b)
        if torch.equal(ba, bb):
            return None
    first = int(torch.nonzero(ba != bb)[0, 0]) // max(1, a.element_size())
    flat_a, flat_b = _flat(torch, a), _flat(torch, b)
    try:
        detail = f"first difference at flat index {first}: {flat_a[first].item()!r} vs {flat_b[first].item()!r}"
    except (RuntimeError, TypeError):  # dtypes without .item() (fp4, some fp8)
        detail = f"first difference at flat index {first}"
    return f"{path}: tensors differ ({a.dtype}, shape {list(a.shape)}); {detail}"


def _flat(torch: Any, t: Any) -> Any:
    return t.detach().to("cpu").resolve_conj().resolve_neg().contiguous().reshape(-1)


def _tensor_bytes(torch: Any, t: Any) -> Any:
    flat = _flat(torch, t)
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    return flat.view(torch.uint8)


def _numpy_difference(np: Any, a: Any, b: Any, path: str) -> str | None:
    if type(a) is not type(b):
        return f"{path}: type {_type_name(a)} != {_type_name(b)} ({_short(a)} vs {_short(b)})"
    if a.dtype != b.dtype:
        return f"{path}: NumPy dtype {a.dtype} != {b.dtype}"
    if a.shape != b.shape:
        return f"{path}: NumPy shape {list(a.shape)} != {list(b.shape)}"
    if a.dtype.hasobject:
        return None if np.array_equal(a, b) else f"{path}: object arrays differ"
    if np.ascontiguousarray(a).tobytes() != np.ascontiguousarray(b).tobytes():
        return f"{path}: NumPy values differ ({a.dtype}, shape {list(a.shape)}): {_short(a)} vs {_short(b)}"
    return None
