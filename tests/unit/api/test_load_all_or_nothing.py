"""A load that refuses leaves the run as it was: every path checks the whole load (models,
optimizers, schedulers, custom objects) before it copies anything, optimizer state shapes
included, and a damaged Accelerate pickle is a named CorruptCheckpointError.

Written as a user writes it: Accelerator().prepare(), statekit.save_state/load_state,
CheckpointManager, statekit.attach + accelerator.save_state/load_state, statekit.save/load.
"""

from __future__ import annotations

import copy
import re
import threading
from typing import Any

import pytest
import torch
from torch import nn

import statekit
from statekit.testing import assert_state_equal
from accelerate_helpers import fresh_accelerator

FROZEN = "2.weight"


def make_run(seed: int = 0, freeze: str | None = None, reverse: bool = False, custom: Any = None, attach: bool = False):
    """A prepared run of a 6-layer model (12 tensors), AdamW and a StepLR, trained 2 steps.

    ``freeze``: that parameter is frozen and left out of the optimizer (as a user who
    fine-tunes part of a model builds it); ``reverse``: the optimizer gets the parameters
    in reverse order (same count, other shapes at each position)."""
    accelerator = fresh_accelerator()
    if attach:
        statekit.attach(accelerator)
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)])
    if freeze is not None:
        model.get_parameter(freeze).requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params[::-1] if reverse else params, lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    if custom is not None:
        accelerator.register_for_checkpointing(custom)
    for _ in range(2):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return accelerator, model, optimizer, scheduler


def snapshot(model: nn.Module, optimizer: Any, scheduler: Any) -> dict[str, Any]:
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer": copy.deepcopy(optimizer.state_dict()),
        "scheduler": copy.deepcopy(scheduler.state_dict()),
    }


def assert_untouched(before: dict[str, Any], model: nn.Module, optimizer: Any, scheduler: Any) -> None:
    """Every model tensor, the optimizer state and the scheduler are byte-identical to before."""
    assert_state_equal(snapshot(model, optimizer, scheduler), before)


# ------------------------------------------------------------ a parameter frozen since the save


def _frozen_message(message: str) -> None:
    assert "parameter group 0: 12 parameters saved, the optimizer has 11" in message
    # where the lists part: the first parameter whose saved state has another shape
    assert "they part at 2.bias (group 0, index 4): its saved state has shape [8, 8]" in message
    assert "nothing was loaded" in message


def test_load_state_refuses_frozen_parameter_before_copying_anything(tmp_path):
    accelerator, model, optimizer, scheduler = make_run(seed=0)
    statekit.save_state(accelerator, str(tmp_path / "ckpt"))
    accelerator, model, optimizer, scheduler = make_run(seed=1, freeze=FROZEN)
    before = snapshot(model, optimizer, scheduler)
    with pytest.raises(statekit.StateMismatchError) as err:
        statekit.load_state(accelerator, str(tmp_path / "ckpt"))
    assert "optimizer 'optimizer_0'" in str(err.value) and "optimizer_0.json" in str(err.value)
    _frozen_message(str(err.value))
    assert_untouched(before, model, optimizer, scheduler)


def test_manager_resume_refuses_frozen_parameter_before_copying_anything(tmp_path):
    accelerator, model, optimizer, scheduler = make_run(seed=0)
    statekit.CheckpointManager(accelerator, str(tmp_path / "run")).save(2)
    accelerator, model, optimizer, scheduler = make_run(seed=1, freeze=FROZEN)
    before = snapshot(model, optimizer, scheduler)
    with pytest.raises(statekit.StateMismatchError) as err:
        statekit.CheckpointManager(accelerator, str(tmp_path / "run")).resume()
    _frozen_message(str(err.value))
    assert_untouched(before, model, optimizer, scheduler)


def test_attach_mode_refuses_frozen_parameter_before_accelerate_loads(tmp_path):
    accelerator, model, optimizer, scheduler = make_run(seed=0, attach=True)
    accelerator.save_state(str(tmp_path / "ckpt"))
    accelerator, model, optimizer, scheduler = make_run(seed=1, freeze=FROZEN, attach=True)
    before = snapshot(model, optimizer, scheduler)
    with pytest.raises(statekit.StateMismatchError) as err:
        accelerator.load_state(str(tmp_path / "ckpt"))
    assert "optimizer.bin" in str(err.value)
    _frozen_message(str(err.value))
    assert_untouched(before, model, optimizer, scheduler)


def test_attach_mode_folder_loaded_with_load_state_refuses_frozen_parameter(tmp_path):
    accelerator, model, optimizer, scheduler = make_run(seed=0, attach=True)
    accelerator.save_state(str(tmp_path / "ckpt"))
    accelerator, model, optimizer, scheduler = make_run(seed=1, freeze=FROZEN)
    before = snapshot(model, optimizer, scheduler)
    with pytest.raises(statekit.StateMismatchError) as err:
        statekit.load_state(accelerator, str(tmp_path / "ckpt"), allow_pickle=True)
    _frozen_message(str(err.value))
    assert_untouched(before, model, optimizer, scheduler)


def test_plain_accelerate_folder_refuses_frozen_parameter(tmp_path):
    accelerator, model, optimizer, scheduler = make_run(seed=0)
    accelerator.save_state(str(tmp_path / "ckpt"))  # no statekit: Accelerate's own folder
    accelerator, model, optimizer, scheduler = make_run(seed=1, freeze=FROZEN)
    before = snapshot(model, optimizer, scheduler)
    with pytest.raises(statekit.StateMismatchError) as err:
        statekit.load_state(accelerator, str(tmp_path / "ckpt"), allow_pickle=True)
    assert "optimizer.bin" in str(err.value)
    _frozen_message(str(err.value))
    assert_untouched(before, model, optimizer, scheduler)


def test_mapping_load_refuses_frozen_parameter(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    statekit.save(str(tmp_path / "ckpt"), {"model": model, "optim": optimizer})

    torch.manual_seed(1)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)])
    model.get_parameter(FROZEN).requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    before = {"model": {k: v.clone() for k, v in model.state_dict().items()}, "optim": copy.deepcopy(optimizer.state_dict())}
    with pytest.raises(statekit.StateMismatchError) as err:
        statekit.load(str(tmp_path / "ckpt"), {"model": model, "optim": optimizer})
    assert "optimizer 'optim'" in str(err.value)
    _frozen_message(str(err.value))
    assert_state_equal({"model": model.state_dict(), "optim": optimizer.state_dict()}, before)


# ------------------------------------------------------------ optimizer state of other shapes


def _shape_message(message: str) -> None:
    # the reversed optimizer's first parameter is 5.bias [8]; the state saved there is 0.weight's [8, 8]
    assert "5.bias (group 0, index 0) (exp_avg saved [8, 8] vs parameter [8])" in message
    assert "nothing was loaded" in message


def test_load_state_refuses_optimizer_state_of_other_shapes(tmp_path):
    accelerator, model, optimizer, scheduler = make_run(seed=0)
    statekit.save_state(accelerator, str(tmp_path / "ckpt"))
    accelerator, model, optimizer, scheduler = make_run(seed=1, reverse=True)
    before = snapshot(model, optimizer, scheduler)
    with pytest.raises(statekit.StateMismatchError) as err:
        statekit.load_state(accelerator, str(tmp_path / "ckpt"))
    _shape_message(str(err.value))
    assert_untouched(before, model, optimizer, scheduler)


def test_fresh_optimizer_refuses_state_of_other_shapes_at_load_not_at_step(tmp_path):
    """The resuming run has not stepped yet (its optimizer holds no state): torch would load
    the state and fail at the first optimizer.step() with a plain RuntimeError."""
    accelerator, model, optimizer, scheduler = make_run(seed=0)
    statekit.save_state(accelerator, str(tmp_path / "ckpt"))
    accelerator = fresh_accelerator()
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)])
    optimizer = torch.optim.AdamW(list(model.parameters())[::-1], lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    before = snapshot(model, optimizer, scheduler)
    with pytest.raises(statekit.StateMismatchError) as err:
        statekit.load_state(accelerator, str(tmp_path / "ckpt"))
    _shape_message(str(err.value))
    assert_untouched(before, model, optimizer, scheduler)


@pytest.mark.parametrize("saver", ["accelerate", "attached"])
def test_accelerate_folders_refuse_optimizer_state_of_other_shapes(tmp_path, saver):
    accelerator, model, optimizer, scheduler = make_run(seed=0, attach=saver == "attached")
    accelerator.save_state(str(tmp_path / "ckpt"))
    accelerator, model, optimizer, scheduler = make_run(seed=1, reverse=True, attach=saver == "attached")
    before = snapshot(model, optimizer, scheduler)
    with pytest.raises(statekit.StateMismatchError) as err:
        if saver == "attached":
            accelerator.load_state(str(tmp_path / "ckpt"))
        else:
            statekit.load_state(accelerator, str(tmp_path / "ckpt"), allow_pickle=True)
    _shape_message(str(err.value))
    assert_untouched(before, model, optimizer, scheduler)


def test_loads_that_fit_still_resume_exactly(tmp_path):
    """The checks refuse nothing that loads: a run frozen at save and load alike resumes."""
    accelerator, model, optimizer, scheduler = make_run(seed=0, freeze=FROZEN)
    saved = snapshot(model, optimizer, scheduler)
    statekit.save_state(accelerator, str(tmp_path / "ckpt"))
    accelerator, model, optimizer, scheduler = make_run(seed=1, freeze=FROZEN)
    statekit.load_state(accelerator, str(tmp_path / "ckpt"))
    assert_state_equal(snapshot(model, optimizer, scheduler), saved)


# ------------------------------------------------------------ an object that refuses after others loaded


class Picky:
    """A custom object that refuses a state with another ``version``."""

    def __init__(self, version: int) -> None:
        self.version, self.value = version, 0

    def state_dict(self) -> dict[str, int]:
        return {"version": self.version, "value": self.value}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["version"] != self.version:
            raise ValueError(f"state of version {state['version']}, this object is version {self.version}")
        self.value = state["value"]


def test_custom_object_refusing_puts_everything_back(tmp_path):
    accelerator, model, optimizer, scheduler = make_run(seed=0, custom=Picky(1))
    statekit.save_state(accelerator, str(tmp_path / "ckpt"))
    picky = Picky(2)
    accelerator, model, optimizer, scheduler = make_run(seed=1, custom=picky)
    before = snapshot(model, optimizer, scheduler)
    steps_before = accelerator.step
    with pytest.raises(statekit.StateMismatchError, match=r"custom 'custom_0' .*state of version 1, this object is version 2"):
        statekit.load_state(accelerator, str(tmp_path / "ckpt"))
    assert_untouched(before, model, optimizer, scheduler)
    assert accelerator.step == steps_before and picky.value == 0


# ------------------------------------------------------------ a truncated optimizer.bin


@pytest.mark.parametrize("how", ["load_state", "attached"])
def test_truncated_optimizer_bin_is_corrupt_checkpoint_error(tmp_path, how):
    accelerator, model, optimizer, scheduler = make_run(seed=0)
    accelerator.save_state(str(tmp_path / "ckpt"))  # plain Accelerate, safe_serialization default
    path = tmp_path / "ckpt" / "optimizer.bin"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    accelerator, model, optimizer, scheduler = make_run(seed=1, attach=how == "attached")
    before = snapshot(model, optimizer, scheduler)
    with pytest.raises(statekit.CorruptCheckpointError) as err:
        if how == "attached":
            accelerator.load_state(str(tmp_path / "ckpt"))
        else:
            statekit.load_state(accelerator, str(tmp_path / "ckpt"), allow_pickle=True)
    assert err.value.path == str(path)
    assert re.search(rf"{re.escape(str(path))}: cannot be read as a torch file \(truncated or damaged\)", str(err.value))
    if how == "load_state":
        assert "nothing was loaded" in str(err.value)
    assert_untouched(before, model, optimizer, scheduler)


# ------------------------------------------------------------ attach-mode saves commit like native ones


class Gate:
    """A custom object whose state_dict() blocks the save until released: Accelerate saves
    custom objects after the model, optimizer, scheduler and random states, so the folder
    then holds a complete-looking Accelerate checkpoint that is not committed."""

    def __init__(self) -> None:
        self.reached, self.release = threading.Event(), threading.Event()
        self.value = 0

    def state_dict(self) -> dict[str, int]:
        self.reached.set()
        assert self.release.wait(60)
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.value = state["value"]


def _save_in_thread(accelerator: Any, directory: str) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            accelerator.save_state(directory)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, errors


@pytest.mark.parametrize("earlier", [False, True], ids=["new-dir", "over-earlier-checkpoint"])
def test_attached_save_is_not_loadable_until_committed(tmp_path, earlier):
    gate = Gate()
    accelerator, model, optimizer, scheduler = make_run(seed=0, attach=True, custom=gate)
    directory = str(tmp_path / "ckpt")
    if earlier:  # an earlier attached save committed this directory: its manifest must not vouch for new files
        gate.release.set()
        accelerator.save_state(directory)
        gate.reached.clear()
        gate.release.clear()
    reader = make_run(seed=1, attach=True)  # the run that loads (another Accelerator state in this process)
    accelerator.step = 5
    thread, errors = _save_in_thread(accelerator, directory)
    try:
        assert gate.reached.wait(60)
        assert (tmp_path / "ckpt" / "optimizer.bin").exists()  # Accelerate has written its files
        before = snapshot(*reader[1:])
        being_saved = r"is being saved \(host .* pid \d+\) and is not committed yet"
        with pytest.raises(statekit.IncompleteCheckpointError, match=being_saved):
            statekit.load_state(reader[0], directory, allow_pickle=True)
        with pytest.raises(statekit.IncompleteCheckpointError, match=being_saved):
            reader[0].load_state(directory)  # attached: Accelerate's own load is stopped too
        assert_untouched(before, *reader[1:])
    finally:
        gate.release.set()
        thread.join(60)
    assert not errors
    assert not (tmp_path / "ckpt" / ".statekit-lock").exists()
    statekit.load_state(reader[0], directory, allow_pickle=True)  # committed: loads
    assert_state_equal(reader[1].state_dict(), model.state_dict())


def test_failed_attached_save_is_never_loaded(tmp_path):
    class Broken:
        def state_dict(self) -> dict[str, int]:
            raise OSError("disk full")

        def load_state_dict(self, state: dict[str, int]) -> None:
            pass

    accelerator, model, optimizer, scheduler = make_run(seed=0, attach=True, custom=Broken())
    with pytest.raises(OSError, match="disk full"):
        accelerator.save_state(str(tmp_path / "ckpt"))
    reader = make_run(seed=1, attach=True)
    before = snapshot(*reader[1:])
    never = "has no statekit.json: the save that wrote it never committed"
    with pytest.raises(statekit.IncompleteCheckpointError, match=never):
        statekit.load_state(reader[0], str(tmp_path / "ckpt"), allow_pickle=True)
    with pytest.raises(statekit.IncompleteCheckpointError, match=never):
        reader[0].load_state(str(tmp_path / "ckpt"))
    assert_untouched(before, *reader[1:])
    # the next save into the directory takes the failed save's lock over and commits
    accelerator, model, optimizer, scheduler = make_run(seed=0, attach=True)
    accelerator.save_state(str(tmp_path / "ckpt"))
    statekit.verify(str(tmp_path / "ckpt"))
    statekit.load_state(reader[0], str(tmp_path / "ckpt"), allow_pickle=True)
    assert_state_equal(reader[1].state_dict(), model.state_dict())


@pytest.mark.parametrize("how", ["attached", "load_state"])
def test_tied_weights_of_an_accelerate_folder_load(tmp_path, how):
    """Accelerate's safetensors file keeps one name of tied weights: the checks before a
    load count the others as filled through it (as safetensors' load_model does)."""

    def tied_run(seed: int):
        accelerator = fresh_accelerator()
        if how == "attached":
            statekit.attach(accelerator)
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        model[1].weight = model[0].weight
        return accelerator, accelerator.prepare(model)

    accelerator, model = tied_run(0)
    accelerator.save_state(str(tmp_path / "ckpt"))
    accelerator, resumed = tied_run(1)
    if how == "attached":
        accelerator.load_state(str(tmp_path / "ckpt"))
    else:
        statekit.load_state(accelerator, str(tmp_path / "ckpt"), allow_pickle=True)
    assert_state_equal(resumed.state_dict(), model.state_dict())
    assert resumed[1].weight is resumed[0].weight


@pytest.mark.parametrize("how", ["load_state", "attached", "accelerate-folder"])
def test_scheduler_of_another_class_is_refused(tmp_path, how):
    """LRScheduler.load_state_dict never refuses: a StepLR state loaded into a
    CosineAnnealingLR would leave a scheduler that is neither, silently."""
    accelerator, model, optimizer, scheduler = make_run(seed=0, attach=how == "attached")
    if how == "load_state":
        statekit.save_state(accelerator, str(tmp_path / "ckpt"))
    else:
        accelerator.save_state(str(tmp_path / "ckpt"))
    accelerator = fresh_accelerator()
    if how == "attached":
        statekit.attach(accelerator)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    before = snapshot(model, optimizer, scheduler)
    with pytest.raises(statekit.StateMismatchError) as err:
        if how == "attached":
            accelerator.load_state(str(tmp_path / "ckpt"))
        else:
            statekit.load_state(accelerator, str(tmp_path / "ckpt"), allow_pickle=True)
    message = str(err.value)
    assert "scheduler 'scheduler_0'" in message
    assert "missing keys: T_max, eta_min" in message and "unexpected keys: gamma, step_size" in message
    assert "saved by another kind of scheduler than this CosineAnnealingLR; nothing was loaded" in message
    assert_untouched(before, model, optimizer, scheduler)
