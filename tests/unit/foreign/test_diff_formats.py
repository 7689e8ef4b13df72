"""``statekit diff`` compares tensors by what they are across formats: the same state saved
with statekit attached (Accelerate's files + statekit's) and natively shows no difference;
one changed weight is named, and only it."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

import statekit
from statekit.cli import main as cli

from accelerate_helpers import build, train_steps

pytest.importorskip("accelerate")


def _diff(a: str, b: str, *extra: str) -> dict:
    result = CliRunner().invoke(cli, ["diff", a, b, "--json", *extra])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def _saved_both_ways(tmp_path, *, attached: bool = True) -> tuple[str, str, str]:
    """The same state saved by ``accelerator.save_state`` and by ``statekit.save_state``, and
    (third) natively with one bias element changed by 0.25."""
    run = build(seed=2)
    if attached:
        statekit.attach(run[0])
    accelerate_dir, native = str(tmp_path / "accelerate"), str(tmp_path / "native")

    def save(step: int) -> None:
        if step == 3:
            run[0].save_state(accelerate_dir)
            statekit.save_state(run[0], native)
            with torch.no_grad():
                run[1].fc2.bias[1] += 0.25
            statekit.save_state(run[0], changed)

    changed = str(tmp_path / "changed")
    train_steps(run, 3, on_step=save)
    return accelerate_dir, native, changed


def test_attach_mode_and_native_checkpoints_of_one_state_are_identical(tmp_path, installed_plugin_manager):
    attached, native, _ = _saved_both_ways(tmp_path)
    report = _diff(attached, native, "--allow-pickle")
    assert report["identical"], report
    assert (report["added"], report["removed"], report["changed"], report["not_compared"]) == ([], [], [], [])
    pairs = {t["key"]: t.get("b_key", t["key"]) for t in report["tensors"]}
    assert pairs["optimizer.bin:state.0.exp_avg"] == "optimizer_0.safetensors:state.0.exp_avg"  # optimizer.bin is read
    assert pairs["model.safetensors:fc1.weight"] == "model_0.safetensors:fc1.weight"
    assert report["a"]["superseded"] == ["random_states_0.pkl"]  # statekit-rng's rng/ is what a load restores

    # without --allow-pickle the optimizer is said not to be compared, not "added"
    unread = _diff(attached, native)
    assert not unread["identical"] and unread["added"] == [] and unread["removed"] == []
    assert "optimizer_0.safetensors:state.0.exp_avg" in unread["not_compared"]
    text = CliRunner().invoke(cli, ["diff", attached, native])
    assert "not read in a: custom_checkpoint_0.pkl, optimizer.bin, scheduler.bin (pickle: use --allow-pickle)" in text.output


def test_one_changed_weight_is_named_and_only_it(tmp_path, installed_plugin_manager):
    attached, _, changed = _saved_both_ways(tmp_path)
    report = _diff(attached, changed, "--allow-pickle")
    differing = [(t["key"], t.get("b_key"), t["max_abs_diff"]) for t in report["tensors"] if not t["equal"]]
    assert differing == [("model.safetensors:fc2.bias", "model_0.safetensors:fc2.bias", pytest.approx(0.25))]
    assert (report["added"], report["removed"], report["not_compared"]) == ([], [], [])

    text = CliRunner().invoke(cli, ["diff", attached, changed, "--allow-pickle"])
    assert "1 tensors differ" in text.output and "fc2.bias" in text.output


def test_plain_accelerate_folder_against_native(tmp_path, installed_plugin_manager):
    """A plain Accelerate folder holds the generators in random_states_0.pkl, a native
    checkpoint in statekit-rng's rng/: those are named; model and optimizer compare equal."""
    plain, native, _ = _saved_both_ways(tmp_path, attached=False)
    report = _diff(plain, native, "--allow-pickle")
    compared = {t["key"] for t in report["tensors"]}
    assert {"model.safetensors:fc1.weight", "optimizer.bin:state.3.exp_avg_sq"} <= compared
    assert all(t["equal"] for t in report["tensors"])
    assert all(k.startswith("random_states_0.pkl:") for k in report["removed"])
    assert all(k.startswith(("rng/", "dataloader_0/")) for k in report["added"])
