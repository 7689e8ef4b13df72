"""codec: nested state <-> (strict JSON skeleton, flat tensors), exact round trips, no pickle."""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from statekit import format as fmt

from statekit.format import codec
from statekit.errors import CorruptCheckpointError, UnsupportedValueError
from statekit.testing import assert_state_equal

# --------------------------------------------------------------------------- helpers


def roundtrip(state, through_file=True):
    """encode -> strict JSON text -> decode; tensors through a safetensors file (BytesIO)."""
    skeleton, tensors = codec.encode(state)
    text = json.dumps(skeleton, allow_nan=False)
    if through_file and tensors:
        buf = io.BytesIO()
        fmt.write_tensors(buf, tensors)
        buf.seek(0)
        tensors, _ = fmt.read_tensors(buf, "<test>", len(buf.getvalue()))
    return codec.decode(json.loads(text), tensors, source="<test>")


TENSOR_DTYPES = [
    *fmt._NATIVE,
    *fmt._BYTE_VIEW.values(),
]

ITEMSIZE = {dtype: dtype.itemsize for dtype in TENSOR_DTYPES}

NUMPY_DTYPES = ["float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "bool", "complex64", "complex128"]


def random_tensor(dtype, shape, seed):
    g = torch.Generator().manual_seed(seed)
    numel = math.prod(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    itemsize = ITEMSIZE[dtype]
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)  # arbitrary bit patterns: NaNs, -0.0, subnormals...


shapes = st.lists(st.integers(0, 3), max_size=3).map(tuple)


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(TENSOR_DTYPES))
    t = random_tensor(dtype, draw(shapes), draw(st.integers(0, 2**31)))
    if t.dim() == 2 and draw(st.booleans()):
        t = t.t()  # non-contiguous
    return t


@st.composite
def ndarrays(draw):
    dtype = np.dtype(draw(st.sampled_from(NUMPY_DTYPES)))
    shape = draw(shapes)
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    if dtype == np.bool_:
        a = rng.integers(0, 2, size=shape).astype(bool)
    else:
        a = np.frombuffer(rng.bytes(math.prod(shape) * dtype.itemsize), dtype=dtype).reshape(shape).copy()
    if a.ndim == 2 and draw(st.booleans()):
        a = a.T
    return a


numpy_scalars = st.one_of(
    st.floats(width=32).map(np.float32),
    st.floats().map(np.float64),
    st.floats(width=16).map(np.float16),
    st.integers(-(2**63), 2**63 - 1).map(np.int64),
    st.integers(-(2**31), 2**31 - 1).map(np.int32),
    st.integers(0, 255).map(np.uint8),
    st.booleans().map(np.bool_),
)

finite_or_not = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 0.0])

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),  # big ones included
    st.integers(min_value=2**64, max_value=2**200) | st.integers(min_value=-(2**200), max_value=-(2**64)),
    finite_or_not,
    st.text(max_size=12),
)

# hashable values usable as dict keys and set items (no NaN: NaN != NaN)
hashables = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False),
    st.text(max_size=8),
    st.tuples(st.integers(), st.text(max_size=3)),
)

tag_keys = st.sampled_from(sorted(codec._TAGS))
str_keys = st.text(max_size=8) | tag_keys
dict_keys = str_keys | st.integers() | hashables

leaves = st.one_of(
    scalars,
    tensors(),
    ndarrays(),
    numpy_scalars,
    st.binary(max_size=16),
    st.sampled_from(TENSOR_DTYPES),
    shapes.map(torch.Size),
    st.frozensets(hashables, max_size=4),
    st.sets(hashables, max_size=4),
)


def containers(children):
    return st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(str_keys, children, max_size=4),
        st.dictionaries(st.integers(), children, max_size=4),  # optimizer "state" keys
        st.dictionaries(dict_keys, children, max_size=4),
    )


states = st.recursive(leaves, containers, max_leaves=24)


# --------------------------------------------------------------------------- property


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(state=states)
def test_roundtrip_property(state):
    skeleton, _ = codec.encode(state)
    json.dumps(skeleton, allow_nan=False)  # strict JSON, no NaN/Infinity literals
    assert_state_equal(state, roundtrip(state))


@settings(max_examples=40, deadline=None)
@given(state=st.dictionaries(str_keys | st.integers(), states, max_size=4))
def test_roundtrip_property_in_memory(state):
    # decode against the very tensors encode returned (no file in between)
    assert_state_equal(state, roundtrip(state, through_file=False))


# --------------------------------------------------------------------------- explicit cases


def test_tuple_stays_tuple_and_list_stays_list():
    state = {"betas": (0.9, 0.999), "l": [1, (2, [3, ()])], "empty": (), "nested": ((),)}
    out = roundtrip(state)
    assert type(out["betas"]) is tuple
    assert type(out["l"]) is list and type(out["l"][1]) is tuple and type(out["l"][1][1]) is list
    assert out["empty"] == () and out["nested"] == ((),)
    assert_state_equal(state, out)


def test_int_keys_stay_ints():
    state = {"state": {0: {"step": 3}, 1: {"step": 4}, 10: {}}, "mixed": {1: "a", "1": "b", True: "c", None: 0, 2.5: 1}}
    out = roundtrip(state)
    assert list(out["state"]) == [0, 1, 10]
    assert all(type(k) is int for k in out["state"])
    assert list(out["mixed"]) == [1, "1", None, 2.5]  # True == 1: Python itself merged those keys
    assert [type(k) for k in out["mixed"]] == [int, str, type(None), float]
    assert_state_equal(state, out)


def test_bool_key_is_not_int():
    out = roundtrip({True: 1, 0: 2, (1, "a"): 3})
    assert [type(k) for k in out] == [bool, int, tuple]
    assert out[(1, "a")] == 3


def test_key_order_kept():
    keys = ["zeta", "alpha", "mu", "beta", "0", "_"]
    out = roundtrip({k: i for i, k in enumerate(keys)})
    assert list(out) == keys
    out = roundtrip({5: "a", 3: "b", 9: "c", -1: "d"})
    assert list(out) == [5, 3, 9, -1]


@pytest.mark.parametrize("tag", sorted(codec._TAGS))
def test_dict_with_a_tag_key_is_plain_data(tag):
    state = {tag: [1, 2]}
    skeleton, _ = codec.encode(state)
    assert skeleton != {tag: [1, 2]}  # escaped, not mistaken for a tagged value
    out = roundtrip(state)
    assert out == {tag: [1, 2]} and type(out[tag]) is list
    nested = {"x": {tag: "v", "other": 1}}
    assert_state_equal(nested, roundtrip(nested))


def test_tuple_tag_key_in_str_dict():
    state = {"__tuple__": (1, 2), "a": {"__tensor__": "not a ref"}}
    out = roundtrip(state)
    assert_state_equal(state, out)


def test_set_and_frozenset():
    state = {"s": {1, "a", (2, 3)}, "f": frozenset({0.5, None}), "empty": set(), "fempty": frozenset()}
    out = roundtrip(state)
    assert type(out["s"]) is set and out["s"] == {1, "a", (2, 3)}
    assert type(out["f"]) is frozenset and out["f"] == frozenset({0.5, None})
    assert type(out["empty"]) is set and type(out["fempty"]) is frozenset


def test_bytes():
    state = {"b": b"\x00\xffabc", "e": b"", "ba": bytearray(b"xy")}
    out = roundtrip(state)
    assert out["b"] == b"\x00\xffabc" and type(out["b"]) is bytes
    assert out["e"] == b""
    assert out["ba"] == b"xy" and type(out["ba"]) is bytearray  # codec version 2: no longer narrowed to bytes


def test_torch_dtype_and_size():
    state = {"dtypes": [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex128], "size": torch.Size([2, 0, 3]), "s0": torch.Size([])}
    out = roundtrip(state)
    assert out["dtypes"] == state["dtypes"]
    assert type(out["size"]) is torch.Size and out["size"] == torch.Size([2, 0, 3])
    assert type(out["s0"]) is torch.Size and len(out["s0"]) == 0


def test_floats_exact():
    values = [math.inf, -math.inf, math.nan, -0.0, 0.0, 5e-324, 1.7976931348623157e308, 0.1, 1 / 3]
    out = roundtrip(values)
    assert math.isnan(out[2]) and out[0] == math.inf and out[1] == -math.inf
    assert math.copysign(1.0, out[3]) == -1.0 and math.copysign(1.0, out[4]) == 1.0
    assert out[5:] == values[5:]
    skeleton, _ = codec.encode(values)
    assert skeleton[:3] == [{"__float__": "inf"}, {"__float__": "-inf"}, {"__float__": "nan"}]


def test_big_ints_and_bools():
    state = [2**64 + 1, -(2**100), 0, True, False, None]
    out = roundtrip(state)
    assert out == state
    assert [type(x) for x in out] == [int, int, int, bool, bool, type(None)]


def test_tensors_are_referenced_by_path_name():
    t = torch.arange(3.0)
    skeleton, tensors = codec.encode({"state": {0: {"exp_avg": t}}}, prefix="optim")
    assert tensors == {"optim.state.0.exp_avg": t}
    assert tensors["optim.state.0.exp_avg"] is t  # the original, not a copy
    assert skeleton == {"state": {"__dict__": [[0, {"exp_avg": {"__tensor__": "optim.state.0.exp_avg"}}]]}}


def test_tensor_dtypes_and_shapes():
    state = {
        "bf16": torch.randn(3, 2).bfloat16(),
        "scalar": torch.tensor(3.5),
        "int0": torch.tensor(7, dtype=torch.int64),
        "empty": torch.empty(0, 4),
        "noncontig": torch.arange(12.0).reshape(3, 4).t(),
        "complex": torch.randn(2, dtype=torch.complex128),
    }
    out = roundtrip(state)
    assert_state_equal(state, out)
    assert out["scalar"].dim() == 0


def test_numpy_arrays_and_scalars():
    state = {
        "a": np.arange(6, dtype=np.int32).reshape(2, 3),
        "t": np.arange(6.0).reshape(2, 3).T,  # Fortran order
        "z": np.array(3.0),
        "f32": np.float32(1.5),
        "f64": np.float64(-0.0),
        "i": np.int64(-(2**62)),
        "b": np.bool_(True),
        "u": np.uint8(255),
    }
    out = roundtrip(state)
    assert_state_equal(state, out)
    assert type(out["f32"]) is np.float32 and type(out["f64"]) is np.float64 and type(out["b"]) is np.bool_
    assert isinstance(out["a"], np.ndarray) and out["a"].dtype == np.int32
    assert out["z"].shape == () and isinstance(out["z"], np.ndarray)


def test_numpy_random_state_roundtrip():
    # np.random.get_state() is the kind of value RNG plugins store
    state = np.random.RandomState(3).get_state()
    out = roundtrip(state)
    assert_state_equal(state, out)
    rs = np.random.RandomState()
    rs.set_state(out)
    assert rs.randint(0, 1000) == np.random.RandomState(3).randint(0, 1000)


def test_shared_tensor_stored_once():
    t = torch.arange(4.0)
    state = {"a": t, "b": [t, {"c": t}], "d": t.clone()}
    skeleton, tensors = codec.encode(state)
    assert len(tensors) == 2
    assert skeleton["a"] == skeleton["b"][0] == skeleton["b"][1]["c"]
    out = roundtrip(state)
    assert out["a"] is out["b"][0] is out["b"][1]["c"]
    assert out["d"] is not out["a"]
    assert_state_equal(state, out)


def test_colliding_tensor_names_are_unique():
    # "a.b" as one key and "a" -> "b" nested give the same path name
    state = {"a.b": torch.zeros(1), "a": {"b": torch.ones(1)}}
    skeleton, tensors = codec.encode(state)
    assert len(tensors) == 2
    assert_state_equal(state, roundtrip(state))


@pytest.mark.parametrize(
    ("state", "where"),
    [
        ({"opt": {"param_groups": [{"lr": 0.1, "fn": lambda x: x}]}}, "state['opt']['param_groups'][0]['fn']"),
        ({"a": [1, (2, object())]}, "state['a'][1][1]"),
        ({5: {"k": print}}, "state[5]['k']"),
        ([{"x": range(3)}], "state[0]['x']"),
    ],
    ids=["lambda", "object", "builtin", "range"],
)
def test_unsupported_value_names_key_path(state, where):
    with pytest.raises(UnsupportedValueError) as info:
        codec.encode(state)
    assert where in str(info.value)
    assert "pickle" in str(info.value)
    assert isinstance(info.value, TypeError)


def test_unsupported_numpy_dtype():
    with pytest.raises(UnsupportedValueError, match=r"state\['s'\]"):
        codec.encode({"s": np.array(["a", "b"])})


def test_big_endian_array():
    a = np.arange(3, dtype=">f4")
    try:
        out = roundtrip({"a": a})
    except UnsupportedValueError as exc:
        assert "state['a']" in str(exc)
    else:
        np.testing.assert_array_equal(out["a"], a)


def test_unsupported_dict_key():
    with pytest.raises(UnsupportedValueError, match=r"keys\(\)"):
        codec.encode({object(): 1})


def test_decode_missing_tensor_is_corrupt():
    with pytest.raises(CorruptCheckpointError, match="opt.json") as info:
        codec.decode({"x": {"__tensor__": "gone"}}, {}, source="/ckpt/opt.json")
    assert info.value.path == "/ckpt/opt.json"
    assert "state['x']" in str(info.value)


@pytest.mark.parametrize(
    "skeleton",
    [
        {"__float__": "huge"},
        {"__dtype__": "not_a_dtype"},
        {"__dtype__": "Tensor"},
        {"__bytes__": "!!!"},
        {"__dict__": [[[1, 2], "list key"]]},
        {"__dict__": 5},
        {"__tuple__": 3},
    ],
    ids=["float", "dtype", "dtype-not-dtype", "bytes", "list-key", "dict-payload", "tuple-payload"],
)
def test_decode_malformed_is_corrupt(skeleton):
    with pytest.raises(CorruptCheckpointError, match=r"/ckpt/x\.json: malformed value"):
        codec.decode(skeleton, {}, source="/ckpt/x.json")


def test_decode_plain_json_is_itself():
    doc = {"a": [1, 2.5, "s", None, True], "b": {"c": {}}}
    assert codec.decode(doc, {}) == doc


# --------------------------------------------------------------------------- assert_state_equal itself


@pytest.mark.parametrize(
    ("a", "b", "fragment"),
    [
        ({"a": (1, 2)}, {"a": [1, 2]}, "state['a']: type tuple != list"),
        ({1: "x"}, {"1": "x"}, "keys differ"),
        ({"a": 1, "b": 2}, {"b": 2, "a": 1}, "key order differs"),
        ({"a": [0.0]}, {"a": [-0.0]}, "state['a'][0]: 0.0 != -0.0"),
        ({"t": torch.zeros(2)}, {"t": torch.zeros(2, dtype=torch.float64)}, "state['t']: dtype"),
        ({"t": torch.zeros(2)}, {"t": torch.zeros(1, 2)}, "state['t']: shape"),
        ({"t": torch.tensor([1.0, 2.0])}, {"t": torch.tensor([1.0, 3.0])}, "flat index 1: 2.0 vs 3.0"),
        ([True], [1], "type bool != int"),
        ([np.float32(1)], [np.float64(1)], "type numpy.float32 != numpy.float64"),
        ([np.zeros(2)], [torch.zeros(2)], "state[0]: type"),
    ],
)
def test_assert_state_equal_reports_first_difference(a, b, fragment):
    with pytest.raises(AssertionError) as info:
        assert_state_equal(a, b)
    assert fragment in str(info.value)


def test_assert_state_equal_accepts_equal_states():
    t = torch.tensor([math.nan, -0.0, 1.0])
    assert_state_equal({"t": t, "f": math.nan, 1: (np.arange(2),)}, {"t": t.clone(), "f": float("nan"), 1: (np.arange(2),)})
    from collections import OrderedDict

    assert_state_equal(OrderedDict(a=1), {"a": 1})


def test_assert_state_equal_fixture(assert_state_equal):
    assert_state_equal([1], [1])
    with pytest.raises(AssertionError):
        assert_state_equal([1], [2])
