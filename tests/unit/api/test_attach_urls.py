"""Attach mode with a URL instead of a path: ``accelerator.save_state("file:///abs/dir")``
lands Accelerate's files and statekit's in one checkpoint; URLs Accelerate cannot write
are refused before anything is written."""

from __future__ import annotations

import os

import pytest
from click.testing import CliRunner

import statekit
from statekit.cli import main as cli
from statekit.testing import assert_state_equal

from accelerate_helpers import build, train_steps

pytest.importorskip("accelerate")


def _attached_run(seed: int = 1):
    run = build(seed=seed)
    statekit.attach(run[0])
    return run


def _train_saving_at_3(run, save) -> tuple[list[float], dict]:
    """8 steps, saving inside the loop after step 3; returns the losses after the save and
    the final weights (what a resume from that save must reproduce)."""
    losses = train_steps(run, 8, on_step=lambda step: step == 3 and save())
    return losses[3:], {k: v.clone() for k, v in run[1].state_dict().items()}


def _continue(run, steps: int = 5) -> tuple[list[float], dict]:
    losses = train_steps(run, steps, start=3)
    return losses, {k: v.clone() for k, v in run[1].state_dict().items()}


def test_file_url_save_and_load_are_one_checkpoint(tmp_path, monkeypatch, installed_plugin_manager):
    monkeypatch.chdir(tmp_path)
    target = tmp_path / "ck"
    run = _attached_run()
    reference = _train_saving_at_3(run, lambda: run[0].save_state(f"file://{target}"))

    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no ./file: folder
    assert {"model.safetensors", "optimizer.bin", "statekit.json"} <= set(os.listdir(target))
    result = CliRunner().invoke(cli, ["verify", str(target)])
    assert result.exit_code == 0, result.output

    resumed = _attached_run(seed=7)
    resumed[0].load_state(f"file://{target}")
    losses, weights = _continue(resumed)
    assert losses == reference[0]
    assert_state_equal(weights, reference[1])

    other = _attached_run(seed=8)  # the same checkpoint through statekit.load_state
    statekit.load_state(other[0], f"file://{target}", allow_pickle=True)
    assert _continue(other)[0] == reference[0]


def test_relative_path_save_and_load(tmp_path, monkeypatch, installed_plugin_manager):
    monkeypatch.chdir(tmp_path)
    run = _attached_run()
    reference = _train_saving_at_3(run, lambda: run[0].save_state(output_dir="runs/ck"))  # the keyword form too
    assert "statekit.json" in os.listdir(tmp_path / "runs" / "ck")
    assert sorted(os.listdir(tmp_path)) == ["runs"]

    resumed = _attached_run(seed=7)
    resumed[0].load_state(input_dir="runs/ck")
    losses, weights = _continue(resumed)
    assert losses == reference[0]
    assert_state_equal(weights, reference[1])


@pytest.mark.parametrize("url", ["memory://attach-refused/ck", "s3://some-bucket/run/ck"])
def test_url_accelerate_cannot_write_is_refused_before_writing(tmp_path, monkeypatch, url, installed_plugin_manager):
    monkeypatch.chdir(tmp_path)
    run = _attached_run()
    train_steps(run, 2)
    with pytest.raises(statekit.StorageError, match=r"accelerator\.save_state\('.*'\) with statekit attached: .*"
                       r"nothing was written\. Use statekit\.save_state\(accelerator, '.*'\) or a statekit\.CheckpointManager") as info:
        run[0].save_state(url)
    assert info.value.url == url
    assert os.listdir(tmp_path) == []  # no ./memory: or ./s3: folder
    if url.startswith("memory://"):
        assert not statekit.storage.Storage(url).exists()

    with pytest.raises(statekit.StorageError, match=r"accelerator\.load_state\('.*'\) .*nothing was loaded\. "
                       r"Use statekit\.load_state\(accelerator, '.*'\) or CheckpointManager\(accelerator, root\)\.resume\(\)"):
        run[0].load_state(url)


def test_one_slash_url_is_refused(tmp_path, monkeypatch, installed_plugin_manager):
    monkeypatch.chdir(tmp_path)
    run = _attached_run()
    with pytest.raises(statekit.StorageError, match=r"needs '://'"):
        run[0].save_state("s3:/bucket/ck")
    assert os.listdir(tmp_path) == []


def test_url_goes_to_statekit_save_state_instead(installed_plugin_manager):
    """What the refusal recommends works with the attached accelerator."""
    run = _attached_run()
    reference = _train_saving_at_3(run, lambda: statekit.save_state(run[0], "memory://attach-urls/ck"))
    resumed = _attached_run(seed=7)
    statekit.load_state(resumed[0], "memory://attach-urls/ck")
    assert _continue(resumed)[0] == reference[0]
