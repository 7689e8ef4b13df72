"""Fuzzing the parsers of untrusted bytes: only StatekitError may come out."""

from __future__ import annotations

import json
import struct

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import statekit
from statekit import format as fmt
from statekit.format import codec
from statekit.format.manifest import read_manifest
from statekit.storage import Storage

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)


def _parse(data: bytes) -> None:
    import io

    f = io.BytesIO(data)
    fmt.read_tensors(f, "fuzz.safetensors", len(data))


@FUZZ
@given(st.binary(max_size=256))
def test_tensor_header_parser_random_bytes(data):
    try:
        _parse(data)
    except statekit.StatekitError:
        pass


@FUZZ
@given(st.dictionaries(st.text(max_size=6), json_values, max_size=5), st.binary(max_size=64))
def test_tensor_header_parser_structured(header, body):
    raw = json.dumps(header).encode()
    try:
        _parse(struct.pack("<Q", len(raw)) + raw + body)
    except statekit.StatekitError:
        pass


entry = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(["F32", "BF16", "U8", "I64", "BOOL", "X9", 3]),
        "shape": st.lists(st.integers(-2, 4) | st.booleans(), max_size=3),
        "data_offsets": st.lists(st.integers(-4, 64), min_size=0, max_size=3),
    }
)


@FUZZ
@given(st.dictionaries(st.text(min_size=1, max_size=4), entry, max_size=3), st.binary(max_size=128))
def test_tensor_header_parser_near_valid(header, body):
    raw = json.dumps(header).encode()
    try:
        _parse(struct.pack("<Q", len(raw)) + raw + body)
    except statekit.StatekitError:
        pass


@FUZZ
@given(json_values)
@example({"format": []})  # an unhashable format once raised TypeError, not CorruptCheckpointError
def test_manifest_validation(manifest):
    try:
        fmt.validate_manifest(manifest, "fuzz/statekit.json")
    except statekit.StatekitError:
        pass


@FUZZ
@given(st.fixed_dictionaries({"format": st.just("statekit/1")}, optional={
    "statekit_version": json_values, "created": json_values, "world_size": json_values, "plugins": json_values,
    "objects": json_values, "files": json_values, "metadata": json_values, "records": json_values, "step": json_values}))
def test_manifest_validation_near_valid(manifest):
    try:
        fmt.validate_manifest(manifest, "fuzz/statekit.json")
    except statekit.StatekitError:
        pass


@FUZZ
@given(st.binary(max_size=200))
def test_manifest_bytes(data):
    storage = Storage("memory://fuzz/manifest")
    storage.write_bytes("statekit.json", data)
    try:
        read_manifest(storage)
    except statekit.StatekitError:
        pass


@FUZZ
@given(json_values)
def test_codec_skeleton(skeleton):
    try:
        codec.decode(skeleton, {}, source="fuzz.json")
    except statekit.StatekitError:
        pass


tagged = st.dictionaries(
    st.sampled_from(["__float__", "__tuple__", "__dict__", "__tensor__", "__dtype__", "__bytes__", "__set__", "__size__"]),
    json_values,
    min_size=1,
    max_size=1,
)


@FUZZ
@given(st.lists(tagged, max_size=3) | tagged)
def test_codec_tagged_values(skeleton):
    try:
        codec.decode(skeleton, {}, source="fuzz.json")
    except statekit.StatekitError:
        pass
