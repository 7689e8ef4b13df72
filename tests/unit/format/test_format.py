"""format: the streaming safetensors writer/reader, checksums, relative paths, manifest validation."""

from __future__ import annotations

import copy
import io
import json
import os
import struct
import warnings

import pytest
import safetensors
import safetensors.torch
import torch
import xxhash

import statekit
from statekit import format as fmt
from statekit.format.header import WRITER_KEY
from statekit.errors import CorruptCheckpointError, FormatVersionError, UnsupportedDtypeError
from statekit.testing import assert_state_equal

NATIVE = list(fmt._NATIVE)
BYTE_VIEW = list(fmt._BYTE_VIEW.values())
REQUIRED_BYTE_VIEWS = ["complex128", "float8_e8m0fnu", "float4_e2m1fn_x2"]

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning")


def dtype_id(d):
    return str(d).removeprefix("torch.")


def sample(dtype, shape=(3, 4), seed=0):
    """A tensor of ``dtype`` with arbitrary bit patterns (NaN, inf, -0.0, subnormals)."""
    g = torch.Generator().manual_seed(seed)
    numel = 1
    for d in shape:
        numel *= d
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "ComplexHalf support is experimental"
        return raw.view(dtype).reshape(shape)


def variants(dtype):
    base = sample(dtype, (3, 4))
    return {
        "w": base,
        "scalar": sample(dtype, (), seed=1),
        "empty": sample(dtype, (0, 5)),
        "noncontig": base.t(),
        "strided": sample(dtype, (4, 6), seed=2)[::2, 1::2],
        "vector": sample(dtype, (7,), seed=3),
    }


def write_bytes(tensors, metadata=None):
    buf = io.BytesIO()
    hasher = fmt.new_hasher()
    size = fmt.write_tensors(buf, tensors, metadata, hasher)
    data = buf.getvalue()
    assert size == len(data)
    assert fmt.checksum_string(hasher) == f"xxh3_64:{xxhash.xxh3_64_hexdigest(data)}"
    return data


def read_bytes(data, source="<test>", **kwargs):
    return fmt.read_tensors(io.BytesIO(data), source, len(data), **kwargs)


def raw_file(header, data=b"", length=None):
    """A safetensors file from a header dict (hand-made, for malformed cases)."""
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", NATIVE + BYTE_VIEW, ids=dtype_id)
def test_roundtrip_bytesio(dtype):
    tensors = variants(dtype)
    out, header = read_bytes(write_bytes(tensors))
    assert_state_equal(tensors, {k: out[k] for k in tensors})
    assert set(out) == set(tensors)
    assert all(t.is_contiguous() and t.device.type == "cpu" for t in out.values())
    assert header.metadata["format"] == "pt"


@pytest.mark.parametrize("dtype", NATIVE + BYTE_VIEW, ids=dtype_id)
def test_roundtrip_file(dtype, tmp_path):
    tensors = variants(dtype)
    path = tmp_path / "t.safetensors"
    hasher = fmt.new_hasher()
    with open(path, "wb") as f:
        size = fmt.write_tensors(f, tensors, {"note": "x"}, hasher)
    data = path.read_bytes()
    assert size == len(data) == os.path.getsize(path)
    assert fmt.checksum_string(hasher) == fmt.checksum_bytes(data) == f"xxh3_64:{xxhash.xxh3_64(data).hexdigest()}"
    with open(path, "rb") as f:
        out, header = fmt.read_tensors(f, str(path), size)
    assert_state_equal(tensors, out)
    assert header.metadata["note"] == "x"
    with open(path, "rb") as f:  # file_size unknown: still fine
        out, _ = fmt.read_tensors(f, str(path))
    assert_state_equal(tensors, out)


@pytest.mark.parametrize("name", REQUIRED_BYTE_VIEWS)
def test_byte_view_dtypes_are_supported_when_torch_has_them(name):
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        pytest.skip(f"torch {torch.__version__} has no {name}")
    assert dtype in BYTE_VIEW
    data = write_bytes({"x": sample(dtype)})
    _, header = read_bytes(data)
    (entry,) = header.entries
    assert entry.code == "U8" and entry.stored_shape == (3, 4, dtype.itemsize)
    assert entry.dtype == dtype and entry.shape == (3, 4)
    assert json.loads(header.metadata["statekit.dtypes"]) == {"x": name}


@pytest.mark.parametrize("dtype", NATIVE, ids=dtype_id)
def test_native_files_load_with_safetensors(dtype, tmp_path):
    tensors = variants(dtype)
    path = tmp_path / "m.safetensors"
    with open(path, "wb") as f:
        fmt.write_tensors(f, tensors)
    loaded = safetensors.torch.load_file(str(path))
    assert_state_equal({k: tensors[k] for k in sorted(tensors)}, {k: loaded[k] for k in sorted(tensors)})
    with safetensors.safe_open(str(path), framework="pt") as f:
        assert f.metadata()["format"] == "pt"
    # and what safetensors writes, statekit reads
    path2 = tmp_path / "ref.safetensors"
    safetensors.torch.save_file({k: v.contiguous() for k, v in tensors.items()}, str(path2), metadata={"format": "pt"})
    with open(path2, "rb") as f:
        out, _ = fmt.read_tensors(f, str(path2), os.path.getsize(path2))
    assert_state_equal({k: tensors[k] for k in sorted(tensors)}, {k: out[k] for k in sorted(tensors)})


def test_a_saved_checkpoint_opens_with_safetensors_and_safetensors_files_read_back_bit_exactly(tmp_path):
    """statekit writes and reads the safetensors format itself (docs/design-notes.md, Format);
    the library is the reference both ways: every native dtype in one file, in a page-aligned
    file (1 MiB of data or more: the header padded to 4096 bytes), written by a save through
    the storage writer, opens key by key with ``safe_open`` and ``load_file``; a file
    ``save_file`` writes with every native dtype reads back through statekit bit for bit."""
    tensors = {f"{dtype_id(d)}.{k}": v for d in NATIVE for k, v in variants(d).items()}
    tensors["big"] = sample(torch.float32, (512, 1024))  # 2 MiB: the page-aligned layout
    statekit.save(str(tmp_path / "ckpt"), {"m": tensors})
    path = tmp_path / "ckpt" / "m.safetensors"
    assert struct.unpack("<Q", path.read_bytes()[:8])[0] % fmt.tensors.PAGE_BYTES == fmt.tensors.PAGE_BYTES - 8
    with safetensors.safe_open(str(path), framework="pt") as f:
        assert sorted(f.keys()) == sorted(tensors)
        assert_state_equal({k: tensors[k] for k in sorted(tensors)}, {k: f.get_tensor(k) for k in sorted(tensors)})
    assert_state_equal({k: tensors[k] for k in sorted(tensors)}, dict(sorted(safetensors.torch.load_file(str(path)).items())))

    theirs = tmp_path / "theirs.safetensors"
    safetensors.torch.save_file({k: v.contiguous() for k, v in tensors.items()}, str(theirs))
    with open(theirs, "rb") as f:
        out, header = fmt.read_tensors(f, str(theirs), os.path.getsize(theirs))
    assert_state_equal({k: tensors[k] for k in sorted(tensors)}, {k: out[k] for k in sorted(tensors)})
    assert WRITER_KEY not in header.metadata  # not statekit's: no writer mark


def test_byte_view_file_loads_with_safetensors_as_bytes(tmp_path):
    t = torch.randn(2, 3, dtype=torch.complex128)
    path = tmp_path / "c.safetensors"
    with open(path, "wb") as f:
        fmt.write_tensors(f, {"c": t})
    loaded = safetensors.torch.load_file(str(path))["c"]
    assert loaded.dtype == torch.uint8 and loaded.shape == (2, 3, 16)
    assert torch.equal(loaded.view(torch.complex128).squeeze(-1), t)


def test_layout_is_safetensors(tmp_path):
    t = torch.arange(3, dtype=torch.float32)
    data = write_bytes({"a": t})
    (n,) = struct.unpack("<Q", data[:8])
    assert n % 8 == 0
    header = json.loads(data[8 : 8 + n])
    assert header["a"] == {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]}
    assert header["__metadata__"] == {"format": "pt", "statekit.writer": "statekit"}
    assert data[8 + n :] == t.numpy().tobytes()


def test_conj_and_neg_views_are_resolved():
    c = torch.randn(3, dtype=torch.complex64)
    tensors = {"conj": c.conj(), "neg": torch.randn(3)._neg_view()}
    out, _ = read_bytes(write_bytes(tensors))
    assert torch.equal(out["conj"], c.conj().resolve_conj())
    assert torch.equal(out["neg"], tensors["neg"].resolve_neg())


def test_empty_mapping():
    out, header = read_bytes(write_bytes({}))
    assert out == {} and header.entries == () and header.data_bytes == 0


def test_large_tensor_is_chunked(monkeypatch):
    monkeypatch.setattr(fmt.tensors, "CHUNK_BYTES", 1000)  # the module that streams tensor data
    t = torch.randn(3001)
    out, _ = read_bytes(write_bytes({"big": t, "small": torch.ones(2)}))
    assert torch.equal(out["big"], t)


def test_header_names_and_entries():
    tensors = {"b": torch.zeros(2), "a": torch.ones(3, dtype=torch.int64)}
    data = write_bytes(tensors)
    header, _ = fmt.parse_header(data[:8], io.BytesIO(data[8:]).read, len(data), "<t>")
    assert [e.name for e in header.entries] == ["b", "a"]
    assert header.names() == ["b", "a"]
    assert header.data_bytes == 8 + 24
    assert header.data_start + header.data_bytes == len(data)


# --------------------------------------------------------------------------- tied weights


def test_tied_weights_stored_once_and_retied():
    w = torch.randn(5, 3)
    tensors = {"embed.weight": w, "lm_head.weight": w, "other": torch.randn(2)}
    data = write_bytes(tensors)
    assert len(data) < len(write_bytes({"embed.weight": w, "lm_head.weight": w.clone(), "other": tensors["other"]}))
    out, header = read_bytes(data)
    assert [e.name for e in header.entries] == ["embed.weight", "other"]
    assert header.aliases == {"lm_head.weight": "embed.weight"}
    assert out["lm_head.weight"] is out["embed.weight"]
    assert torch.equal(out["embed.weight"], w)


def test_same_view_of_one_storage_is_tied_different_views_are_not():
    base = torch.randn(4, 4)
    tensors = {"a": base[1], "b": base[1], "c": base[2], "d": base.t()}
    out, header = read_bytes(write_bytes(tensors))
    assert header.aliases == {"b": "a"}
    assert out["b"] is out["a"]
    assert_state_equal(tensors, {k: out[k] for k in tensors})


def test_tied_weights_with_names_and_into():
    w = torch.randn(4, 2)
    data = write_bytes({"a": w, "b": w})
    out, _ = read_bytes(data, names=["b"])  # asking for the alias reads its target
    assert set(out) == {"a", "b"}
    assert torch.equal(out["b"], w)
    t1, t2 = torch.zeros(4, 2), torch.zeros(4, 2)
    out, _ = read_bytes(data, into={"a": t1, "b": t2})
    assert out["a"] is t1 and out["b"] is t2
    assert torch.equal(t1, w) and torch.equal(t2, w)
    tied = torch.zeros(4, 2)
    out, _ = read_bytes(data, into={"a": tied, "b": tied})
    assert out["a"] is tied and out["b"] is tied and torch.equal(tied, w)


# --------------------------------------------------------------------------- partial reads, into=


def test_names_selects_tensors():
    tensors = {"a": torch.randn(2), "b": torch.randn(3), "c": torch.randn(4)}
    data = write_bytes(tensors)
    out, _ = read_bytes(data, names=["c", "a"])
    assert set(out) == {"a", "c"}
    assert torch.equal(out["c"], tensors["c"])
    out, _ = read_bytes(data, names=["b"], hasher=fmt.new_hasher())  # a hasher needs every byte
    assert set(out) == {"a", "b", "c"}


def test_into_fills_in_place():
    src = {"w": torch.randn(3, 4), "b": torch.randn(4), "i": torch.arange(5)}
    data = write_bytes(src)
    targets = {k: torch.zeros_like(v) for k, v in src.items()}
    ptrs = {k: v.data_ptr() for k, v in targets.items()}
    out, _ = read_bytes(data, into=targets)
    for k in src:
        assert out[k] is targets[k]
        assert targets[k].data_ptr() == ptrs[k]
        assert torch.equal(targets[k], src[k])


def test_into_parameters_and_other_targets():
    src = {"w": torch.randn(3, 4), "v": torch.randn(4, 3), "h": torch.randn(2)}
    data = write_bytes(src)
    param = torch.nn.Parameter(torch.zeros(3, 4))  # requires grad: filled under no_grad
    noncontig = torch.zeros(3, 4).t()  # shape (4, 3), not contiguous
    other_dtype = torch.zeros(2, dtype=torch.float64)
    ptr = param.data_ptr()
    out, _ = read_bytes(data, into={"w": param, "v": noncontig, "h": other_dtype})
    assert out["w"] is param and param.data_ptr() == ptr and torch.equal(param.detach(), src["w"])
    assert out["v"] is noncontig and torch.equal(noncontig, src["v"])
    assert out["h"] is other_dtype and torch.equal(other_dtype, src["h"].double())


def test_into_byte_view_dtype():
    src = torch.randn(3, dtype=torch.complex128)
    target = torch.zeros(3, dtype=torch.complex128)
    out, _ = read_bytes(write_bytes({"c": src}), into={"c": target})
    assert out["c"] is target and torch.equal(target, src)


def test_tensor_bytes_view():
    t = torch.arange(6, dtype=torch.int16).reshape(2, 3)
    assert bytes(fmt.tensor_bytes(t)) == t.numpy().tobytes()
    assert bytes(fmt.tensor_bytes(t.t())) == t.t().contiguous().numpy().tobytes()
    assert len(fmt.tensor_bytes(torch.empty(0))) == 0
    p = torch.nn.Parameter(torch.ones(2))
    assert bytes(fmt.tensor_bytes(p)) == torch.ones(2).numpy().tobytes()


# --------------------------------------------------------------------------- malformed files


GOOD = {"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}


def bad_files():
    good = write_bytes({"x": torch.ones(2), "y": torch.zeros(3)})
    return {
        "empty-file": b"",
        "short-prefix": b"\x10\x00\x00",
        "truncated-header": good[:20],
        "truncated-data": good[:-4],
        "huge-length": struct.pack("<Q", 2**62) + b"{}      ",
        "length-past-end": struct.pack("<Q", 4096) + b"{}      ",
        "bad-json": raw_file({}).replace(b"{}", b"{["),
        "not-utf8": struct.pack("<Q", 8) + b"\xff\xfe{}    ",
        "top-level-list": raw_file([1, 2]),  # type: ignore[arg-type]
        "unknown-dtype": raw_file({"x": {"dtype": "F7", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8),
        "missing-fields": raw_file({"x": {"dtype": "F32"}}, b"\0" * 8),
        "entry-not-object": raw_file({"x": "F32"}, b"\0" * 8),
        "negative-shape": raw_file({"x": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8),
        "float-offsets": raw_file({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8.0]}}, b"\0" * 8),
        "overlapping-offsets": raw_file(
            {
                "x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "y": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            b"\0" * 12,
        ),
        "gap": raw_file(
            {
                "x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                "y": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]},
            },
            b"\0" * 12,
        ),
        "size-mismatch": raw_file({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8),
        "data-longer-than-header": raw_file(GOOD, b"\0" * 12),
        "metadata-not-str": raw_file({"__metadata__": {"format": 1}, **GOOD}, b"\0" * 8),
        "aliases-not-json": raw_file({"__metadata__": {"statekit.aliases": "{"}, **GOOD}, b"\0" * 8),
        "alias-to-nothing": raw_file({"__metadata__": {"statekit.aliases": '{"y": "z"}'}, **GOOD}, b"\0" * 8),
        "alias-shadows-entry": raw_file({"__metadata__": {"statekit.aliases": '{"x": "x"}'}, **GOOD}, b"\0" * 8),
        "unknown-byte-view": raw_file(
            {"__metadata__": {"statekit.dtypes": '{"x": "float3"}'}, "x": {"dtype": "U8", "shape": [2, 4], "data_offsets": [0, 8]}},
            b"\0" * 8,
        ),
        "byte-view-not-u8": raw_file({"__metadata__": {"statekit.dtypes": '{"x": "complex128"}'}, **GOOD}, b"\0" * 8),
    }


BAD = bad_files()


@pytest.mark.parametrize("case", sorted(BAD))
def test_malformed_file_is_corrupt(case):
    data = BAD[case]
    with pytest.raises(CorruptCheckpointError) as info:
        fmt.read_tensors(io.BytesIO(data), "s3://bucket/ckpt/model.safetensors", len(data))
    assert "s3://bucket/ckpt/model.safetensors" in str(info.value)
    assert info.value.path == "s3://bucket/ckpt/model.safetensors"


@pytest.mark.parametrize("case", ["truncated-data", "empty-file", "truncated-header"])
def test_malformed_file_is_corrupt_without_size(case):
    data = BAD[case]
    with pytest.raises(CorruptCheckpointError, match="/ckpt/m.safetensors"):
        fmt.read_tensors(io.BytesIO(data), "/ckpt/m.safetensors")


def test_byte_view_with_wrong_itemsize_is_corrupt():
    data = raw_file(
        {"__metadata__": {"statekit.dtypes": '{"x": "complex128"}'}, "x": {"dtype": "U8", "shape": [2, 3], "data_offsets": [0, 6]}},
        b"\0" * 6,
    )
    with pytest.raises(CorruptCheckpointError, match="<src>"):
        fmt.read_tensors(io.BytesIO(data), "<src>", len(data))


def test_boolean_in_shape_is_corrupt():
    data = raw_file({"x": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, b"\0" * 4)
    with pytest.raises(CorruptCheckpointError, match="<src>"):
        fmt.read_tensors(io.BytesIO(data), "<src>", len(data))


# --------------------------------------------------------------------------- unsupported tensors


@pytest.mark.parametrize(
    ("tensor", "fragment"),
    [
        (lambda: torch.zeros(4, dtype=torch.uint4), "dtype torch.uint4"),
        (lambda: torch.zeros(4, dtype=torch.int4), "dtype torch.int4"),
        (lambda: torch.zeros(3).to_sparse(), "layout"),
        (lambda: torch.empty(3, device="meta"), "meta device"),
        (lambda: [1.0, 2.0], "not a torch.Tensor"),
    ],
    ids=["uint4", "int4", "sparse", "meta", "list"],
)
def test_unsupported_tensor_names_the_key(tensor, fragment):
    buf = io.BytesIO()
    with pytest.raises(UnsupportedDtypeError) as info:
        fmt.write_tensors(buf, {"ok": torch.ones(1), "layers.0.weight": tensor()})
    assert "'layers.0.weight'" in str(info.value)
    assert fragment in str(info.value)
    assert buf.getvalue() == b""  # planned before anything is written


@pytest.mark.parametrize("name", ["", 3])
def test_bad_tensor_names(name):
    with pytest.raises(UnsupportedDtypeError, match="non-empty strings"):
        fmt.write_tensors(io.BytesIO(), {name: torch.ones(1)})


# --------------------------------------------------------------------------- checksums


def test_checksums():
    data = b"statekit" * 1000
    assert fmt.checksum_bytes(data) == "xxh3_64:" + xxhash.xxh3_64_hexdigest(data)
    h = fmt.new_hasher()
    h.update(data[:100])
    h.update(memoryview(data)[100:])
    assert fmt.checksum_string(h) == fmt.checksum_bytes(data)
    assert len(fmt.checksum_bytes(b"")) == len("xxh3_64:") + 16


def test_read_hasher_sees_every_byte():
    data = write_bytes({"a": torch.randn(10), "b": torch.randn(3, 3)})
    h = fmt.new_hasher()
    read_bytes(data, hasher=h)
    assert fmt.checksum_string(h) == fmt.checksum_bytes(data)


# --------------------------------------------------------------------------- relative paths


@pytest.mark.parametrize("path", ["model.safetensors", "unet/config.json", "rng/rank-00000.json", "a.b/c-d_e", "..x", "x.."])
def test_check_relpath_accepts(path):
    assert fmt.check_relpath(path) == path


@pytest.mark.parametrize(
    "path",
    ["../x", "a/../../x", "..", "/abs", "/", "s3://x", "file:///etc/passwd", "a//b", "a/", "", ".", "./a", "a/./b", "a\\b", "C:\\x"],
)
def test_check_relpath_rejects(path):
    with pytest.raises(CorruptCheckpointError, match="invalid relative path") as info:
        fmt.check_relpath(path, source="s3://bucket/ckpt")
    assert "s3://bucket/ckpt" in str(info.value)


def test_check_relpath_rejects_non_strings():
    with pytest.raises(CorruptCheckpointError):
        fmt.check_relpath(None)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- manifest


def manifest():
    return {
        "format": "statekit/1",
        "statekit_version": "0.1.0",
        "created": "2026-01-01T00:00:00Z",
        "step": 10,
        "world_size": 1,
        "plugins": {},
        "objects": {"model": {"kind": "model", "owner": "statekit", "per_rank": False, "files": ["model.safetensors"]}},
        "records": {},
        "files": {"model.safetensors": {"size_bytes": 10, "checksum": "xxh3_64:0123456789abcdef", "rank": 0, "writer": "statekit"}},
        "metadata": {},
    }


def test_validate_manifest_accepts():
    m = manifest()
    assert fmt.validate_manifest(m, "s3://b/ckpt/statekit.json") is m
    m["step"] = None
    fmt.validate_manifest(m, "src")


@pytest.mark.parametrize("version", ["statekit/4", "statekit/9", "statekit/1.1"])
def test_validate_manifest_newer_format(version):
    m = manifest()
    m["format"] = version
    with pytest.raises(FormatVersionError, match=version) as info:
        fmt.validate_manifest(m, "s3://b/ckpt/statekit.json")
    assert "s3://b/ckpt/statekit.json" in str(info.value)
    assert "upgrade" in str(info.value)


def _set(path, value):
    def edit(m):
        target = m
        for part in path[:-1]:
            target = target[part]
        if value is _DELETE:
            del target[path[-1]]
        else:
            target[path[-1]] = value
        return m

    return edit


_DELETE = object()

MALFORMED = {
    "not-object": lambda m: [m],
    "no-format": _set(["format"], _DELETE),
    "foreign-format": _set(["format"], "orbax/1"),
    "format-not-str": _set(["format"], 1),
    "no-version": _set(["statekit_version"], _DELETE),
    "created-not-str": _set(["created"], 5),
    "world-size-str": _set(["world_size"], "1"),
    "world-size-bool": _set(["world_size"], True),
    "plugins-list": _set(["plugins"], []),
    "objects-missing": _set(["objects"], _DELETE),
    "files-list": _set(["files"], []),
    "metadata-null": _set(["metadata"], None),
    "records-missing": _set(["records"], _DELETE),
    "step-str": _set(["step"], "10"),
    "step-float": _set(["step"], 10.0),
    "step-bool": _set(["step"], True),
    "file-escapes": lambda m: {**m, "files": {"../x": m["files"]["model.safetensors"]}},
    "file-absolute": lambda m: {**m, "files": {"/etc/passwd": m["files"]["model.safetensors"]}},
    "file-no-size": _set(["files", "model.safetensors", "size_bytes"], _DELETE),
    "file-size-str": _set(["files", "model.safetensors", "size_bytes"], "10"),
    "file-no-checksum": _set(["files", "model.safetensors", "checksum"], _DELETE),
    "file-rank-null": _set(["files", "model.safetensors", "rank"], None),
    "file-entry-str": _set(["files", "model.safetensors"], "x"),
    "object-no-kind": _set(["objects", "model", "kind"], _DELETE),
    "object-owner-null": _set(["objects", "model", "owner"], None),
    "object-entry-list": _set(["objects", "model"], []),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_validate_manifest_malformed(case):
    m = MALFORMED[case](copy.deepcopy(manifest()))
    with pytest.raises(CorruptCheckpointError) as info:
        fmt.validate_manifest(m, "/ckpt/statekit.json")
    assert not isinstance(info.value, FormatVersionError)
    assert "/ckpt/statekit.json" in str(info.value)


def test_view_identity_is_the_same_view_of_the_same_memory():
    from statekit.format.header import view_identity

    base = torch.arange(12, dtype=torch.float32)
    assert view_identity(base[2:6]) == view_identity(base[2:6])  # tied: one storage, one view
    assert view_identity(base[2:6]) != view_identity(base[3:7])  # another offset
    assert view_identity(base[2:6]) != view_identity(base[2:6].view(torch.int32))  # another dtype
    assert view_identity(base.view(3, 4)) != view_identity(base.view(4, 3))  # another shape
    assert view_identity(base.view(3, 4).t()) != view_identity(base.view(4, 3))  # another stride
    assert view_identity(base.clone()) != view_identity(base)  # equal values, other memory
    assert view_identity(torch.empty(0)) is None
    assert view_identity(torch.empty(3, device="meta")) is None  # meta tensors have no memory: never tied
    assert view_identity(torch.empty(3, device="meta")) == view_identity(torch.empty(4, device="meta"))


def test_gc_paused_restores_the_collectors_state():
    import gc

    from statekit.format.header import gc_paused

    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # left off, as it was
    finally:
        gc.enable()
    with pytest.raises(ValueError), gc_paused():
        raise ValueError("inside")
    assert gc.isenabled()
