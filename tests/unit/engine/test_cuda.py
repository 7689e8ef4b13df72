"""A state that lives on a CUDA device: exact round trips, async snapshots, pinned staging.

These run only where torch sees a GPU (the device machine some sessions are lent; CI has
none, so they skip there). The CPU seams of the same code paths are tested in
``test_staging.py``.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import statekit
from statekit.testing import assert_state_equal

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _model_and_optimizer(seed: int = 0, device: str = "cuda", step: bool = True):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(512, 1024), nn.LayerNorm(1024), nn.Linear(1024, 256)).to(device)
    model.register_buffer("half_buffer", torch.randn(33, device=device).half())  # an odd size, another dtype
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if step:
        model(torch.randn(8, 512, device=device)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def _snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """A CPU copy of the model's and the optimizer's state dicts."""
    def cpu(x):
        return x.detach().cpu().clone() if isinstance(x, torch.Tensor) else x

    optim = optimizer.state_dict()
    return {"model": {k: cpu(v) for k, v in model.state_dict().items()},
            "optim": {i: {k: cpu(v) for k, v in s.items()} for i, s in optim["state"].items()}}


def test_sync_round_trip_is_exact_and_stays_on_the_device(tmp_path):
    model, optimizer = _model_and_optimizer()
    statekit.save(str(tmp_path / "ckpt"), {"model": model, "optim": optimizer})
    fresh_model, fresh_optimizer = _model_and_optimizer(seed=1, step=False)
    statekit.load(str(tmp_path / "ckpt"), {"model": fresh_model, "optim": fresh_optimizer})
    assert_state_equal(_snapshot(fresh_model, fresh_optimizer), _snapshot(model, optimizer))
    assert {t.device.type for t in fresh_model.state_dict().values()} == {"cuda"}
    assert {v.device.type for s in fresh_optimizer.state.values() for k, v in s.items() if k != "step"} == {"cuda"}


def test_async_save_holds_the_state_of_the_moment_it_returns(tmp_path):
    """The device-to-host copies are non-blocking; the save returns only once they are
    done, so changing the weights right after (as the next training step does) must not
    reach the checkpoint."""
    model, optimizer = _model_and_optimizer()
    before = _snapshot(model, optimizer)
    manager = statekit.CheckpointManager({"model": model, "optim": optimizer}, str(tmp_path), async_save=True)
    pending = manager.save(step=1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    manager.wait()
    assert pending.done()
    fresh_model, fresh_optimizer = _model_and_optimizer(seed=1, step=False)
    statekit.load(manager.url_for(1), {"model": fresh_model, "optim": fresh_optimizer})
    assert_state_equal(_snapshot(fresh_model, fresh_optimizer), before)


def test_async_saves_stage_into_reused_pinned_buffers(tmp_path):
    model, optimizer = _model_and_optimizer()
    manager = statekit.CheckpointManager({"model": model, "optim": optimizer}, str(tmp_path), async_save=True)
    manager.save(step=1)
    manager.wait()
    allocated = manager.staging.allocated_bytes
    assert allocated >= sum(t.numel() * t.element_size() for t in model.state_dict().values())
    arenas = {rel: arena for rel, (_, arena, _) in manager.staging._arenas.items()}
    assert arenas["model.safetensors"].is_pinned() and arenas["optim.safetensors"].is_pinned()
    manager.save(step=2)
    manager.wait()
    assert manager.staging.allocated_bytes == allocated  # same shapes: nothing allocated again
    fresh_model, fresh_optimizer = _model_and_optimizer(seed=1, step=False)
    statekit.load(manager.url_for(2), {"model": fresh_model, "optim": fresh_optimizer})
    assert_state_equal(_snapshot(fresh_model, fresh_optimizer), _snapshot(model, optimizer))


@pytest.mark.parametrize("saved_on, loaded_on", [("cuda", "cpu"), ("cpu", "cuda")])
def test_a_checkpoint_moves_between_cpu_and_cuda_exactly(tmp_path, saved_on, loaded_on):
    model, optimizer = _model_and_optimizer(device=saved_on)
    statekit.save(str(tmp_path / "ckpt"), {"model": model, "optim": optimizer})
    fresh_model, fresh_optimizer = _model_and_optimizer(seed=1, device=loaded_on, step=False)
    statekit.load(str(tmp_path / "ckpt"), {"model": fresh_model, "optim": fresh_optimizer})
    assert_state_equal(_snapshot(fresh_model, fresh_optimizer), _snapshot(model, optimizer))
    assert next(fresh_model.parameters()).device.type == loaded_on


def test_accelerate_on_cuda_resumes_bit_for_bit(tmp_path, installed_plugin_manager):
    """A user's Accelerate loop on the GPU (dropout draws from the CUDA generator, the
    loader shuffles on the CPU): save, train on, resume in a fresh Accelerator, and the
    same steps give the same losses."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    def run(seed: int):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        accelerator = Accelerator()
        torch.manual_seed(seed)
        g = torch.Generator().manual_seed(99)
        data = torch.utils.data.TensorDataset(torch.randn(96, 16, generator=g), torch.randint(0, 4, (96,), generator=g))
        model = nn.Sequential(nn.Linear(16, 64), nn.Dropout(0.3), nn.ReLU(), nn.Linear(64, 4))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, 50) / 50)))
        loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)
        prepared = accelerator.prepare(model, optimizer, loader, scheduler)
        statekit.attach(accelerator)  # tracks the loader's position from the first epoch on
        return accelerator, *prepared

    def steps(parts, n: int, batches) -> list[float]:
        accelerator, model, optimizer, _, scheduler = parts
        losses = []
        for _ in range(n):
            x, y = next(batches)
            loss = nn.functional.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    first = run(0)
    assert next(first[1].parameters()).device.type == "cuda"
    batches = iter(first[3])
    steps(first, 3, batches)
    statekit.save_state(first[0], str(tmp_path / "ckpt"))
    expected = steps(first, 5, batches)

    second = run(1)
    statekit.load_state(second[0], str(tmp_path / "ckpt"))
    assert steps(second, 5, iter(second[3])) == expected  # the loader resumes at batch 3 by itself


def test_an_incremental_save_on_the_gpu_compares_unchanged_weights_on_the_device(tmp_path, monkeypatch):
    """A frozen base on the GPU is recognised unchanged by its device digest: nothing of it
    is hashed on the host (no PrefixCheck), and every checkpoint resumes exactly."""
    from statekit.format import tensors as tensor_files

    torch.manual_seed(0)
    base = nn.Linear(1024, 1024).cuda().requires_grad_(False)
    adapter = nn.Linear(1024, 8, bias=False).cuda()
    model = nn.ModuleDict({"base": base, "adapter": adapter})
    optimizer = torch.optim.AdamW(adapter.parameters(), lr=1e-2)

    def step():
        x = torch.randn(4, 1024, device="cuda")
        (model["base"](x).sum() + model["adapter"](x).square().sum()).backward()
        optimizer.step()
        optimizer.zero_grad()

    manager = statekit.CheckpointManager({"model": model, "optim": optimizer}, str(tmp_path / "run"))
    step()
    first = manager.save(1)
    frozen = "model.frozen-00000.safetensors"
    assert first.files[frozen].digest.startswith("mix64:")
    host_compares = []
    monkeypatch.setattr(tensor_files, "PrefixCheck", lambda *a, **k: host_compares.append(a))
    step()
    second = manager.save(2)
    assert second.files[frozen].reused_from == "checkpoint-00000001"
    assert host_compares == []
    fresh = nn.ModuleDict({"base": nn.Linear(1024, 1024), "adapter": nn.Linear(1024, 8, bias=False)}).cuda()
    statekit.load(str(tmp_path / "run" / "checkpoint-00000002"), {"model": fresh})
    for (name, x), y in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(x, y), name


def test_a_frozen_weight_edited_on_a_side_stream_is_written_again(tmp_path):
    """The comparison's worker threads read on their own streams: the save waits for the
    caller's current stream first, so an in-place edit still queued there is seen."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"base": nn.Linear(1024, 1024).requires_grad_(False), "adapter": nn.Linear(1024, 8)}).cuda()
    manager = statekit.CheckpointManager({"model": model}, str(tmp_path / "run"))
    manager.save(1)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # the edit below runs only after this, long after save() began
        model["base"].weight.mul_(2)
        second = manager.save(2)
    assert second.files["model.frozen-00000.safetensors"].reused_from is None
    fresh = nn.ModuleDict({"base": nn.Linear(1024, 1024), "adapter": nn.Linear(1024, 8)}).cuda()
    statekit.load(str(tmp_path / "run" / "checkpoint-00000002"), {"model": fresh})
    assert torch.equal(fresh["base"].weight, model["base"].weight)
