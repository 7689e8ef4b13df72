"""Every dtype statekit's format stores round-trips through disk offload, in place and copied,
through Accelerate's own offload reader, and back through a save from the offloaded model."""

from __future__ import annotations

import pytest
import torch
from accelerate import init_empty_weights
from accelerate.utils import OffloadedWeightsLoader
from torch import nn

import statekit
from statekit_offload import offload_info
from statekit_offload.offload_format import read_index

NATIVE = [
    torch.float32, torch.float16, torch.bfloat16, torch.float64,
    torch.int8, torch.int16, torch.int32, torch.int64,
    torch.uint8, torch.uint16, torch.uint32, torch.uint64,
    torch.bool, torch.float8_e4m3fn, torch.float8_e5m2, torch.complex64,
]  # fmt: skip
BYTE_VIEWS = [torch.complex128, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.float8_e8m0fnu]
"""Stored by statekit as uint8 views with the true dtype in the header's metadata."""


def _random(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape, itemsize), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def _bytes(t: torch.Tensor) -> bytes:
    return bytes(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


def make_values(seed: int = 0) -> dict[str, torch.Tensor]:
    """One tensor per dtype, plus 0-dim and empty tensors (bit patterns, NaNs included)."""
    gen = torch.Generator().manual_seed(seed)
    values = {"t_" + str(d).removeprefix("torch."): _random(d, (3, 5), gen) for d in NATIVE + BYTE_VIEWS}
    values["scalar_f32"] = _random(torch.float32, (), gen)
    values["scalar_bf16"] = _random(torch.bfloat16, (), gen)
    values["scalar_i64"] = _random(torch.int64, (), gen)
    values["scalar_f8"] = _random(torch.float8_e4m3fn, (), gen)
    values["empty_f32"] = torch.empty(0, 3)
    return values


class Bag(nn.Module):
    """Parameters (``requires_grad=False``) of any dtype; ``forward()`` returns copies of them all."""

    def __init__(self, values: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, value in values.items():
            self.register_parameter(name, nn.Parameter(value.clone(), requires_grad=False))

    def forward(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in self.named_parameters(recurse=False)}


class Outer(nn.Module):
    """Two bags: ``disk`` (mapped to disk) and ``mem`` (mapped to cpu)."""

    def __init__(self, values: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.disk = Bag(values)
        self.mem = Bag(values)

    def forward(self) -> dict[str, torch.Tensor]:
        out = {f"disk.{k}": v for k, v in self.disk().items()}
        out.update({f"mem.{k}": v for k, v in self.mem().items()})
        return out


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype and got[name].shape == value.shape, name
        assert _bytes(got[name]) == _bytes(value), name


@pytest.fixture
def dtype_ckpt(tmp_path, pm):
    values = make_values()
    model = Outer(values)
    url = str(tmp_path / "ckpt")
    statekit.save(url, {"model": model})
    return url, values, dict(model.state_dict())


@pytest.mark.parametrize("copy", [False, True], ids=["in-place", "copy"])
def test_every_dtype_through_disk_offload(dtype_ckpt, tmp_path, copy):
    url, values, want = dtype_ckpt
    with init_empty_weights():
        model = Outer(values)
    folder = tmp_path / "off"
    statekit.load(url, {"model": model}, device_map={"disk": "disk", "mem": "cpu"}, offload_folder=folder,
                  offload_copy=copy)
    info = offload_info(model)
    if copy:
        assert info.in_place == [] and len(info.copied) == len(values)
    else:  # byte-view dtypes cannot be read in place (safe_open would return their uint8 layout)
        assert sorted(info.copied) == sorted(f"disk.t_{str(d).removeprefix('torch.')}" for d in BYTE_VIEWS)
    assert info.in_memory_fallback == []
    assert all(p.device.type == "meta" for p in model.disk.parameters())
    _assert_same(model(), want)

    # Accelerate's own reader gives the same tensors from the folder we wrote
    index = read_index(str(folder))
    assert index["disk.t_bfloat16"]["dtype"] == "bfloat16" and index["disk.scalar_bf16"]["dtype"] == "bfloat16"
    if copy:
        assert index["disk.t_float8_e4m3fn"] == {"dtype": "float8_e4m3fn", "shape": [3, 5]}
        assert index["disk.scalar_f32"] == {"dtype": "float32", "shape": []}
        assert (folder / "disk.scalar_f32.dat").stat().st_size == 4  # 0-dim: one element
    loader = OffloadedWeightsLoader(save_folder=str(folder))
    _assert_same({k: loader[k] for k in index}, {k: v for k, v in want.items() if k.startswith("disk.")})

    # and a save from the offloaded model reads back equal into a real model
    url2 = str(tmp_path / "resaved")
    statekit.save(url2, {"model": model})
    fresh = Outer(make_values(seed=1))
    statekit.load(url2, {"model": fresh})
    _assert_same(dict(fresh.state_dict()), want)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_dtypes_without_offload_encoding_stay_in_memory(pm, tmp_path):
    gen = torch.Generator().manual_seed(3)
    values = {"c32": _random(torch.complex32, (2, 3), gen), "f32": _random(torch.float32, (4,), gen)}
    url = str(tmp_path / "ckpt")
    statekit.save(url, {"model": Outer(values)})
    with init_empty_weights():
        model = Outer(values)
    with pytest.warns(statekit.StatekitWarning, match="disk.c32 mapped to 'disk' but kept in CPU memory"):
        statekit.load(url, {"model": model}, device_map={"disk": "disk", "mem": "cpu"}, offload_folder=tmp_path / "off")
    assert offload_info(model).in_memory_fallback == ["disk.c32"]
    assert "disk.c32" not in read_index(str(tmp_path / "off"))
    _assert_same(model(), {f"{p}.{k}": v for p in ("disk", "mem") for k, v in values.items()})
