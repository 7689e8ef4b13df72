"""The codec's type rules: key paths, class names, tensor and NumPy checks, refusals. Two rules:
no narrowing (a subclass of a stored type that is not itself handled is refused at save,
never loaded as its base type), and no imports while loading (an ``Enum`` or ``namedtuple``
class is stored as ``"module:qualname"`` and found through ``sys.modules`` and ``__dict__``
only; a class not found so at save is refused). docs/format.md, "Everything else: JSON
through the codec".
"""

from __future__ import annotations

import base64
import dataclasses
import importlib
import math
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch

from statekit.errors import UnsupportedDtypeError, UnsupportedValueError
from statekit.format.dtypes import BYTE_VIEW_DTYPES, NATIVE_DTYPES

PLAIN_INT_BITS = 2000
"""Ints up to this many bits (about 602 digits, below the smallest ``sys.set_int_max_str_digits``,
640) are JSON numbers; larger ones are hex strings, which have no such limit (``docs/format.md``)."""

DEFAULT_FACTORIES: dict[str, Any] = {
    "None": None,
    **{t.__name__: t for t in (list, dict, set, frozenset, tuple, int, float, complex, str, bytes, bool)},
}
"""``defaultdict.default_factory`` values that round-trip (by name): None and builtin types."""

FACTORY_NAMES: dict[Any, str] = {factory: name for name, factory in DEFAULT_FACTORIES.items()}
"""The inverse of :data:`DEFAULT_FACTORIES`."""

STORABLE_DTYPES: frozenset[torch.dtype] = frozenset(NATIVE_DTYPES) | frozenset(BYTE_VIEW_DTYPES.values())
"""Tensor dtypes the format stores (natively or as byte views); :func:`check_tensor` refuses the rest."""

Parts = tuple[tuple[str, Any], ...]
"""A value's position: ``("item", key)`` for a subscript (dict key, list index),
``("key", None)`` for a dict's keys, ``("member", i)`` for a set item, ``("attr", name)``
for an attribute (an Enum's ``value``)."""


def key_path(root: str, parts: Parts) -> str:
    """The slash-separated key path of a value (``"custom_0/config/mode"``).

    Args:
        root: the file's base (``"custom_0"``, ``"dataloader_0/rank-00000"``), or ``""``.
        parts: the value's position inside the state (see :data:`Parts`).

    Returns:
        The path; ``root`` alone (or ``"<state>"``) for the state itself.
    """
    names = [str(p) if kind in ("item", "attr") else ("<key>" if kind == "key" else f"<item {p}>") for kind, p in parts]
    return "/".join([root, *names] if root else names) or "<state>"


def subscript(parts: Parts) -> str:
    """The Python expression of a value's position (``"state['config']['mode']"``)."""
    text = "state"
    for kind, p in parts:
        text += f"[{p!r}]" if kind == "item" else (".keys()" if kind == "key" else (f".{p}" if kind == "attr" else f"{{{p}}}"))
    return text


def describe(root: str, parts: Parts) -> str:
    """Both forms, for messages: ``"custom_0/config/mode (state['config']['mode'])"``."""
    return f"{key_path(root, parts)} ({subscript(parts)})"


def type_name(cls: type) -> str:
    """``module.qualname`` of a type (``"collections.OrderedDict"``, ``"builtins.int"``)."""
    return f"{cls.__module__}.{cls.__qualname__}"


def class_name(cls: type) -> str | None:
    """The name under which the codec stores ``cls`` (``"pkg.mod:Outer.Mode"``), or None.

    Args:
        cls: an ``Enum`` or ``namedtuple`` class.

    Returns:
        ``"module:qualname"`` when :func:`resolve_class` finds ``cls`` itself under it; None
        for a class defined inside a function, or shadowed.
    """
    module, qualname = getattr(cls, "__module__", None), getattr(cls, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or "<locals>" in qualname:
        return None
    name = f"{module}:{qualname}"
    return name if resolve_class(name) is cls else None


def resolve_class(name: str) -> Any:
    """Find a class by its stored name without importing anything (``sys.modules``, then each
    part of the qualname in the previous one's ``__dict__``: no ``__getattr__`` runs).

    Args:
        name: ``"module:qualname"`` as written by :func:`class_name`.

    Returns:
        The object found, or None when a step is missing.

    Raises:
        ValueError: ``name`` is not of the form ``module:qualname``.
    """
    module, sep, qualname = name.partition(":")
    if not sep or not module or not qualname:
        raise ValueError(f"{name!r} is not a 'module:qualname' class name")
    obj: Any = sys.modules.get(module)
    for part in qualname.split("."):
        namespace = getattr(obj, "__dict__", None) if obj is not None else None
        if not isinstance(namespace, Mapping):
            return None
        obj = namespace.get(part)
    return obj


def is_namedtuple_class(cls: Any) -> bool:
    """True for classes made by ``collections.namedtuple`` / ``typing.NamedTuple`` (and their subclasses)."""
    return (
        isinstance(cls, type)
        and issubclass(cls, tuple)
        and isinstance(getattr(cls, "_fields", None), tuple)
        and callable(getattr(cls, "_make", None))
    )


def check_nameable(v: Any, what: str, where: str) -> str:
    """The stored class name of an Enum member or namedtuple, or the save-time refusal.

    Args:
        v: the value.
        what: ``"Enum"`` or ``"namedtuple"``, for the message.
        where: the value's position (:func:`describe`).

    Returns:
        ``"module:qualname"`` of ``type(v)``.

    Raises:
        UnsupportedValueError: the class cannot be found without importing, an Enum member is
            not what its class returns for its value, or a namedtuple carries extra attributes.
    """
    cls = type(v)
    name = class_name(cls)
    if name is None:
        local = "<locals>" in getattr(cls, "__qualname__", "")
        why = "it is defined inside a function" if local else f"{cls.__module__!r} does not hold it under {cls.__qualname__!r}"
        raise UnsupportedValueError(
            f"cannot store {where}: value of {what} type {type_name(cls)}, and {why}, so a loading process "
            f"could not find the class without importing code; define the class at module level, or store "
            f"{'value.value' if what == 'Enum' else 'tuple(value)'}"
        )
    if what == "Enum" and _lookup_member(cls, v) is not v:
        raise UnsupportedValueError(
            f"cannot store {where}: Enum member {v!r} of type {type_name(cls)} is not what {cls.__qualname__}(value) "
            "returns for its value, so it could not be restored by value; store value.name or value.value"
        )
    if what == "namedtuple" and getattr(v, "__dict__", None):
        raise UnsupportedValueError(
            f"cannot store {where}: namedtuple of type {type_name(cls)} carries instance attributes "
            f"{sorted(vars(v))}, which would be lost; store them separately"
        )
    return name


def _lookup_member(cls: type, v: Any) -> Any:
    try:
        return cls(v.value)
    except Exception:  # noqa: BLE001 - any failure of the class's own lookup means "cannot restore"
        return None


def check_tensor(t: torch.Tensor, where: str) -> None:
    """Refuse, at save time, a tensor the format cannot store with its exact type and dtype.

    Args:
        t: a ``torch.Tensor`` (any subclass).
        where: its position (:func:`describe`).

    Raises:
        UnsupportedValueError: a tensor subclass other than ``nn.Parameter`` (a DTensor:
            install statekit-fsdp).
        UnsupportedDtypeError: a sparse, nested or meta tensor, or a dtype with neither a
            safetensors code nor a byte view (quantized, sub-byte ``int1``..``uint7``, ``bits*``).
    """
    cls = type(t)
    if cls.__name__ == "DTensor":
        raise UnsupportedValueError(
            f"{where} is a DTensor (a shard of a distributed tensor); install and enable "
            "statekit-fsdp to save sharded models, the core path never writes a shard as a whole tensor"
        )
    if cls is not torch.Tensor and cls is not torch.nn.Parameter:
        raise UnsupportedValueError(
            f"cannot store {where}: tensor subclass {type_name(cls)} would load as a plain torch.Tensor; "
            "store value.as_subclass(torch.Tensor) (or, for a wrapper subclass, the plain tensors it holds)"
        )
    if t.is_nested or t.layout != torch.strided:
        raise UnsupportedDtypeError(
            f"cannot store {where}: tensor of type {type_name(cls)} with layout {t.layout}"
            f"{' (nested)' if t.is_nested else ''}; only dense (strided) tensors are stored, e.g. value.to_dense()"
        )
    if t.device.type == "meta":
        raise UnsupportedDtypeError(f"cannot store {where}: tensor of type {type_name(cls)} is on the meta device and has no data")
    if t.dtype not in STORABLE_DTYPES:
        raise UnsupportedDtypeError(
            f"cannot store {where}: tensor of type {type_name(cls)} has dtype {t.dtype}, which safetensors cannot hold "
            "and statekit has no byte view for (quantized and sub-byte dtypes); dequantize or convert it"
        )


def ndarray_to_tensor(a: Any, where: str, what: str) -> tuple[torch.Tensor, str | None]:
    """A NumPy array as a tensor to store, and its byte order when not native.

    Args:
        a: a ``numpy.ndarray`` (exact type).
        where: its position (:func:`describe`).
        what: the value's type name for messages (``"numpy.ndarray"``, ``"numpy.str_"``).

    Returns:
        ``(tensor, dtype_str)``: the tensor (sharing memory where NumPy allows; a non-native
        array converted to native order) and ``a.dtype.str`` (``">i4"``) when not native, else None.

    Raises:
        UnsupportedValueError: a structured or object dtype, or one torch has no dtype for
            (strings, datetimes, ``longdouble``); names the dtype.
    """
    dtype = a.dtype
    if dtype.fields is not None or dtype.hasobject:
        kind = "object" if dtype.hasobject and dtype.fields is None else "structured"
        raise UnsupportedValueError(
            f"cannot store {where}: {what} of {kind} dtype {dtype}; statekit stores numeric NumPy values only (no pickle)"
        )
    order = None
    if not dtype.isnative:
        order = dtype.str
        a = a.astype(dtype.newbyteorder("="))
    try:
        return torch.from_numpy(a if a.flags.c_contiguous else a.copy()), order
    except (TypeError, ValueError) as exc:
        raise UnsupportedValueError(
            f"cannot store {where}: value of type {what} has NumPy dtype {dtype}, which has no torch equivalent"
        ) from exc


def refusal(v: Any, where: str) -> UnsupportedValueError:
    """The save-time :class:`UnsupportedValueError` for a value the codec does not store, naming
    the position (``where``), the type of ``v`` and what to store instead.

    Args:
        v: the value.
        where: its position (:func:`describe`).

    Returns:
        The error, to raise.
    """
    cls = type(v)
    base = next((b for b in _NARROWABLE if isinstance(v, b)), None)
    if dataclasses.is_dataclass(v):
        hint = "a dataclass instance; store dataclasses.asdict(value) and rebuild it after loading"
    elif base is not None:
        hint = (
            f"a subclass of {base.__name__}, which would load as a plain {base.__name__}; statekit does not narrow "
            f"types: store {base.__name__}(value) (or a type from the table in docs/format.md)"
        )
    elif isinstance(v, Mapping):
        hint = "a Mapping that is not a dict, which would load as a dict: store dict(value)"
    else:
        hint = "store tensors, numbers, strings, bytes, lists, tuples, dicts, sets, Enums or NumPy arrays"
    return UnsupportedValueError(f"cannot store {where} without pickle: value of type {type_name(cls)}; {hint}")


_NARROWABLE: tuple[type, ...] = (bool, int, float, complex, str, bytes, bytearray, list, tuple, dict, set, frozenset)
"""Builtins whose subclasses :func:`refusal` names as such."""


# --------------------------------------------------------------------------- decoding payloads


def json_list(payload: Any) -> list[Any]:
    """``payload`` if it is a JSON list; else TypeError (a malformed skeleton)."""
    if type(payload) is not list:
        raise TypeError(f"expected a JSON list, found {type(payload).__name__}")
    return payload


def json_str(payload: Any) -> str:
    """``payload`` if it is a JSON string; else TypeError (a malformed skeleton)."""
    if type(payload) is not str:
        raise TypeError(f"expected a JSON string, found {type(payload).__name__}")
    return payload


def int_of(v: Any) -> int:
    """``v`` if it is a decoded int (not a bool); else TypeError."""
    if type(v) is not int:
        raise TypeError(f"expected an int, found {type(v).__name__}")
    return v


def float_of(v: Any) -> float:
    """``v`` as a float if it is a decoded float or int; else TypeError."""
    if type(v) not in (float, int):
        raise TypeError(f"expected a float, found {type(v).__name__}")
    return float(v)


def hex_int(payload: Any) -> int:
    """The int of an ``__int__`` payload (``"-0x1f"``); ValueError if it is not hex."""
    text = json_str(payload)
    if not text.removeprefix("-").startswith("0x"):
        raise ValueError(f"{text[:20]!r} is not a hex int")
    return int(text, 16)


def torch_dtype(payload: Any) -> torch.dtype:
    """The torch dtype named by a ``__dtype__`` payload (``"float32"``); ValueError otherwise."""
    dtype = getattr(torch, payload, None) if isinstance(payload, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{payload!r} is not a torch dtype")
    return dtype


def stdlib_module(name: str) -> Any:
    """``fractions`` or ``decimal``: a fixed standard-library module chosen by statekit
    (imported if needed), never a name read from a file; ValueError for any other name."""
    if name not in ("fractions", "decimal"):
        raise ValueError(name)
    return sys.modules.get(name) or importlib.import_module(name)


SIMPLE_DECODERS: dict[str, Callable[[Any], Any]] = {
    "__float__": lambda p: {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}[p],
    "__int__": hex_int,
    "__dtype__": torch_dtype,
    "__device__": lambda p: torch.device(json_str(p)),
    "__bytes__": lambda p: base64.b64decode(json_str(p), validate=True),
    "__bytearray__": lambda p: bytearray(base64.b64decode(json_str(p), validate=True)),
    "__decimal__": lambda p: stdlib_module("decimal").Decimal(json_str(p)),
}
"""Tag -> decoder, for the tags whose payload holds no nested value."""

SEQUENCE_DECODERS: dict[str, Callable[[list[Any]], Any]] = {
    "__tuple__": tuple,
    "__size__": torch.Size,
    "__set__": set,
    "__frozenset__": frozenset,
}
"""Tag -> constructor, for the tags whose payload is a list of nested values."""
