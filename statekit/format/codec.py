"""State tree <-> (flat tensor mapping for safetensors, JSON skeleton). No pickle, ever.

``encode`` walks a nested state (an optimizer or scheduler ``state_dict()``, RNG states,
a data loader position...) and returns a JSON-able *skeleton* in which every tensor and
NumPy array is replaced by a reference to an entry of a flat ``{name: torch.Tensor}``
mapping, which the format layer writes to a safetensors file. ``decode`` reverses it.

Representation (plain JSON where JSON is exact, a one-key tagged object elsewhere):

==========================  ======================================================
value                       skeleton
==========================  ======================================================
None, bool, int, str        itself
float (finite)              itself (``-0.0`` kept)
float inf / -inf / nan      ``{"__float__": "inf" | "-inf" | "nan"}``
list                        list
tuple / torch.Size          ``{"__tuple__": [...]}`` / ``{"__size__": [...]}``
set / frozenset             ``{"__set__": [...]}`` / ``{"__frozenset__": [...]}``
dict, str keys, no tag key  object (insertion order kept)
any other dict              ``{"__dict__": [[key, value], ...]}`` (int, float, tuple... keys)
torch.Tensor                ``{"__tensor__": name}``
numpy.ndarray               ``{"__ndarray__": name}`` (stored as a tensor)
numpy scalar                ``{"__npscalar__": name}`` (a 0-dim array)
torch.dtype                 ``{"__dtype__": "float32"}``
bytes                       ``{"__bytes__": base64}``
==========================  ======================================================

Anything else raises :class:`statekit.UnsupportedValueError` naming its key path.
"""

from __future__ import annotations

import base64
import math
import sys
from collections.abc import Mapping
from typing import Any

import torch

from statekit.errors import CorruptCheckpointError, UnsupportedValueError

_TAGS = frozenset(
    {
        "__float__",
        "__tuple__",
        "__size__",
        "__set__",
        "__frozenset__",
        "__dict__",
        "__tensor__",
        "__ndarray__",
        "__npscalar__",
        "__dtype__",
        "__bytes__",
    }
)


def encode(state: Any, prefix: str = "") -> tuple[Any, dict[str, torch.Tensor]]:
    """Split ``state`` into a JSON-able skeleton and a flat tensor mapping.

    Args:
        state: a nested structure of the types in the module table.
        prefix: prepended to tensor names (``"state.0.exp_avg"``), for readable files.

    Returns:
        ``(skeleton, tensors)``: ``skeleton`` is ``json.dumps``-able with
        ``allow_nan=False``; ``tensors`` maps unique names to the original tensors (not
        copies). A tensor that appears twice (same object) is stored once.

    Raises:
        UnsupportedValueError: a value has no representation; the message gives its key
            path (``state['opt']['param_groups'][0]['fn']``).
    """
    encoder = _Encoder()
    skeleton = encoder.encode(state, prefix, "state")
    return skeleton, encoder.tensors


def decode(skeleton: Any, tensors: Mapping[str, torch.Tensor], source: str = "<memory>") -> Any:
    """Rebuild the state ``encode`` split.

    Args:
        skeleton: the JSON skeleton.
        tensors: the tensors it references, by name.
        source: the file the skeleton came from, for error messages.

    Returns:
        The state, with tuples, int keys, NumPy arrays and scalars restored.

    Raises:
        CorruptCheckpointError: the skeleton is malformed or references a missing tensor.
    """
    return _decode(skeleton, tensors, source, "state")


class _Encoder:
    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._names_by_id: dict[int, str] = {}

    def _name(self, path: str) -> str:
        name = path or "tensor"
        i = 1
        while name in self.tensors:
            name = f"{path}#{i}"
            i += 1
        return name

    def _tensor(self, t: torch.Tensor, path: str) -> str:
        existing = self._names_by_id.get(id(t))
        if existing is not None:
            return existing
        name = self._name(path)
        self.tensors[name] = t
        self._names_by_id[id(t)] = name
        return name

    def encode(self, v: Any, path: str, where: str) -> Any:
        if v is None or isinstance(v, (bool, str)):
            return v
        if isinstance(v, int):
            return int(v)
        if isinstance(v, float) and not _is_numpy(v):
            if math.isfinite(v):
                return float(v)
            return {"__float__": "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")}
        if isinstance(v, torch.Tensor):
            if _is_dtensor(v):
                raise UnsupportedValueError(
                    f"{where} is a DTensor (a shard of a distributed tensor); install and enable "
                    "statekit-fsdp to save sharded models, the core path never writes a shard as a whole tensor"
                )
            return {"__tensor__": self._tensor(v, path)}
        if isinstance(v, torch.Size):
            return {"__size__": [int(x) for x in v]}
        if isinstance(v, tuple):
            return {"__tuple__": [self.encode(x, _join(path, i), f"{where}[{i}]") for i, x in enumerate(v)]}
        if isinstance(v, list):
            return [self.encode(x, _join(path, i), f"{where}[{i}]") for i, x in enumerate(v)]
        if isinstance(v, Mapping):
            return self._mapping(v, path, where)
        if isinstance(v, (set, frozenset)):
            tag = "__frozenset__" if isinstance(v, frozenset) else "__set__"
            return {tag: [self.encode(x, _join(path, i), f"{where}{{{i}}}") for i, x in enumerate(v)]}
        if isinstance(v, torch.dtype):
            return {"__dtype__": str(v).removeprefix("torch.")}
        if isinstance(v, (bytes, bytearray)):
            return {"__bytes__": base64.b64encode(bytes(v)).decode("ascii")}
        np = sys.modules.get("numpy")
        if np is not None:
            if isinstance(v, np.ndarray):
                return {"__ndarray__": self._tensor(_ndarray_to_tensor(v, where), path)}
            if isinstance(v, np.generic):
                return {"__npscalar__": self._tensor(_ndarray_to_tensor(np.asarray(v), where), path)}
        raise UnsupportedValueError(
            f"cannot store {where} without pickle: value of type {type(v).__module__}.{type(v).__qualname__}; "
            "store tensors, numbers, strings, lists, tuples, dicts or NumPy arrays"
        )

    def _mapping(self, m: Mapping[Any, Any], path: str, where: str) -> Any:
        if all(isinstance(k, str) for k in m) and not any(k in _TAGS for k in m):
            return {k: self.encode(v, _join(path, k), f"{where}[{k!r}]") for k, v in m.items()}
        pairs = []
        for k, v in m.items():
            key = self.encode(k, _join(path, "key"), f"{where}.keys()")
            pairs.append([key, self.encode(v, _join(path, k), f"{where}[{k!r}]")])
        return {"__dict__": pairs}


def _is_numpy(v: Any) -> bool:
    np = sys.modules.get("numpy")
    return np is not None and isinstance(v, np.generic)


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor"


def _join(path: str, part: Any) -> str:
    return f"{path}.{part}" if path else str(part)


def _ndarray_to_tensor(a: Any, where: str) -> torch.Tensor:
    if not a.dtype.isnative:  # big-endian arrays: torch needs native byte order
        a = a.astype(a.dtype.newbyteorder("="))
    try:
        return torch.from_numpy(a.copy() if not a.flags.c_contiguous else a)
    except (TypeError, ValueError) as exc:
        raise UnsupportedValueError(f"cannot store {where}: NumPy dtype {a.dtype} has no torch equivalent") from exc


def _decode(v: Any, tensors: Mapping[str, torch.Tensor], source: str, where: str) -> Any:
    if isinstance(v, list):
        return [_decode(x, tensors, source, f"{where}[{i}]") for i, x in enumerate(v)]
    if not isinstance(v, dict):
        return v
    if len(v) == 1:
        ((tag, payload),) = v.items()
        if tag in _TAGS:
            try:
                return _decode_tagged(tag, payload, tensors, source, where)
            except (KeyError, TypeError, ValueError) as exc:
                raise CorruptCheckpointError(
                    f"{source}: malformed value at {where} ({tag}): {type(exc).__name__}: {exc}", path=source
                ) from exc
    return {k: _decode(x, tensors, source, f"{where}[{k!r}]") for k, x in v.items()}


def _decode_tagged(tag: str, payload: Any, tensors: Mapping[str, torch.Tensor], source: str, where: str) -> Any:
    if tag == "__tensor__":
        return _lookup(tensors, payload, source, where)
    if tag in ("__ndarray__", "__npscalar__"):
        array = _lookup(tensors, payload, source, where).numpy()
        return array[()] if tag == "__npscalar__" else array
    if tag == "__float__":
        return {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}[payload]
    if tag == "__dict__":
        return {
            _hashable(_decode(k, tensors, source, f"{where}.keys()")): _decode(x, tensors, source, f"{where}[{k!r}]")
            for k, x in payload
        }
    if tag == "__dtype__":
        dtype = getattr(torch, payload, None) if isinstance(payload, str) else None
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{payload!r} is not a torch dtype")
        return dtype
    if tag == "__bytes__":
        return base64.b64decode(payload, validate=True)
    items = [_decode(x, tensors, source, f"{where}[{i}]") for i, x in enumerate(payload)]
    if tag == "__tuple__":
        return tuple(items)
    if tag == "__size__":
        return torch.Size(items)
    if tag == "__set__":
        return set(items)
    return frozenset(items)


def _lookup(tensors: Mapping[str, torch.Tensor], name: Any, source: str, where: str) -> torch.Tensor:
    if not isinstance(name, str) or name not in tensors:
        raise CorruptCheckpointError(f"{source}: {where} references tensor {name!r}, which is not stored", path=source)
    return tensors[name]


def _hashable(k: Any) -> Any:
    if isinstance(k, list):
        raise TypeError("a list cannot be a dict key")
    return k
