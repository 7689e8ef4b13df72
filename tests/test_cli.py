"""The statekit command line: plugins, ls, inspect, verify, convert, gc."""

from __future__ import annotations

import json

import torch
from click.testing import CliRunner

import statekit
from statekit.cli import main
from statekit.manager import CheckpointManager


def _run(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def _root(tmp_path):
    model = torch.nn.Linear(4, 2)
    manager = CheckpointManager({"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)}, str(tmp_path / "run"))
    manager.save(1, metrics={"loss": 1.5})
    manager.save(2)
    (tmp_path / "run" / "checkpoint-00000003").mkdir()
    return tmp_path / "run"


def test_plugins_lists_installed_with_versions(installed_plugin_manager):
    result = _run("plugins", "--json")
    rows = {r["name"]: r for r in json.loads(result.output)}
    assert rows["rng"]["distribution"] == "statekit-rng" and rows["rng"]["version"]
    assert rows["rng"]["origin"] == "entry point" and "statekit_save_state_pre" in rows["rng"]["hooks"]
    assert "rng" in _run("plugins").output


def test_plugins_marks_blocked(monkeypatch):
    monkeypatch.setenv("STATEKIT_DISABLE_PLUGINS", "rng")
    with statekit.plugins.use_plugin_manager(statekit.plugins.build_plugin_manager()):
        rows = {r["name"]: r for r in json.loads(_run("plugins", "--json").output)}
    assert rows["rng"]["blocked"] is True


def test_ls_shows_committed_and_incomplete(tmp_path):
    root = _root(tmp_path)
    rows = json.loads(_run("ls", str(root), "--json").output)
    assert [(r["step"], r["committed"]) for r in rows] == [(1, True), (2, True), (3, False)]
    assert rows[0]["metrics"] == {"loss": 1.5} and rows[0]["size_bytes"] > 0
    text = _run("ls", str(root)).output
    assert "incomplete" in text and "KiB" in text or "B " in text


def test_inspect_text_and_json(tmp_path):
    checkpoint = _root(tmp_path) / "checkpoint-00000001"
    manifest = json.loads(_run("inspect", str(checkpoint), "--json").output)
    assert manifest["format"] == "statekit/1" and manifest["step"] == 1
    text = _run("inspect", str(checkpoint), "--tensors").output
    assert "model.safetensors" in text and "weight" in text and "optimizer" in text


def test_verify_ok_and_names_the_bad_file(tmp_path):
    checkpoint = _root(tmp_path) / "checkpoint-00000002"
    assert _run("verify", str(checkpoint)).exit_code == 0
    target = checkpoint / "model.safetensors"
    data = bytearray(target.read_bytes())
    data[-2] ^= 0x01
    target.write_bytes(bytes(data))
    result = CliRunner().invoke(main, ["verify", str(checkpoint)])
    assert result.exit_code == 1
    assert "model.safetensors" in result.output and "checksum" in result.output
    report = json.loads(CliRunner().invoke(main, ["verify", str(checkpoint), "--json"]).output)
    assert report["ok"] is False and report["file"].endswith("model.safetensors")


def test_verify_missing_and_truncated(tmp_path):
    checkpoint = _root(tmp_path) / "checkpoint-00000002"
    (checkpoint / "optim.json").unlink()
    result = CliRunner().invoke(main, ["verify", str(checkpoint)])
    assert result.exit_code == 1 and "optim.json" in result.output and "missing" in result.output
    incomplete = CliRunner().invoke(main, ["verify", str(checkpoint.parent / "checkpoint-00000003")])
    assert incomplete.exit_code == 1 and "never committed" in incomplete.output


def test_gc_removes_incomplete(tmp_path):
    root = _root(tmp_path)
    dry = json.loads(_run("gc", str(root), "--dry-run", "--json").output)
    assert dry["removed"] == [str(root / "checkpoint-00000003")] and (root / "checkpoint-00000003").exists()
    _run("gc", str(root))
    assert not (root / "checkpoint-00000003").exists() and (root / "checkpoint-00000002").exists()


def test_convert_unknown_format_is_a_usage_error(tmp_path):
    result = CliRunner().invoke(main, ["convert", str(tmp_path), str(tmp_path / "o"), "--to", "nope"])
    assert result.exit_code == 2 and "unknown format" in result.output
