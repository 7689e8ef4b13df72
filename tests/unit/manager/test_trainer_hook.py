"""statekit.CheckpointHook and TrainerProgress in-process: saves every N steps and at an
epoch's end once per step, waits for an async save at the loop's end, refuses loudly (a save
mid-step, progress the manager does not save, bad settings, a checkpoint whose step is not the
progress), and works with Accelerate. The example trainer killed and resumed in real processes
is ``integration/trainings/test_hook_trainer.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import statekit


def _run_objects():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    progress = statekit.TrainerProgress()
    return model, optimizer, progress, {"model": model, "optimizer": optimizer, "trainer": progress}


def _train_step(model, optimizer, progress, accum: int = 2) -> None:
    for _ in range(accum):
        model(torch.randn(3, 4)).sum().backward()
        progress.finish_micro_batch()
    optimizer.step()
    optimizer.zero_grad()
    progress.finish_step()


def test_hook_saves_every_n_steps_and_at_epoch_end_once_per_step(tmp_path: Path):
    model, optimizer, progress, objects = _run_objects()
    hook = statekit.CheckpointHook(
        statekit.CheckpointManager(objects, str(tmp_path)), progress, every_n_steps=2, every_n_epochs=1
    )
    assert hook.on_loop_begin(None) is None
    saved = []
    for _ in range(3):  # an epoch of 3 steps: saves at step 2 (step end) and step 3 (epoch end)
        _train_step(model, optimizer, progress)
        saved.append(hook.on_step_end(None))
    progress.finish_epoch()
    saved.append(hook.on_epoch_end(None))
    assert [m is not None and m.step for m in saved] == [False, 2, False, 3]
    for _ in range(1):  # an epoch of one step, step 4: saved at its step end, not again at its epoch end
        _train_step(model, optimizer, progress)
        assert hook.on_step_end(None).step == 4
    progress.finish_epoch()
    assert hook.on_epoch_end(None) is None
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == [
        "checkpoint-00000002", "checkpoint-00000003", "checkpoint-00000004"
    ]

    model2, optimizer2, progress2, objects2 = _run_objects()
    resumed = statekit.CheckpointHook(statekit.CheckpointManager(objects2, str(tmp_path)), progress2, every_n_steps=2)
    assert resumed.on_loop_begin(None) == 4 and resumed.resumed_step == 4
    # saved at step 4's step end, before finish_epoch(): the resumed trainer runs that epoch's end
    assert progress2 == statekit.TrainerProgress(epoch=1, step_in_epoch=1, global_step=4, micro_batch=0)
    for name, value in model.state_dict().items():
        assert torch.equal(model2.state_dict()[name], value)
    assert resumed.on_step_end(None) is None  # step 4 is where it resumed: not saved again


def test_hook_waits_for_an_async_save_at_loop_end(tmp_path: Path):
    model, optimizer, progress, objects = _run_objects()
    manager = statekit.CheckpointManager(objects, str(tmp_path), async_save=True)
    hook = statekit.CheckpointHook(manager, progress, every_n_steps=1)
    _train_step(model, optimizer, progress)
    hook.on_step_end(None)
    assert manager.pending is not None
    manifest = hook.on_loop_end(None)
    assert manifest.step == 1 and manager.pending is None
    assert (tmp_path / "checkpoint-00000001" / "statekit.json").is_file()
    assert hook.on_loop_end(None) is None


def test_hook_refuses_a_save_in_the_middle_of_a_step(tmp_path: Path):
    model, optimizer, progress, objects = _run_objects()
    hook = statekit.CheckpointHook(statekit.CheckpointManager(objects, str(tmp_path)), progress, every_n_steps=1)
    _train_step(model, optimizer, progress)
    model(torch.randn(3, 4)).sum().backward()
    progress.finish_micro_batch()  # one micro-batch of step 2 accumulated; global_step is still 1
    with pytest.raises(statekit.StatekitError, match=r"on_step_end at step 1: progress.micro_batch is 1"):
        hook.on_step_end(None)
    assert not list(tmp_path.glob("checkpoint-*"))


def test_hook_refuses_progress_the_manager_does_not_save(tmp_path: Path):
    model, optimizer, progress, _ = _run_objects()
    manager = statekit.CheckpointManager({"model": model, "optimizer": optimizer}, str(tmp_path))
    with pytest.raises(statekit.InvalidOptionError, match=r"progress object \(TrainerProgress\) is not among the objects the manager saves"):
        statekit.CheckpointHook(manager, progress, every_n_steps=1)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, r"give every_n_steps and/or every_n_epochs"),
        ({"every_n_steps": 0}, r"every_n_steps must be a positive int or None, got 0"),
        ({"every_n_epochs": True}, r"every_n_epochs must be a positive int or None, got True"),
    ],
)
def test_hook_refuses_bad_settings(tmp_path: Path, options, message):
    _, _, progress, objects = _run_objects()
    with pytest.raises(statekit.InvalidOptionError, match=message):
        statekit.CheckpointHook(statekit.CheckpointManager(objects, str(tmp_path)), progress, **options)


def test_hook_refuses_a_checkpoint_whose_step_is_not_the_progress(tmp_path: Path):
    model, optimizer, progress, objects = _run_objects()
    _train_step(model, optimizer, progress)
    statekit.CheckpointManager(objects, str(tmp_path)).save(7)  # named by something else than global_step
    _, _, progress2, objects2 = _run_objects()
    hook = statekit.CheckpointHook(statekit.CheckpointManager(objects2, str(tmp_path)), progress2, every_n_steps=1)
    with pytest.raises(statekit.StateMismatchError, match=r"global_step 1, but the checkpoint is step 7"):
        hook.on_loop_begin(None)


def test_trainer_progress_refuses_a_bad_state():
    progress = statekit.TrainerProgress()
    missing = r"state of TrainerProgress does not match the checkpoint; missing keys: micro_batch$"
    with pytest.raises(statekit.StateMismatchError, match=missing):
        progress.load_state_dict({"epoch": 1, "step_in_epoch": 0, "global_step": 3})
    with pytest.raises(statekit.StateMismatchError, match=r"global_step \(saved -1 vs expected a non-negative int\)"):
        progress.load_state_dict({"epoch": 1, "step_in_epoch": 0, "global_step": -1, "micro_batch": 0})
    assert progress == statekit.TrainerProgress()


def test_every_channel_of_the_trainer_shape_is_a_method():
    _, _, progress, objects = _run_objects()
    hook = statekit.CheckpointHook(statekit.CheckpointManager(objects, "memory://hook-channels"), progress, every_n_steps=1)
    for loop in ("loop", "epoch", "step", "batch", "model_forward", "model_backward"):
        for edge in ("begin", "end"):
            assert callable(getattr(hook, f"on_{loop}_{edge}"))
    assert hook.on_batch_end(None) is None and hook.on_model_backward_begin(None) is None


def test_hook_with_accelerate(tiny_accelerate, tmp_path: Path):
    run = tiny_accelerate
    progress = statekit.TrainerProgress()
    with pytest.raises(statekit.InvalidOptionError, match=r"register_for_checkpointing"):
        statekit.CheckpointHook(statekit.CheckpointManager(run.accelerator, str(tmp_path)), progress, every_n_steps=1)
    run.accelerator.register_for_checkpointing(progress)
    hook = statekit.CheckpointHook(statekit.CheckpointManager(run.accelerator, str(tmp_path)), progress, every_n_steps=2)
    hook.on_loop_begin(None)
    batches = iter(run.loader)
    for _ in range(2):
        run.train_step(next(batches))
        progress.finish_micro_batch()
        progress.finish_step()
        hook.on_step_end(None)
    saved_weights = {k: v.clone() for k, v in run.model.state_dict().items()}
    progress.global_step = 0  # as a fresh run would start
    for param in run.model.parameters():
        param.data.zero_()
    assert hook.on_loop_begin(None) is None  # only a hook's first loop begin resumes
    assert progress.global_step == 0
    again = statekit.CheckpointHook(statekit.CheckpointManager(run.accelerator, str(tmp_path)), progress, every_n_steps=2)
    assert again.on_loop_begin(None) == 2
    assert progress.global_step == 2 and progress.step_in_epoch == 2
    for name, value in saved_weights.items():
        assert torch.equal(run.model.state_dict()[name], value)
