"""Gradient accumulation by hand: a checkpoint between a loop's own optimizer steps resumes bit for bit.

The loop of Accelerate's ``examples/complete_nlp_example.py`` (huggingface/accelerate @16cb6eb,
``training_function``): ``gradient_accumulation_steps`` is the script's own argument, not
Accelerate's, so ``Accelerator`` counts nothing; the loss is divided by it, and
``optimizer.step(); lr_scheduler.step(); optimizer.zero_grad()`` run every k-th batch. Its
``--checkpointing_steps`` saves after any batch, so a checkpoint can hold a backward that
no optimizer step consumed yet. Without those gradients the first step after the resume
sums only the later micro-batches (shown below). The gradients a step left behind
(``zero_grad`` at the loop's start) are not written.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import statekit
from statekit.engine import gradients
from statekit.format.manifest import read_manifest
from statekit.storage.fs import Storage
from statekit.testing import assert_state_equal

from accelerate_helpers import batches, build

pytest.importorskip("accelerate")

K = 2  # complete_nlp_example's gradient_accumulation_steps (its own, by hand)


def _by_hand(run, count: int, start: int = 0) -> list[float]:
    """complete_nlp_example's loop body: ``step`` counts batches from 0; steps at ``step % K == 0``."""
    accelerator, model, optimizer, loader, scheduler, _ = run
    losses, source = [], batches(loader)
    for step in range(start, start + count):
        x, y = next(source)
        loss = F.cross_entropy(model(x), y) / K
        accelerator.backward(loss)
        if step % K == 0:
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _zero_first(run, count: int) -> None:
    """The other common loop shape: ``zero_grad`` before the backward, the step right after."""
    accelerator, model, optimizer, loader, scheduler, _ = run
    source = batches(loader)
    for _ in range(count):
        x, y = next(source)
        optimizer.zero_grad()
        accelerator.backward(F.cross_entropy(model(x), y))
        optimizer.step()
        scheduler.step()


def _attached(seed: int = 0):
    run = build(seed=seed)
    statekit.attach(run[0])
    return run


def _save(run, way: str, tmp_path) -> str:
    url = str(tmp_path / "ckpt")
    if way == "save_state":
        statekit.save_state(run[0], url)
    elif way == "manager":
        url = statekit.CheckpointManager(run[0], str(tmp_path / "root")).save(1)
    else:
        run[0].save_state(url)
    return url


def _load(run, way: str, url: str, tmp_path) -> None:
    if way == "save_state":
        statekit.load_state(run[0], url)
    elif way == "manager":
        assert statekit.CheckpointManager(run[0], str(tmp_path / "root")).resume() == 1
    else:
        run[0].load_state(url)


@pytest.mark.parametrize("way", ["save_state", "manager", "attach"])
def test_saved_between_the_loops_own_steps_resumes_exactly(tmp_path, installed_plugin_manager, way):
    reference = _attached()
    expected = _by_hand(reference, 12)
    run = _attached()
    losses = _by_hand(run, 4)  # steps at batches 0 and 2; batch 3's backward is pending
    assert gradients.pending_by_hand(run[0])
    url = _save(run, way, tmp_path)
    assert (tmp_path / ("root/checkpoint-00000001" if way == "manager" else "ckpt") / "gradients" / "rank-00000.safetensors").exists()
    del run
    resumed = _attached(seed=5)
    _load(resumed, way, url, tmp_path)
    assert resumed[0].sync_gradients  # the loop's own optimizer.step() must not be a no-op
    losses += _by_hand(resumed, 8, start=4)
    assert losses == expected
    assert_state_equal(resumed[1].state_dict(), reference[1].state_dict())
    assert_state_equal(resumed[2].state_dict(), reference[2].state_dict())


def test_without_the_pending_gradients_the_resume_is_wrong(tmp_path, installed_plugin_manager, monkeypatch):
    """The test above can fail: with the detection off, the resumed run differs."""
    reference = _attached()
    expected = _by_hand(reference, 12)
    monkeypatch.setattr(gradients, "pending_by_hand", lambda accelerator: False)
    run = _attached()
    losses = _by_hand(run, 4)
    statekit.save_state(run[0], str(tmp_path / "c"))
    resumed = _attached(seed=5)
    statekit.load_state(resumed[0], str(tmp_path / "c"))
    losses += _by_hand(resumed, 8, start=4)
    assert losses != expected


@pytest.mark.parametrize("way", ["save_state", "attach"])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_gradients_a_step_consumed_are_not_written(tmp_path, installed_plugin_manager, set_to_none, way):
    run = _attached()
    _zero_first(run, 3)  # the last step's gradients are still in .grad
    assert all(p.grad is not None for p in run[1].parameters())
    if not set_to_none:
        run[2].zero_grad(set_to_none=False)  # zeros: nothing pending either
    assert not gradients.pending_by_hand(run[0])
    _save(run, way, tmp_path)
    manifest = read_manifest(Storage(str(tmp_path / "ckpt")))
    assert "gradients" not in manifest.objects
    assert not any(p.startswith("gradients/") for p in manifest.files)


def test_a_backward_after_the_step_is_pending(installed_plugin_manager):
    run = _attached()
    _zero_first(run, 2)
    assert not gradients.pending_by_hand(run[0])
    x, y = next(batches(run[3]))
    run[0].backward(F.cross_entropy(run[1](x), y))  # accumulates into the consumed .grad in place
    assert gradients.pending_by_hand(run[0])
    run[2].step()
    assert not gradients.pending_by_hand(run[0])
    run[2].zero_grad()
    assert not gradients.pending_by_hand(run[0])
    with torch.no_grad():
        next(iter(run[1].parameters())).grad = torch.ones(16, 6)  # set by hand: no step consumed it
    assert gradients.pending_by_hand(run[0])
