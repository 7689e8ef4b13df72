"""The real CUDA generators survive a round trip (only where torch sees a GPU; the
other tests use a fake device module, as CI has no accelerator)."""

from __future__ import annotations

import warnings

import pytest
import torch

import statekit
import statekit_rng.plugin as rng_plugin

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _draw() -> tuple[torch.Tensor, torch.Tensor]:
    """Draws from the CPU generator and from every CUDA device's generator."""
    cuda = [torch.rand(4, device=f"cuda:{i}").cpu() for i in range(torch.cuda.device_count())]
    return torch.rand(4), torch.cat(cuda)


def test_cuda_generators_round_trip(pm, url: str) -> None:
    assert rng_plugin.discover_accelerator()[0] == "cuda"
    torch.manual_seed(3)
    torch.cuda.manual_seed_all(3)
    _draw()  # away from the seeded state (and the CUDA generators initialized)
    manifest = statekit.save(url, {"w": torch.arange(4.0, device="cuda")})
    expected = _draw()
    torch.manual_seed(77)
    torch.cuda.manual_seed_all(77)
    with warnings.catch_warnings():
        warnings.simplefilter("error", statekit.StatekitWarning)  # same devices: nothing to warn about
        statekit.load(url, {"w": torch.zeros(4, device="cuda")})
    got = _draw()
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    record = manifest.records["rng"]
    assert record["device_type"] == "cuda" and record["device_count"] == torch.cuda.device_count()


def test_dropout_on_cuda_repeats_after_a_resume(pm, tmp_path) -> None:
    """What a training step draws on the GPU (a dropout mask) is the same after a resume."""
    torch.cuda.manual_seed_all(5)
    x = torch.ones(1024, device="cuda")
    statekit.save(str(tmp_path / "ckpt"), {"x": x})
    expected = torch.nn.functional.dropout(x, 0.5)
    torch.nn.functional.dropout(x, 0.5)  # the stream moves on
    statekit.load(str(tmp_path / "ckpt"), {"x": torch.zeros(1024, device="cuda")})
    assert torch.equal(torch.nn.functional.dropout(x, 0.5), expected)
