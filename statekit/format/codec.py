"""State tree <-> (flat tensor mapping for safetensors, JSON skeleton). No pickle, ever.

:func:`encode` replaces every tensor and NumPy array of a nested state by a reference to a
flat ``{name: torch.Tensor}`` mapping; :func:`decode` reverses it. Every value comes back with
its exact type, or is refused at save time naming its key path (rules:
:mod:`statekit.format.codec_types`). The representation: docs/format.md, "Everything else:
JSON through the codec".
"""

from __future__ import annotations

import base64
import enum
import math
import sys
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Mapping
from typing import Any

import torch

from statekit.errors import CorruptCheckpointError, FormatVersionError, StatekitError, StateMismatchError, UnsupportedValueError
from statekit.format import codec_types as ct

VERSION = 2
"""The codec version :func:`encode` writes (``"codec"`` in a state file); 1 (no
``"codec"`` key) is the version before the tags marked 2 in docs/format.md's table."""

_V1_TAGS = frozenset(
    {"__float__", "__tuple__", "__size__", "__set__", "__frozenset__", "__dict__"}
    | {"__tensor__", "__ndarray__", "__npscalar__", "__dtype__", "__bytes__"}
)
_V2_TAGS = frozenset(
    {"__int__", "__complex__", "__namedtuple__", "__odict__", "__defaultdict__", "__enum__", "__gradtensor__"}
    | {"__parameter__", "__ndarray_dtype__", "__device__", "__bytearray__", "__fraction__", "__decimal__"}
)
_TAGS = _V1_TAGS | _V2_TAGS
"""Every tag; a str-keyed dict with one of them as a key is escaped as ``__dict__``."""
_TAGS_BY_VERSION = {1: _V1_TAGS, 2: _TAGS}


def encode(state: Any, prefix: str = "", root: str = "") -> tuple[Any, dict[str, torch.Tensor]]:
    """Split ``state`` into a JSON-able skeleton and a flat tensor mapping.

    Args:
        state: a nested structure of the types the codec represents.
        prefix: prepended to tensor names (``"state.0.exp_avg"``), for readable files.
        root: the state's own key (the file base, ``"custom_0"``), first in error key paths.

    Returns:
        ``(skeleton, tensors)``: ``skeleton`` is ``json.dumps``-able with ``allow_nan=False``;
        ``tensors`` maps unique names to the original tensors (not copies; the same object
        twice is stored once).

    Raises:
        UnsupportedValueError: a value has no exact representation; the message gives its
            key path and Python position (``custom_0/opt/fn (state['opt']['fn'])``) and type.
    """
    encoder = _Encoder(prefix, root)
    skeleton = encoder.encode(state, ())
    return skeleton, encoder.tensors


def decode(
    skeleton: Any, tensors: Mapping[str, torch.Tensor], source: str = "<memory>", root: str = "", version: int = VERSION
) -> Any:
    """Rebuild the state ``encode`` split.

    Args:
        skeleton: the JSON skeleton.
        tensors: the tensors it references, by name.
        source: the file the skeleton came from, for error messages.
        root: the state's own key, first in error key paths.
        version: the codec version that wrote it (a state file's ``"codec"``; 1 without one).

    Returns:
        The state, every value with the type it was saved with.

    Raises:
        CorruptCheckpointError: the skeleton is malformed or references a missing tensor.
        StateMismatchError: a saved Enum or namedtuple class is not imported in this process,
            or no longer has the saved value.
        FormatVersionError: ``version`` is newer than this statekit reads.
    """
    if type(version) is not int or version not in _TAGS_BY_VERSION:
        raise FormatVersionError(f"{source}: codec version {version!r}; this statekit reads versions 1 to {VERSION}, upgrade it")
    return _Decoder(tensors, source, root, _TAGS_BY_VERSION[version]).decode(skeleton, ())


def _item(parts: ct.Parts, key: Any) -> ct.Parts:
    return (*parts, ("item", key))


class _Encoder:
    def __init__(self, prefix: str, root: str) -> None:
        self.prefix, self.root = prefix, root
        self.tensors: dict[str, torch.Tensor] = {}
        self._names_by_id: dict[int, str] = {}
        self._exact: dict[type, Callable[[Any, ct.Parts], Any]] = {
            type(None): _itself, bool: _itself, str: _itself, int: _int, float: _float, complex: self._complex,
            list: self._list, tuple: self._tuple, dict: self._dict, OrderedDict: self._pairs, defaultdict: self._defaultdict,
            set: self._set, frozenset: self._set, bytes: _bytes, bytearray: _bytes,
            torch.Tensor: self._tensor, torch.nn.Parameter: self._tensor, torch.Size: _size,
            torch.dtype: _dtype, torch.device: _device,
        }  # fmt: skip

    def where(self, parts: ct.Parts) -> str:
        return ct.describe(self.root, parts)

    def _store(self, t: torch.Tensor, parts: ct.Parts) -> str:
        existing = self._names_by_id.get(id(t))
        if existing is not None:
            return existing
        segments = ["key" if kind == "key" else str(p) for kind, p in parts]
        path = ".".join([self.prefix, *segments] if self.prefix else segments)
        name = path or "tensor"
        i = 1
        while name in self.tensors:
            name = f"{path}#{i}"
            i += 1
        self.tensors[name] = t
        self._names_by_id[id(t)] = name
        return name

    def encode(self, v: Any, parts: ct.Parts) -> Any:
        method = self._exact.get(type(v))
        return method(v, parts) if method is not None else self._other(v, parts)

    def _complex(self, v: complex, parts: ct.Parts) -> Any:
        return {"__complex__": [_float(v.real, parts), _float(v.imag, parts)]}

    def _list(self, v: list[Any], parts: ct.Parts) -> Any:
        return [self.encode(x, _item(parts, i)) for i, x in enumerate(v)]

    def _tuple(self, v: tuple[Any, ...], parts: ct.Parts) -> Any:
        return {"__tuple__": self._list(v, parts)}  # type: ignore[arg-type]

    def _set(self, v: set[Any] | frozenset[Any], parts: ct.Parts) -> Any:
        tag = "__frozenset__" if type(v) is frozenset else "__set__"
        return {tag: [self.encode(x, (*parts, ("member", i))) for i, x in enumerate(v)]}

    def _dict(self, m: dict[Any, Any], parts: ct.Parts) -> Any:
        if all(type(k) is str and k not in _TAGS for k in m):
            return {k: self.encode(v, _item(parts, k)) for k, v in m.items()}
        return {"__dict__": self._pairs(m, parts)["__odict__"]}

    def _pairs(self, m: Mapping[Any, Any], parts: ct.Parts) -> Any:
        keys = (*parts, ("key", None))
        return {"__odict__": [[self.encode(k, keys), self.encode(v, _item(parts, k))] for k, v in m.items()]}

    def _defaultdict(self, m: defaultdict[Any, Any], parts: ct.Parts) -> Any:
        factory = ct.FACTORY_NAMES.get(m.default_factory) if _hashable(m.default_factory) else None
        if factory is None:
            raise UnsupportedValueError(
                f"cannot store {self.where(parts)}: collections.defaultdict whose default_factory is "
                f"{m.default_factory!r}; only None and builtin types ({', '.join(ct.DEFAULT_FACTORIES)}) can be "
                "restored without code: store dict(value) and rebuild the defaultdict after loading"
            )
        return {"__defaultdict__": [factory, self._pairs(m, parts)["__odict__"]]}

    def _tensor(self, t: torch.Tensor, parts: ct.Parts) -> Any:
        if t.dtype not in ct.STORABLE_DTYPES or t.layout != torch.strided or t.is_nested or t.is_meta:
            ct.check_tensor(t, self.where(parts))  # raises, naming the problem
        name = self._store(t, parts)
        if type(t) is torch.nn.Parameter:
            return {"__parameter__": [name, bool(t.requires_grad)]}
        return {"__gradtensor__": name} if t.requires_grad else {"__tensor__": name}

    def _other(self, v: Any, parts: ct.Parts) -> Any:
        np = sys.modules.get("numpy")
        if np is not None and type(v) is np.ndarray:
            tensor, order = ct.ndarray_to_tensor(v, self.where(parts), "numpy.ndarray")
            name = self._store(tensor, parts)
            return {"__ndarray_dtype__": [name, order]} if order else {"__ndarray__": name}
        if np is not None and isinstance(v, np.generic) and type(v) is v.dtype.type:
            tensor, _ = ct.ndarray_to_tensor(np.asarray(v), self.where(parts), ct.type_name(type(v)))
            return {"__npscalar__": self._store(tensor, parts)}
        if isinstance(v, enum.Enum):
            name = ct.check_nameable(v, "Enum", self.where(parts))
            return {"__enum__": [name, self.encode(v.value, (*parts, ("attr", "value")))]}
        if ct.is_namedtuple_class(type(v)):
            name = ct.check_nameable(v, "namedtuple", self.where(parts))
            return {"__namedtuple__": [name, self._list(v, parts)]}  # type: ignore[arg-type]
        if type(v) is getattr(sys.modules.get("fractions"), "Fraction", None):
            return {"__fraction__": [_int(v.numerator, parts), _int(v.denominator, parts)]}
        if type(v) is getattr(sys.modules.get("decimal"), "Decimal", None):
            return {"__decimal__": str(v)}
        if isinstance(v, torch.Tensor):
            ct.check_tensor(v, self.where(parts))  # raises: a tensor subclass
        raise ct.refusal(v, self.where(parts))


def _itself(v: Any, parts: ct.Parts) -> Any:
    return v


def _int(v: int, parts: ct.Parts) -> Any:
    return int(v) if v.bit_length() <= ct.PLAIN_INT_BITS else {"__int__": hex(v)}


def _float(v: float, parts: ct.Parts) -> Any:
    if math.isfinite(v):
        return float(v)
    return {"__float__": "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")}


def _bytes(v: bytes | bytearray, parts: ct.Parts) -> Any:
    return {"__bytearray__" if type(v) is bytearray else "__bytes__": base64.b64encode(v).decode("ascii")}


def _size(v: torch.Size, parts: ct.Parts) -> Any:
    return {"__size__": [int(x) for x in v]}


def _dtype(v: torch.dtype, parts: ct.Parts) -> Any:
    return {"__dtype__": str(v).removeprefix("torch.")}


def _device(v: torch.device, parts: ct.Parts) -> Any:
    return {"__device__": str(v)}


def _hashable(v: Any) -> bool:
    try:
        hash(v)
    except TypeError:
        return False
    return True


class _Decoder:
    def __init__(self, tensors: Mapping[str, torch.Tensor], source: str, root: str, tags: frozenset[str]) -> None:
        self.tensors, self.source, self.root, self.tags = tensors, source, root, tags
        self._wrapped: dict[tuple[str, str], torch.Tensor] = {}  # (tag, name) -> Parameter / grad tensor: one object per name

    def decode(self, v: Any, parts: ct.Parts) -> Any:
        if type(v) is list:
            return [self.decode(x, _item(parts, i)) for i, x in enumerate(v)]
        if type(v) is not dict:
            return v
        if len(v) == 1:
            ((tag, payload),) = v.items()
            if tag in self.tags:
                try:
                    return self._tagged(tag, payload, parts)
                except StatekitError:
                    raise
                except (KeyError, TypeError, ValueError, AttributeError, RuntimeError, ArithmeticError) as exc:
                    raise CorruptCheckpointError(
                        f"{self.source}: malformed value at {ct.describe(self.root, parts)} ({tag}): {type(exc).__name__}: {exc}",
                        path=self.source,
                    ) from exc
        return {k: self.decode(x, _item(parts, k)) for k, x in v.items()}

    def _tagged(self, tag: str, payload: Any, parts: ct.Parts) -> Any:
        simple = ct.SIMPLE_DECODERS.get(tag)
        if simple is not None:
            return simple(payload)
        if tag in ("__tensor__", "__gradtensor__", "__parameter__", "__ndarray__", "__npscalar__", "__ndarray_dtype__"):
            return self._tensor(tag, payload, parts)
        if tag in ("__dict__", "__odict__", "__defaultdict__"):
            return self._mapping(tag, payload, parts)
        if tag in ("__enum__", "__namedtuple__"):
            return self._class_value(tag, payload, parts)
        items = self.decode(ct.json_list(payload), parts)
        if tag == "__complex__":
            real, imag = (ct.float_of(x) for x in items)
            return complex(real, imag)
        if tag == "__fraction__":
            num, den = items
            return ct.stdlib_module("fractions").Fraction(ct.int_of(num), ct.int_of(den))
        return ct.SEQUENCE_DECODERS[tag](items)

    def _lookup(self, name: Any, parts: ct.Parts) -> torch.Tensor:
        if not isinstance(name, str) or name not in self.tensors:
            raise CorruptCheckpointError(
                f"{self.source}: {ct.describe(self.root, parts)} references tensor {name!r}, which is not stored", path=self.source
            )
        return self.tensors[name]

    def _tensor(self, tag: str, payload: Any, parts: ct.Parts) -> Any:
        if tag == "__parameter__":
            name, requires_grad = payload
            if type(requires_grad) is not bool:
                raise TypeError(f"requires_grad {requires_grad!r} is not a bool")
        else:
            name, requires_grad = (payload[0] if tag == "__ndarray_dtype__" else payload), True
        t = self._lookup(name, parts)
        if tag in ("__parameter__", "__gradtensor__"):
            key = (tag, name)
            if key not in self._wrapped:
                self._wrapped[key] = (
                    torch.nn.Parameter(t, requires_grad=requires_grad) if tag == "__parameter__" else t.detach().requires_grad_(True)
                )
            return self._wrapped[key]
        if tag == "__tensor__":
            return t
        array = t.numpy()
        if tag == "__npscalar__":
            return array[()]
        if tag == "__ndarray_dtype__":
            dtype = sys.modules["numpy"].dtype(payload[1])  # numpy is loaded: t.numpy() ran
            if dtype.isnative or dtype.newbyteorder("=") != array.dtype:
                raise ValueError(f"{payload[1]!r} is not the non-native form of the stored dtype {array.dtype}")
            return array.astype(dtype)
        return array

    def _mapping(self, tag: str, payload: Any, parts: ct.Parts) -> Any:
        factory = None
        if tag == "__defaultdict__":
            factory_name, payload = payload
            factory = ct.DEFAULT_FACTORIES[factory_name]
        pairs = []
        for pair in ct.json_list(payload):
            k, x = pair
            key = self.decode(k, (*parts, ("key", None)))
            if not _hashable(key):
                raise TypeError(f"a {type(key).__name__} cannot be a dict key")
            pairs.append((key, self.decode(x, _item(parts, key))))
        if tag == "__dict__":
            return dict(pairs)
        return OrderedDict(pairs) if tag == "__odict__" else defaultdict(factory, pairs)

    def _class_value(self, tag: str, payload: Any, parts: ct.Parts) -> Any:
        name, raw = payload
        if not isinstance(name, str):
            raise TypeError(f"class name {name!r} is not a str")
        what = "Enum" if tag == "__enum__" else "namedtuple"
        cls = ct.resolve_class(name)
        if tag == "__enum__":
            base_ok = isinstance(cls, type) and issubclass(cls, enum.Enum)
        else:
            base_ok = ct.is_namedtuple_class(cls)
        where = ct.describe(self.root, parts)
        if not base_ok:
            found = "finds no such class" if cls is None else f"finds {cls!r} there, not {'an' if what == 'Enum' else 'a'} {what} class"
            raise StateMismatchError(
                f"{where} in {self.source}",
                reason=f"the value was saved as {'a member' if what == 'Enum' else 'an instance'} of {what} class "
                f"{name.replace(':', '.')}, and this process "
                f"{found} under that name; statekit never imports code while loading: import {name.partition(':')[0]} "
                "(the module defining the class) before loading",
            )
        if tag == "__namedtuple__":
            items = self.decode(ct.json_list(raw), parts)
            if len(items) != len(cls._fields):
                raise StateMismatchError(
                    f"{where} in {self.source}",
                    reason=f"namedtuple {name.replace(':', '.')} was saved with {len(items)} fields, the class now has "
                    f"{len(cls._fields)} {cls._fields}",
                )
            return tuple.__new__(cls, items)  # as pickle does: no user __new__ / __init__ runs
        value = self.decode(raw, (*parts, ("attr", "value")))
        try:
            return cls(value)
        except ValueError:
            raise StateMismatchError(
                f"{where} in {self.source}", reason=f"enum class {name.replace(':', '.')} has no member with the saved value {value!r}"
            ) from None
