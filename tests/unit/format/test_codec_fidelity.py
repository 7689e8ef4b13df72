"""Value fidelity (issue 13 item 6): every value comes back from statekit.save/statekit.load
with its exact type, or the save is refused with UnsupportedValueError naming the key path
and the type. Loading never imports code."""

from __future__ import annotations

import collections
import dataclasses
import enum
import importlib
import json
import math
import re
import struct
import sys
import types
import typing
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

import statekit
from statekit import format as fmt

from repo_paths import ROOT
from statekit.errors import FormatVersionError, StateMismatchError, UnsupportedDtypeError, UnsupportedValueError
from statekit.format import codec
from statekit.storage import Storage

# --------------------------------------------------------------------------- module-level types (resolvable at load)


class Color(enum.Enum):
    RED = 1
    GREEN = "g"
    PAIR = (1, 2)


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


class Mode(str, enum.Enum):
    TRAIN = "train"
    EVAL = "eval"


class Switch(enum.StrEnum):
    ON = "on"


class Perm(enum.Flag):
    R = 4
    W = 2
    X = 1


class Bits(enum.IntFlag):
    A = 1
    B = 2


class Outer:
    class Inner(enum.Enum):
        X = "x"


Point = collections.namedtuple("Point", "x y")


class Pair(typing.NamedTuple):
    left: typing.Any
    right: typing.Any = None


class PointWithAttrs(Point):
    pass


class MyStr(str):
    pass


class MyInt(int):
    pass


class MyFloat(float):
    pass


class MyDict(dict):
    pass


class MyOrderedDict(collections.OrderedDict):
    pass


class MyList(list):
    pass


class MyTuple(tuple):
    pass


class MyBytes(bytes):
    pass


class MyTensor(torch.Tensor):
    pass


@dataclasses.dataclass
class Config:
    lr: float = 0.1


class Holder(enum.Enum):
    OBJ = object()


class NoLookup(enum.EnumMeta):
    def __call__(cls, *args, **kwargs):
        raise ValueError("this class cannot be looked up by value")


class Odd(enum.Enum, metaclass=NoLookup):
    A = 1


# --------------------------------------------------------------------------- helpers

URL_KEY = "custom_0"
WHERE = "custom_0/config/mode"


def save_value(tmp_path, value, name="ck"):
    url = str(tmp_path / name)
    statekit.save(url, {URL_KEY: {"config": {"mode": value}}})
    return url


def load_value(url):
    target: dict = {}
    statekit.load(url, {URL_KEY: target})
    return target["config"]["mode"]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)


def assert_exact(a, b, where="value"):
    """Same type at every level and identical values (float bits, tensor bytes, order)."""
    assert type(b) is type(a), f"{where}: type {type(a).__qualname__} came back as {type(b).__qualname__}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.requires_grad) == (b.dtype, b.shape, b.requires_grad), where
        assert torch.equal(bits(a), bits(b)), f"{where}: tensor bytes differ"
    elif isinstance(a, np.ndarray) or isinstance(a, np.generic):
        assert (a.dtype.str, a.shape) == (b.dtype.str, b.shape), f"{where}: {a.dtype.str} {a.shape} vs {b.dtype.str} {b.shape}"
        assert a.tobytes() == b.tobytes(), f"{where}: array bytes differ"
    elif isinstance(a, dict):
        assert len(a) == len(b), where
        for (ka, va), (kb, vb) in zip(a.items(), b.items()):
            assert_exact(ka, kb, f"{where}.keys()")
            assert_exact(va, vb, f"{where}[{ka!r}]")
        if isinstance(a, collections.defaultdict):
            assert a.default_factory is b.default_factory, where
    elif isinstance(a, (list, tuple)) and not isinstance(a, enum.Enum):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_exact(x, y, f"{where}[{i}]")
    elif type(a) is float:
        assert struct.pack("<d", a) == struct.pack("<d", b), f"{where}: {a!r} != {b!r}"
    elif type(a) is complex:
        assert struct.pack("<dd", a.real, a.imag) == struct.pack("<dd", b.real, b.imag), f"{where}: {a!r} != {b!r}"
    elif isinstance(a, Decimal):
        assert str(a) == str(b) and a.compare_total(b) == 0, f"{where}: {a!r} != {b!r}"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"
        if isinstance(a, enum.Enum):
            assert a is b, f"{where}: not the same member"


def random_tensor(dtype, shape=(2, 3), seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    raw = torch.randint(0, 256, (math.prod(shape) * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


# --------------------------------------------------------------------------- the zoo: exact round trips

ZOO = {
    "none": None,
    "true": True,
    "int": -7,
    "int64-overflow": 2**64 + 1,
    "huge-int": 10**5000 + 1,
    "huge-negative-int": -(7**9000),
    "int-2000-bits": 2**2000 - 1,
    "neg-zero": -0.0,
    "nan": math.nan,
    "inf": -math.inf,
    "subnormal": 5e-324,
    "str": "ünïcode ✓",
    "bytes": b"\x00\xff",
    "bytearray": bytearray(b"\x00abc"),
    "empty-bytearray": bytearray(),
    "complex": complex(1.5, -0.0),
    "complex-nonfinite": complex(math.nan, math.inf),
    "list": [1, [2, (3,)]],
    "tuple": (0.9, 0.999),
    "namedtuple": Point(1, (2.5, "a")),
    "typing-namedtuple": Pair(Level.LOW),
    "namedtuple-subclass-no-attrs": PointWithAttrs(1, 2),
    "set": {1, "a", (2, 3)},
    "frozenset": frozenset({0.5, None}),
    "dict-int-keys": {0: {"step": 3}, 10: {}},
    "dict-tag-key": {"__enum__": [1, 2], "__odict__": "x"},
    "ordereddict": collections.OrderedDict([("b", 1), ("a", collections.OrderedDict(z=2))]),
    "ordereddict-int-keys": collections.OrderedDict([(3, "c"), (1, "a")]),
    "defaultdict-list": collections.defaultdict(list, {"a": [1], 2: []}),
    "defaultdict-int": collections.defaultdict(int, {"x": 3}),
    "defaultdict-none": collections.defaultdict(None, {"x": 3}),
    "enum": Color.GREEN,
    "enum-tuple-value": Color.PAIR,
    "intenum": Level.HIGH,
    "str-enum": Mode.EVAL,
    "strenum": Switch.ON,
    "flag-composite": Perm.R | Perm.W,
    "intflag": Bits.A | Bits.B,
    "nested-enum": Outer.Inner.X,
    "enum-keys": {Mode.TRAIN: 1, Level.LOW: 2, "train": 3},
    "fraction": Fraction(-1, 3),
    "fraction-huge": Fraction(10**5000, 3),
    "decimal": Decimal("-0.00"),
    "decimal-nan": Decimal("NaN"),
    "decimal-exp": Decimal("1.50E+30"),
    "dtype": torch.bfloat16,
    "size": torch.Size([2, 0]),
    "device": torch.device("cpu"),
    "device-cuda-index": torch.device("cuda", 1),
    "parameter": torch.nn.Parameter(torch.randn(2, 3)),
    "parameter-frozen": torch.nn.Parameter(torch.randn(3), requires_grad=False),
    "tensor-requires-grad": torch.randn(4).requires_grad_(),
    "tensor-noncontiguous": torch.arange(12.0).reshape(3, 4).t(),
    "tensor-zero-size": torch.empty(0, 3, dtype=torch.int16),
    "tensor-0dim": torch.tensor(3.5, dtype=torch.float64),
    "tensor-slice-view": torch.arange(10)[2:7:2],
    "tensor-conj": torch.randn(3, dtype=torch.complex64).conj(),
    "ndarray-big-endian-i4": np.arange(5, dtype=">i4"),
    "ndarray-big-endian-f8": np.array([1.5, -0.0, np.nan], dtype=">f8"),
    "ndarray-little-endian": np.arange(4, dtype="<u2"),
    "ndarray-fortran": np.asfortranarray(np.arange(6.0).reshape(2, 3)),
    "ndarray-zero-size": np.zeros((0, 2), dtype=np.float16),
    "ndarray-bool": np.array([True, False]),
    "ndarray-0dim": np.array(7, dtype=">i8"),
    **{f"np-{t.__name__}": t(1) for t in (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64)},
    **{f"np-{t.__name__}": t(-1.25) for t in (np.float16, np.float32, np.float64)},
    "np-complex64": np.complex64(1 - 2j),
    "np-complex128": np.complex128(complex(math.nan, -0.0)),
    "np-float64-nan": np.float64(math.nan),
}


@pytest.mark.parametrize("value", list(ZOO.values()), ids=list(ZOO))
def test_zoo_round_trips_with_exact_type(tmp_path, value):
    assert_exact(value, load_value(save_value(tmp_path, value)))


TENSOR_DTYPES = [*fmt.SAFETENSORS_CODES, *fmt.BYTE_VIEW_DTYPES.values()]


@pytest.mark.parametrize("dtype", TENSOR_DTYPES, ids=[fmt.dtype_name(d) for d in TENSOR_DTYPES])
def test_tensor_of_every_storable_dtype(tmp_path, dtype):
    t = random_tensor(dtype)
    out = load_value(save_value(tmp_path, {"t": t, "p": torch.nn.Parameter(t, requires_grad=False)}))
    assert type(out["t"]) is torch.Tensor and type(out["p"]) is torch.nn.Parameter
    assert out["t"].dtype == dtype and torch.equal(bits(out["t"]), bits(t))
    assert out["p"].dtype == dtype and torch.equal(bits(out["p"]), bits(t))


def test_parameter_keeps_requires_grad_values_and_identity(tmp_path):
    p = torch.nn.Parameter(torch.randn(3, 2))
    state = {"a": p, "b": [p], "frozen": torch.nn.Parameter(torch.ones(2), requires_grad=False)}
    out = load_value(save_value(tmp_path, state))
    assert type(out["a"]) is torch.nn.Parameter and out["a"].requires_grad and torch.equal(out["a"], p)
    assert out["a"] is out["b"][0]  # one object saved -> one object loaded
    assert type(out["frozen"]) is torch.nn.Parameter and not out["frozen"].requires_grad


def test_views_sharing_storage(tmp_path):
    # The same tensor object stays one object; different views of one storage load as
    # independent tensors (documented: sharing between different views is not kept).
    base = torch.arange(6.0)
    out = load_value(save_value(tmp_path, {"a": base, "again": base, "tail": base[3:]}))
    assert out["a"] is out["again"]
    assert torch.equal(out["tail"], base[3:])
    out["a"][5] = -1.0
    assert out["tail"][2] == 5.0


def test_huge_int_under_a_lowered_digit_limit(tmp_path):
    previous = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(640)
    try:
        value = {"big": -(10**700), "edge": 2**2000 - 1}
        assert_exact(value, load_value(save_value(tmp_path, value)))
    finally:
        sys.set_int_max_str_digits(previous)
    skeleton, _ = codec.encode({"big": 10**700})
    assert skeleton == {"big": {"__int__": hex(10**700)}}


def test_everything_together_through_accelerate_custom_object(tmp_path):
    from accelerate_helpers import fresh_accelerator

    class Settings:
        def __init__(self, config):
            self.config = config

        def state_dict(self):
            return {"config": self.config}

        def load_state_dict(self, state):
            self.config = state["config"]

    everything = {k: v for k, v in ZOO.items() if not k.startswith("tensor-requires")}
    accelerator = fresh_accelerator()
    settings = Settings(dict(everything))
    accelerator.register_for_checkpointing(settings)
    statekit.save_state(accelerator, str(tmp_path / "ck"))
    settings.config = {}
    statekit.load_state(accelerator, str(tmp_path / "ck"))
    assert_exact(everything, settings.config)
    settings.config = {"mode": Mode.TRAIN, "bad": MyStr("x")}
    with pytest.raises(UnsupportedValueError, match=r"custom_0/config/bad \(state\['config'\]\['bad'\]\).*MyStr"):
        statekit.save_state(accelerator, str(tmp_path / "ck2"))


# --------------------------------------------------------------------------- refusals at save time


def local_enum():
    class Local(enum.Enum):
        A = 1

    return Local.A


def local_namedtuple():
    return collections.namedtuple("LocalPoint", "x")(1)


def namedtuple_with_attrs():
    p = PointWithAttrs(1, 2)
    p.note = "lost"
    return p


def unsupported_tensor(dtype):
    return torch.empty(4, dtype=dtype)


REFUSED = {
    "local-enum": (local_enum(), r"Enum type .*local_enum\.<locals>\.Local.*defined inside a function"),
    "local-namedtuple": (local_namedtuple(), rf"namedtuple type {re.escape(__name__)}\.LocalPoint, and '{re.escape(__name__)}' does not hold it"),
    "namedtuple-with-attrs": (namedtuple_with_attrs(), r"namedtuple of type .*PointWithAttrs carries instance attributes \['note'\]"),
    "str-subclass": (MyStr("a"), r"MyStr; a subclass of str, which would load as a plain str"),
    "int-subclass": (MyInt(3), r"MyInt; a subclass of int"),
    "float-subclass": (MyFloat(0.5), r"MyFloat; a subclass of float"),
    "dict-subclass": (MyDict(a=1), r"MyDict; a subclass of dict"),
    "ordereddict-subclass": (MyOrderedDict(a=1), r"MyOrderedDict; a subclass of dict"),
    "list-subclass": (MyList([1]), r"MyList; a subclass of list"),
    "tuple-subclass": (MyTuple((1,)), r"MyTuple; a subclass of tuple"),
    "bytes-subclass": (MyBytes(b"x"), r"MyBytes; a subclass of bytes"),
    "mapping-proxy": (types.MappingProxyType({"a": 1}), r"mappingproxy; a Mapping that is not a dict"),
    "dataclass": (Config(), r"Config; a dataclass instance; store dataclasses\.asdict"),
    "defaultdict-lambda": (collections.defaultdict(lambda: 0), r"collections\.defaultdict whose default_factory is <function"),
    "enum-no-lookup": (Odd.A, r"Enum member <Odd\.A: 1> of type .*Odd is not what Odd\(value\) returns"),
    "enum-unstorable-value": (Holder.OBJ, r"custom_0/config/mode/value \(state\['config'\]\['mode'\]\.value\).*builtins\.object"),
    "structured-array": (np.zeros(2, dtype=[("a", "i4"), ("b", "f4")]), r"numpy\.ndarray of structured dtype"),
    "object-array": (np.array([1, "a"], dtype=object), r"numpy\.ndarray of object dtype"),
    "string-array": (np.array(["ab"]), r"numpy\.ndarray has NumPy dtype <U2, which has no torch equivalent"),
    "ndarray-subclass": (np.ma.masked_array([1, 2]), r"numpy\.ma\.MaskedArray"),
    "np-longdouble": (np.longdouble(1), r"numpy\.longdouble has NumPy dtype float128"),
    "np-datetime64": (np.datetime64("2026-01-01"), r"numpy\.datetime64 has NumPy dtype datetime64\[D\], which has no torch equivalent"),
    "np-str": (np.str_("a"), r"numpy\.str_ has NumPy dtype <U1"),
    "tensor-subclass": (torch.ones(2).as_subclass(MyTensor), r"tensor subclass .*MyTensor would load as a plain torch\.Tensor"),
    "sparse-tensor": (torch.eye(2).to_sparse(), r"layout torch\.sparse_coo"),
    "meta-tensor": (torch.empty(2, device="meta"), r"meta device"),
    "int4-tensor": (unsupported_tensor(torch.int4), r"dtype torch\.int4, which safetensors cannot hold"),
    "bits8-tensor": (unsupported_tensor(torch.bits8), r"dtype torch\.bits8"),
    "lambda": (lambda: 0, r"builtins\.function"),
    "range": (range(3), r"builtins\.range"),
}


@pytest.mark.parametrize(("value", "message"), list(REFUSED.values()), ids=list(REFUSED))
def test_refused_at_save_naming_key_path_and_type(tmp_path, value, message):
    url = str(tmp_path / "ck")
    with pytest.raises(UnsupportedValueError, match=message) as info:
        save_value(tmp_path, value)
    assert WHERE in str(info.value)
    assert not Storage(url).exists(fmt.MANIFEST_NAME)  # nothing committed


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")
def test_unsupported_dtype_is_the_dtype_error(tmp_path):
    with pytest.raises(UnsupportedDtypeError, match=r"custom_0/config/mode.*torch\.qint8"):
        save_value(tmp_path, torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8))


def test_refused_save_keeps_the_previous_checkpoint(tmp_path):
    config = {"mode": Mode.TRAIN, "level": Level.LOW}
    manager = statekit.CheckpointManager({URL_KEY: config}, str(tmp_path / "run"))
    manager.save(1)
    config["mode"] = MyStr("train")  # would silently become a str: refused
    with pytest.raises(UnsupportedValueError, match=r"custom_0/mode \(state\['mode'\]\).*MyStr"):
        manager.save(2)
    assert [(i.step, i.committed) for i in manager.list()] == [(1, True), (2, False)]
    assert manager.latest().endswith("checkpoint-00000001")
    config.clear()
    assert manager.resume() == 1
    assert_exact({"mode": Mode.TRAIN, "level": Level.LOW}, config)


# --------------------------------------------------------------------------- loading never imports


def write_module(tmp_path, monkeypatch, name, body):
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop(name, None)
    importlib.invalidate_caches()
    return importlib.import_module(name)


WEATHER = "import enum, collections\nclass Weather(enum.Enum):\n    SUN = 1\n    RAIN = 2\nTrip = collections.namedtuple('Trip', 'a b')\n"


def test_enum_class_not_imported_is_a_named_error_and_nothing_is_imported(tmp_path, monkeypatch):
    mod = write_module(tmp_path, monkeypatch, "fidelity_weather", WEATHER)
    url = save_value(tmp_path, mod.Weather.RAIN)
    monkeypatch.delitem(sys.modules, "fidelity_weather")
    with pytest.raises(StateMismatchError, match=r"custom_0/config/mode .*Enum class fidelity_weather\.Weather.*import fidelity_weather"):
        load_value(url)
    assert "fidelity_weather" not in sys.modules  # importable, but the loader did not import it
    mod = importlib.import_module("fidelity_weather")  # the user imports it: the load works
    assert load_value(url) is mod.Weather.RAIN


def test_enum_class_changed_since_the_save(tmp_path, monkeypatch):
    mod = write_module(tmp_path, monkeypatch, "fidelity_weather2", WEATHER)
    url = save_value(tmp_path, {"w": mod.Weather.RAIN, "t": mod.Trip(1, 2)})
    monkeypatch.setattr(mod, "Weather", 5)
    with pytest.raises(StateMismatchError, match=r"finds 5 there, not an Enum class"):
        load_value(url)
    mod = write_module(tmp_path, monkeypatch, "fidelity_weather2", WEATHER.replace("RAIN = 2", "SNOW = 3"))
    with pytest.raises(StateMismatchError, match=r"custom_0/config/mode/w .*Weather has no member with the saved value 2"):
        load_value(url)
    mod = write_module(tmp_path, monkeypatch, "fidelity_weather2", WEATHER.replace("'a b'", "'a b c'"))
    with pytest.raises(StateMismatchError, match=r"namedtuple fidelity_weather2\.Trip was saved with 2 fields"):
        load_value(url)


def test_resolution_does_not_run_module_getattr(tmp_path, monkeypatch):
    mod = write_module(tmp_path, monkeypatch, "fidelity_lazy", WEATHER)
    url = save_value(tmp_path, mod.Weather.SUN)
    del mod.Weather
    calls = []
    monkeypatch.setattr(mod, "__getattr__", lambda name: calls.append(name) or enum.Enum, raising=False)
    with pytest.raises(StateMismatchError, match="finds no such class"):
        load_value(url)
    assert calls == []


# --------------------------------------------------------------------------- format compatibility


def rewrite(url, rel, doc):
    """Replace one file of a committed checkpoint, keeping the manifest's checksum valid."""
    data = json.dumps(doc).encode("utf-8")
    storage = Storage(url)
    storage.write_bytes(rel, data)
    manifest = json.loads(storage.read_bytes(fmt.MANIFEST_NAME))
    manifest["files"][rel].update(size_bytes=len(data), checksum=fmt.checksum_bytes(data))
    storage.write_bytes(fmt.MANIFEST_NAME, fmt.manifest_bytes(manifest))  # re-sealed


def test_version_1_state_file_still_loads(tmp_path):
    # A state file as statekit wrote it before codec version 2: no "codec" key, only the
    # version-1 tags; a user dict whose one key is a (later) version-2 tag is plain data.
    url = save_value(tmp_path, torch.arange(3.0))
    doc = json.loads(Storage(url).read_bytes("custom_0.json"))
    assert doc["codec"] == codec.VERSION == 2
    tensor_ref = doc["state"]["config"]["mode"]
    old_state = {
        "config": {
            "mode": tensor_ref,
            "t": {"__tuple__": [1, {"__float__": "nan"}]},
            "d": {"__dict__": [[0, {"__bytes__": "AP8="}]]},
            "user": {"__odict__": [[1, 2]]},
        }
    }
    rewrite(url, "custom_0.json", {"format": "statekit/1", "tensors": True, "state": old_state})
    target: dict = {}
    statekit.load(url, {URL_KEY: target})
    assert torch.equal(target["config"]["mode"], torch.arange(3.0))
    assert target["config"]["t"][0] == 1 and math.isnan(target["config"]["t"][1])
    assert target["config"]["d"] == {0: b"\x00\xff"}
    assert target["config"]["user"] == {"__odict__": [[1, 2]]}


def test_newer_codec_version_is_refused(tmp_path):
    url = save_value(tmp_path, 1)
    doc = json.loads(Storage(url).read_bytes("custom_0.json"))
    rewrite(url, "custom_0.json", {**doc, "codec": 99})
    with pytest.raises(FormatVersionError, match=r"custom_0\.json: codec version 99; this statekit reads versions 1 to 2"):
        load_value(url)


def test_docs_list_every_tag():
    text = (ROOT / "docs" / "format.md").read_text()
    assert [tag for tag in sorted(codec._TAGS) if f'"{tag}"' not in text] == []
