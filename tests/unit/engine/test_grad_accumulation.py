"""Gradient accumulation: a checkpoint between optimizer steps resumes bit for bit.

``Accelerator(gradient_accumulation_steps=n)`` keeps the sum of the micro-batches since
the last optimizer step in ``.grad``; a resume that loses it steps with part of the
gradient (issue 13: losses matched up to micro-batch 7, then 1.0156 vs 1.0256). Every
test compares the resumed run with an uninterrupted one: per-micro-batch losses, weights
and optimizer state, exactly.
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

import statekit
from statekit.engine.context import Checkpoint
from statekit.errors import StatekitError, StateMismatchError
from statekit.format.manifest import read_manifest
from statekit.storage.fs import Storage
from statekit.testing import assert_state_equal

from accelerate_helpers import build, train_micro_batches

pytest.importorskip("accelerate")


def _attached(**kwargs):
    run = build(**kwargs)
    statekit.attach(run[0])
    return run


def _reference(total: int, **kwargs):
    run = _attached(**kwargs)
    return run, train_micro_batches(run, total)


def _assert_same_run(resumed, reference) -> None:
    assert_state_equal(resumed[1].state_dict(), reference[1].state_dict())
    assert_state_equal(resumed[2].state_dict(), reference[2].state_dict())
    assert resumed[4].state_dict() == reference[4].state_dict()
    assert resumed[5].state_dict() == reference[5].state_dict()


def _saved_state(url: str, key: str):
    storage = Storage(url)
    return Checkpoint(storage, mode="load", manifest=read_manifest(storage)).load_state(key)


def _gradient_files(manifest) -> list[str]:
    return sorted(p for p in manifest.files if p.startswith("gradients/"))


@pytest.mark.parametrize("way", ["save_state", "manager", "attach"])
def test_save_mid_accumulation_resumes_exactly(tmp_path, installed_plugin_manager, way):
    """Saved after 6 micro-batches with accumulation 4 (2 into the second window)."""
    reference, expected = _reference(20, accum=4)
    run = _attached(accum=4)
    losses = train_micro_batches(run, 6)
    assert not run[0].sync_gradients
    url = str(tmp_path / "ckpt")
    if way == "save_state":
        statekit.save_state(run[0], url)
    elif way == "manager":
        url = statekit.CheckpointManager(run[0], str(tmp_path / "root")).save(6)
    else:
        run[0].save_state(url)

    saved = {n: p.grad.clone() for n, p in run[0].unwrap_model(run[1]).named_parameters()}
    del run  # the process dies; a new one resumes with freshly seeded objects
    resumed = _attached(accum=4, seed=5)
    if way == "save_state":
        statekit.load_state(resumed[0], url)
    elif way == "manager":
        assert statekit.CheckpointManager(resumed[0], str(tmp_path / "root")).resume() == 6
    else:
        resumed[0].load_state(url)
    for name, p in resumed[0].unwrap_model(resumed[1]).named_parameters():
        assert torch.equal(p.grad, saved[name]), name
    assert resumed[0].step == 6 and not resumed[0].sync_gradients
    losses += train_micro_batches(resumed, 14, start=6)
    assert losses == expected
    _assert_same_run(resumed, reference)


def test_without_the_gradients_the_resume_is_wrong(tmp_path, installed_plugin_manager, monkeypatch):
    """The check above can fail: dropping the saved gradients changes the weights."""
    from statekit.engine import gradients

    reference, expected = _reference(12, accum=4)
    run = _attached(accum=4)
    losses = train_micro_batches(run, 6)
    monkeypatch.setattr(gradients.AccumulatedGradients, "state_dict", lambda self: {"accumulating": False})
    statekit.save_state(run[0], str(tmp_path / "c"))
    resumed = _attached(accum=4, seed=5)
    statekit.load_state(resumed[0], str(tmp_path / "c"))
    losses += train_micro_batches(resumed, 6, start=6)
    assert losses[:8] == expected[:8]  # the micro-batches before the first step after the resume
    assert losses[8:] != expected[8:]
    assert not torch.equal(resumed[1].fc1.weight, reference[1].fc1.weight)


def test_save_in_the_last_window_of_an_epoch(tmp_path, installed_plugin_manager):
    """13 batches per epoch, accumulation 5: Accelerate forces a sync at batch 13, so the
    last window is 11..13; saved after 12, the resumed run steps at 13 with 3 micro-batches
    and starts the next epoch with a fresh window."""
    reference, expected = _reference(30, accum=5, n=100, batch_size=8)
    run = _attached(accum=5, n=100, batch_size=8)
    losses = train_micro_batches(run, 12)
    assert run[0].step == 12 and not run[0].sync_gradients
    statekit.save_state(run[0], str(tmp_path / "c"))
    resumed = _attached(accum=5, n=100, batch_size=8, seed=5)
    statekit.load_state(resumed[0], str(tmp_path / "c"))
    steps_seen = []
    losses += train_micro_batches(resumed, 18, start=12, on_step=lambda i: steps_seen.append(resumed[0].sync_gradients))
    assert steps_seen[0] is True  # batch 13 ended the epoch: forced sync
    assert losses == expected
    _assert_same_run(resumed, reference)


def test_sync_point_writes_no_gradients(tmp_path, installed_plugin_manager):
    run = _attached(accum=4)
    train_micro_batches(run, 8)
    assert run[0].sync_gradients
    manifest = statekit.save_state(run[0], str(tmp_path / "sync"))
    assert _gradient_files(manifest) == ["gradients/rank-00000.json"]
    assert _saved_state(str(tmp_path / "sync"), "gradients/rank-00000") == {"accumulating": False}

    train_micro_batches(run, 3, start=8)
    manifest = statekit.save_state(run[0], str(tmp_path / "mid"))
    assert _gradient_files(manifest) == ["gradients/rank-00000.json", "gradients/rank-00000.safetensors"]
    model = run[0].unwrap_model(run[1])
    with safe_open(str(tmp_path / "mid" / "gradients" / "rank-00000.safetensors"), "pt") as f:
        assert len(f.keys()) == len(list(model.parameters()))


def test_no_accumulation_writes_no_gradient_entry(tmp_path, installed_plugin_manager):
    run = _attached()
    train_micro_batches(run, 3)
    manifest = statekit.save_state(run[0], str(tmp_path / "c"))
    assert "gradients" not in manifest.objects and not _gradient_files(manifest)


def test_gradients_that_do_not_fit_leave_the_model_untouched(tmp_path, installed_plugin_manager):
    run = _attached(accum=4)
    train_micro_batches(run, 2)
    statekit.save_state(run[0], str(tmp_path / "c"))
    other = _attached(accum=4, seed=3)
    bigger = torch.nn.Linear(6, 16)
    other[0].unwrap_model(other[1]).fc1 = bigger.to(torch.float64)
    before = {k: v.clone() for k, v in other[1].state_dict().items()}
    with pytest.raises(StateMismatchError, match=r"fc1\.weight"):
        statekit.load_state(other[0], str(tmp_path / "c"))
    for p in other[0].unwrap_model(other[1]).parameters():
        assert p.grad is None
    assert_state_equal(other[1].state_dict(), before)


def test_deepspeed_mid_accumulation_is_refused(tmp_path, installed_plugin_manager, monkeypatch):
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    run = _attached(accum=4)
    train_micro_batches(run, 4)
    statekit.save_state(run[0], str(tmp_path / "c"))  # a sync point: fine anywhere
    train_micro_batches(run, 2, start=4)
    monkeypatch.setattr(Accelerator, "distributed_type", property(lambda self: DistributedType.DEEPSPEED))
    with pytest.raises(StatekitError, match=r"DeepSpeed.*gradient_accumulation_steps=4.*sync_gradients is True"):
        statekit.save_state(run[0], str(tmp_path / "c2"))
    assert not (tmp_path / "c2").exists()  # refused before anything is written
    statekit.verify(str(tmp_path / "c"))  # the previous checkpoint is intact
    assert _saved_state(str(tmp_path / "c"), "gradients/rank-00000") == {"accumulating": False}


def test_sharded_model_mid_accumulation_is_refused():
    from statekit.engine.gradients import refuse_unsupported

    class FullyShardedDataParallel(torch.nn.Module):  # recognised by type name, as torch's FSDP1 wrapper
        pass

    class FakeAccelerator:
        gradient_accumulation_steps, step, distributed_type = 4, 2, "DistributedType.FSDP"

    with pytest.raises(StatekitError, match=r"FullyShardedDataParallel \(FSDP\).*statekit-fsdp.*sync_gradients is True"):
        refuse_unsupported(FakeAccelerator(), [FullyShardedDataParallel()])
    refuse_unsupported(FakeAccelerator(), [torch.nn.Linear(2, 2)])  # replicated: fine


def test_other_accumulation_steps_is_refused_before_loading(tmp_path, installed_plugin_manager):
    from statekit.engine.gradients import AccumulatedGradients

    run = _attached(accum=4)
    train_micro_batches(run, 6)
    statekit.save_state(run[0], str(tmp_path / "c"))
    state = AccumulatedGradients(run[0]).state_dict()
    other = _attached(accum=2, seed=3)
    before = {k: v.clone() for k, v in other[1].state_dict().items()}
    with pytest.raises(statekit.ResumeMismatchError, match=r"gradient accumulation steps 4 -> 2: .*mid-accumulation"):
        statekit.load_state(other[0], str(tmp_path / "c"))
    assert_state_equal(other[1].state_dict(), before)  # the fingerprint is compared before loading
    # and the gradients themselves refuse a window they cannot complete
    with pytest.raises(StateMismatchError, match=r"gradient_accumulation_steps=4 \(micro-batch 6\); this run has 2"):
        AccumulatedGradients(other[0]).load_state_dict(state)


def test_checkpoint_without_gradients_loads_into_an_accumulating_run(tmp_path, installed_plugin_manager):
    """Saved without accumulation: the accumulating run resumes at a window start (the
    fingerprint warns about the changed setting; the load itself succeeds)."""
    run = _attached()
    train_micro_batches(run, 3)
    statekit.save_state(run[0], str(tmp_path / "c"))
    other = _attached(accum=2, seed=3)
    with pytest.warns(statekit.ResumeFingerprintWarning, match=r"gradient accumulation steps 1 -> 2"):
        statekit.load_state(other[0], str(tmp_path / "c"))
    assert_state_equal(other[1].state_dict(), run[1].state_dict())
    assert all(p.grad is None for p in other[1].parameters())


def test_accelerate_directory_loads_into_an_accumulating_run(tmp_path, installed_plugin_manager):
    """Accelerate's own checkpoint has no gradients: its custom object goes to
    ``custom_0``, never to the gradients (both are custom objects)."""
    run = build(accum=4)  # not attached: Accelerate writes its own format
    train_micro_batches(run, 4)
    run[5].count = 41
    run[0].save_state(str(tmp_path / "acc"))
    other = build(accum=4, seed=3)
    statekit.load_state(other[0], str(tmp_path / "acc"), allow_pickle=True)
    assert other[5].count == 41
    assert_state_equal(other[1].state_dict(), run[1].state_dict())


def test_accelerate_directory_saved_mid_window_warns(tmp_path, installed_plugin_manager):
    """Accelerate's own checkpoint between optimizer steps has no gradients: loading it
    into an accumulating run says the resume is not exact."""
    run = build(accum=4)  # not attached: Accelerate writes its own format
    train_micro_batches(run, 2)
    run[0].save_state(str(tmp_path / "acc"))
    other = build(accum=4, seed=3)
    with pytest.warns(statekit.StatekitWarning, match=r"micro-batch 2 of gradient_accumulation_steps=4\) and holds no accumulated"):
        statekit.load_state(other[0], str(tmp_path / "acc"), allow_pickle=True)


@pytest.mark.parametrize("way", ["save_state", "attach"])
def test_the_accumulated_gradients_are_state_checked(tmp_path, installed_plugin_manager, monkeypatch, way):
    """The gradients mid-accumulation (each rank's own) are digested under
    ``gradients/rank-<r>`` and compared after the load: a load path that loses one is named."""
    from statekit.engine import gradients

    run = _attached(accum=4)
    train_micro_batches(run, 6)
    url = str(tmp_path / "ckpt")
    if way == "save_state":
        manifest = statekit.save_state(run[0], url)
    else:
        run[0].save_state(url)
        manifest = read_manifest(Storage(url))
    recorded = manifest.state_digest.objects["gradients/rank-00000"]
    assert {p for p in recorded if p.startswith("grads.model_0.")} == {
        f"grads.model_0.{n}" for n, p in run[0].unwrap_model(run[1]).named_parameters()}

    clean = _attached(accum=4, seed=5)[0]
    statekit.load_state(clean, url) if way == "save_state" else clean.load_state(url)  # no warning (filterwarnings)
    load = gradients.AccumulatedGradients.load_state_dict

    def loses_one(self, state):
        load(self, state)
        self._models()[0].fc1.weight.grad.zero_()

    monkeypatch.setattr(gradients.AccumulatedGradients, "load_state_dict", loses_one)
    resumed = _attached(accum=4, seed=5)
    with pytest.warns(statekit.StateCheckWarning, match=r"custom 'gradients': grads\.model_0\.fc1\.weight is all zeros"):
        statekit.load_state(resumed[0], url) if way == "save_state" else resumed[0].load_state(url)


def test_large_accumulated_gradients_are_checked_with_the_saves_sampling(tmp_path, installed_plugin_manager):
    """Gradients of >= 65,536 elements are sampled like the rest of the save (the check
    recomputes them with the recorded sampling): a clean resume is no false alarm."""
    from accelerate_helpers import fresh_accelerator

    def run(seed):
        torch.manual_seed(seed)
        accelerator = fresh_accelerator(accum=4)
        model = torch.nn.Linear(512, 512)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        return (accelerator, *accelerator.prepare(model, optimizer))

    accelerator, model, optimizer = run(0)
    with accelerator.accumulate(model):
        accelerator.backward(model(torch.randn(4, 512)).sum())
    assert not accelerator.sync_gradients
    manifest = statekit.save_state(accelerator, str(tmp_path / "ckpt"))
    assert manifest.state_digest.sampling["stride"] > manifest.state_digest.sampling["block"]  # sampled
    assert "grads.model_0.weight" in manifest.state_digest.objects["gradients/rank-00000"]
    statekit.load_state(run(1)[0], str(tmp_path / "ckpt"))  # any StateCheckWarning fails (filterwarnings)
