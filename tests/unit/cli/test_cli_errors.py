"""The `statekit` command has no dead ends (issue 27, section 4): `python -m statekit` runs
it; messages name the command's flags (`--overwrite`, `--allow-pickle`), not Python
arguments; `gc` and `ls` agree on a root that does not exist; `inspect --tensors` names
the tensors of a compiled model without `_orig_mod.`, in attach mode too."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

import statekit
from statekit.cli import main

pytest.importorskip("accelerate")

from accelerate_helpers import fresh_accelerator  # noqa: E402


def _accelerate_folder(path, compiled=False, attached=False):
    accelerator = fresh_accelerator()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    if compiled:
        model = torch.compile(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    if attached:
        statekit.attach(accelerator)
    accelerator.save_state(str(path))
    return path


def test_python_dash_m_statekit_runs_the_cli():
    result = subprocess.run([sys.executable, "-m", "statekit", "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "Usage: statekit" in result.stdout
    assert "convert" in result.stdout


def test_convert_onto_a_checkpoint_names_overwrite_flag(tmp_path, installed_plugin_manager):
    src = _accelerate_folder(tmp_path / "acc")
    runner = CliRunner()
    out = str(tmp_path / "converted")
    assert runner.invoke(main, ["convert", str(src), out, "--allow-pickle"]).exit_code == 0
    again = runner.invoke(main, ["convert", str(src), out, "--allow-pickle"])
    assert again.exit_code == 1
    assert "already holds a committed checkpoint; pass --overwrite to replace it" in again.output
    assert "overwrite=True" not in again.output
    replaced = runner.invoke(main, ["convert", str(src), out, "--allow-pickle", "--overwrite"])
    assert replaced.exit_code == 0, replaced.output


@pytest.mark.parametrize("command", [["convert", "{src}", "{out}"], ["inspect", "--tensors", "{src}"], ["diff", "{src}", "{src}"]])
def test_pickle_refusals_name_the_allow_pickle_flag(tmp_path, installed_plugin_manager, command):
    src = _accelerate_folder(tmp_path / "acc")
    args = [a.format(src=src, out=tmp_path / "out") for a in command]
    result = CliRunner().invoke(main, args)
    if command[0] != "convert":  # inspect and diff read what they can and name the files they skipped
        assert result.exit_code == 0, result.output
        assert "(pickle: use --allow-pickle)" in result.output
    else:
        assert result.exit_code == 1
        assert "is a pickle file" in result.output
        assert "only with --allow-pickle" in result.output
    assert "allow_pickle=True" not in result.output


@pytest.mark.parametrize("command", ["ls", "gc"])
def test_ls_and_gc_of_a_root_that_does_not_exist_fail_alike(tmp_path, command):
    result = CliRunner().invoke(main, [command, str(tmp_path / "no-such-root")])
    assert result.exit_code == 1
    assert f"no such checkpoint root: {tmp_path / 'no-such-root'} does not exist" in result.output


def test_gc_of_an_empty_root_is_fine(tmp_path):
    (tmp_path / "root").mkdir()
    result = CliRunner().invoke(main, ["gc", str(tmp_path / "root")])
    assert result.exit_code == 0
    assert "nothing to remove" in result.output


def test_inspect_tensors_of_an_attached_compiled_model_strips_orig_mod(tmp_path, installed_plugin_manager):
    folder = _accelerate_folder(tmp_path / "att", compiled=True, attached=True)
    text = CliRunner().invoke(main, ["inspect", "--tensors", str(folder)])
    assert text.exit_code == 0, text.output
    assert "_orig_mod" not in text.output
    as_json = CliRunner().invoke(main, ["inspect", "--tensors", "--json", str(folder)])
    names = [t["name"] for t in json.loads(as_json.output)["tensors"]["model.safetensors"]]
    assert sorted(names) == ["bias", "weight"]
