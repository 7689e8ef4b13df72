"""The statekit command line: plugins, ls, inspect, verify, convert, gc."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

import statekit
from statekit.cli import main
from statekit.manager.manager import CheckpointManager


def _run(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def _root(tmp_path):
    model = torch.nn.Linear(4, 2)
    manager = CheckpointManager({"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)}, str(tmp_path / "run"))
    manager.save(1, metrics={"loss": 1.5})
    manager.save(2)
    crashed = tmp_path / "run" / "checkpoint-00000003"  # what a save killed mid-write leaves: its stale lock, a partial file
    crashed.mkdir()
    (crashed / ".statekit-lock").write_text(json.dumps({"host": "a-host-long-gone", "pid": 1, "created": 0}))
    (crashed / "model.safetensors").write_bytes(b"partial")
    return tmp_path / "run"


def test_plugins_lists_installed_with_versions(installed_plugin_manager):
    result = _run("plugins", "--json")
    rows = {r["name"]: r for r in json.loads(result.output)}
    assert rows["rng"]["distribution"] == "statekit-rng" and rows["rng"]["version"]
    assert rows["rng"]["origin"] == "entry point" and "statekit_save_state_pre" in rows["rng"]["hooks"]
    assert "rng" in _run("plugins").output


def test_plugins_marks_blocked(monkeypatch):
    monkeypatch.setenv("STATEKIT_DISABLE_PLUGINS", "rng")
    with statekit.hooks.registry.use_plugin_manager(statekit.hooks.registry.build_plugin_manager()):
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


def test_gc_keeps_a_save_in_progress(tmp_path, monkeypatch):
    """gc run while a save writes (its live lock present) must not delete its files: the
    save would commit a manifest over an emptied directory (on object stores) or fail."""
    from statekit.storage import Storage

    root = tmp_path / "run"
    manager = CheckpointManager({"model": torch.nn.Linear(4, 4)}, str(root), keep_last=1)
    manager.save(1)
    outputs = []
    real_commit = Storage.commit

    def commit_after_gc(self, rel, data, exclusive=False):
        outputs.append(_run("gc", str(root), "--json").output)
        return real_commit(self, rel, data, exclusive)

    monkeypatch.setattr(Storage, "commit", commit_after_gc)
    manager.save(2)
    monkeypatch.setattr(Storage, "commit", real_commit)
    report = json.loads(outputs[0])
    assert report["removed"] == [] and report["kept"][0]["url"] == str(root / "checkpoint-00000002")
    statekit.verify(str(root / "checkpoint-00000002"))


def test_convert_unknown_format_is_a_usage_error(tmp_path):
    result = CliRunner().invoke(main, ["convert", str(tmp_path), str(tmp_path / "o"), "--to", "nope"])
    assert result.exit_code == 2 and "unknown format" in result.output


def test_convert_to_the_format_of_a_plugin_that_is_missing_names_what_to_install(tmp_path, plugin_manager):
    class Fancy:
        @statekit.hookimpl
        def statekit_save_state_pre(self, models, weights, output_dir, checkpoint):
            checkpoint.records["layout"] = "fancy"

        STATEKIT_CONVERTERS = {"fancy": lambda src, out: None}

    plugin_manager.register(Fancy(), name="fancy")
    statekit.save(str(tmp_path / "c"), {"t": torch.zeros(1)})
    plugin_manager.unregister(name="fancy")
    result = CliRunner().invoke(main, ["convert", str(tmp_path / "c"), str(tmp_path / "o"), "--to", "fancy"])
    assert result.exit_code == 2
    assert "unknown format 'fancy'" in result.output and "pip install statekit-fancy" in result.output
    assert not (tmp_path / "o").exists()


# --------------------------------------------------------------------------- diff, other formats, progress


def _momentum_run(tmp_path):
    """Two manager checkpoints (steps 10, 20) one SGD-with-momentum step apart."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    manager = CheckpointManager({"model": model, "optim": optim}, str(tmp_path / "mrun"))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    snapshots = []
    for step in (10, 20):
        optim.step()
        manager.save(step)
        snapshots.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return tmp_path / "mrun", snapshots


def test_diff_between_manager_checkpoints_names_changed_tensors(tmp_path):
    root, (w10, w20) = _momentum_run(tmp_path)
    a, b = str(root / "checkpoint-00000010"), str(root / "checkpoint-00000020")
    result = _run("diff", a, b, "--json")
    assert result.exit_code == 0
    report = json.loads(result.output)
    values = {t["key"]: t["max_abs_diff"] for t in report["tensors"]}
    for name in ("weight", "bias"):
        expected = (w20[name].double() - w10[name].double()).abs().max().item()
        assert values[f"model.safetensors:{name}"] == expected
    # momentum buffer: 1 after the first step, 0.9 * 1 + 1 after the second (float32)
    one = torch.ones((), dtype=torch.float32)
    expected_buf = (one * 0.9 + one - one).double().item()
    assert values["optim.safetensors:state.0.momentum_buffer"] == expected_buf
    assert values["optim.safetensors:state.1.momentum_buffer"] == expected_buf
    assert {k for k, t in ((t["key"], t) for t in report["tensors"]) if not t["equal"]} == {
        "model.safetensors:weight", "model.safetensors:bias",
        "optim.safetensors:state.0.momentum_buffer", "optim.safetensors:state.1.momentum_buffer"}
    assert report["added"] == [] and report["removed"] == [] and report["identical"] is False
    assert report["a"]["size_bytes"] == sum(f.stat().st_size for f in (root / "checkpoint-00000010").rglob("*")
                                            if f.is_file() and f.name != "statekit.json")
    assert {"model.safetensors", "optim.safetensors"} <= {f["file"] for f in report["files"]}, report["files"]
    text = _run("diff", a, b).output
    assert "4 tensors differ, 2 equal" in text
    assert "model.safetensors:weight" in text and "optim.safetensors:state.0.momentum_buffer" in text
    assert "rng/rank-00000.safetensors:torch" not in text  # equal tensors are listed only with --all
    assert "rng/rank-00000.safetensors:torch" in _run("diff", a, b, "--all").output


def test_diff_identical_checkpoints_shows_no_changes(tmp_path):
    root, _ = _momentum_run(tmp_path)
    a = str(root / "checkpoint-00000010")
    report = json.loads(_run("diff", a, a, "--json").output)
    assert report["identical"] is True and report["size_delta_bytes"] == 0
    assert all(t["equal"] and t["max_abs_diff"] == 0.0 for t in report["tensors"])
    text = _run("diff", a, a).output
    assert "identical: 6 tensors equal" in text and "max abs diff" not in text


def test_diff_missing_side_exits_1(tmp_path):
    root, _ = _momentum_run(tmp_path)
    result = CliRunner().invoke(main, ["diff", str(root / "checkpoint-00000010"), str(tmp_path / "nope")])
    assert result.exit_code == 1 and "no checkpoint at" in result.output


def test_inspect_foreign_formats(tmp_path):
    import warnings

    import safetensors.torch
    import torch.distributed.checkpoint as dcp

    safetensors.torch.save_file({"w": torch.ones(2, 3)}, str(tmp_path / "m.safetensors"))
    text = _run("inspect", str(tmp_path / "m.safetensors"), "--tensors").output
    assert "safetensors" in text and "[2, 3]" in text and "24 B" in text
    payload = json.loads(_run("inspect", str(tmp_path / "m.safetensors"), "--tensors", "--json").output)
    assert payload["format"] == "safetensors" and payload["tensors"] == [
        {"key": "w", "name": "w", "dtype": "float32", "shape": [2, 3], "size_bytes": 24, "file": "m.safetensors"}]

    torch.save({"x": torch.zeros(4)}, tmp_path / "t.pt")
    refused = CliRunner().invoke(main, ["inspect", str(tmp_path / "t.pt")])
    assert refused.exit_code == 1 and "t.pt is a pickle file" in refused.output
    assert json.loads(_run("inspect", str(tmp_path / "t.pt"), "--allow-pickle", "--json").output)["tensor_count"] == 1

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": torch.nn.Linear(2, 2).state_dict()}, checkpoint_id=str(tmp_path / "dcp"))
    refused = CliRunner().invoke(main, ["inspect", str(tmp_path / "dcp")])
    assert refused.exit_code == 1 and ".metadata is a pickle file" in refused.output and "--allow-pickle" in refused.output
    payload = json.loads(_run("inspect", str(tmp_path / "dcp"), "--allow-pickle", "--tensors", "--json").output)
    assert payload["format"] == "dcp" and {t["key"] for t in payload["tensors"]} == {"model.weight", "model.bias"}


def test_inspect_accelerate_directory_without_pickle(tmp_path):
    import os
    import sys

    from accelerate_helpers import build

    accelerator = build(seed=0)[0]
    accelerator.save_state(str(tmp_path / "acc"))
    text = _run("inspect", str(tmp_path / "acc"), "--tensors").output
    assert "format      accelerate" in text and "model.safetensors:fc1.weight" in text
    assert "not read" in text and "optimizer.bin" in text


def test_progress_silent_off_a_terminal(tmp_path):
    checkpoint = _root(tmp_path) / "checkpoint-00000001"
    result = _run("verify", str(checkpoint))
    assert result.output.startswith("ok: ") and result.output.count("\n") == 1  # no bar, nothing else


def test_progress_bar_on_a_fake_terminal(monkeypatch):
    import io

    from statekit.progress import progress, progress_enabled

    class FakeTTY(io.StringIO):
        def isatty(self):
            return True

    stream = FakeTTY()
    monkeypatch.delenv("STATEKIT_PROGRESS", raising=False)
    assert progress_enabled(stream) and not progress_enabled(io.StringIO())
    with progress(4 * 1024 * 1024, "verify", stream=stream) as advance:
        advance(2 * 1024 * 1024)
    assert "verify" in stream.getvalue() and "MiB" in stream.getvalue()
    monkeypatch.setenv("STATEKIT_PROGRESS", "0")
    quiet = FakeTTY()
    with progress(10, "verify", stream=quiet) as advance:
        advance(10)
    assert quiet.getvalue() == ""


def test_inspect_and_diff_remote_memory_urls():
    import fsspec

    model = torch.nn.Linear(2, 2)
    statekit.save("memory://cli-remote/a", {"model": model})
    before = model.bias.detach().clone()
    with torch.no_grad():
        model.bias.add_(0.5)
    expected = (model.bias.detach().double() - before.double()).abs().max().item()
    statekit.save("memory://cli-remote/b", {"model": model})
    try:
        payload = json.loads(_run("inspect", "memory://cli-remote/a", "--tensors", "--json").output)
        assert payload["format"] == "statekit/1" and "model.safetensors" in payload["tensors"]
        report = json.loads(_run("diff", "memory://cli-remote/a", "memory://cli-remote/b", "--json").output)
        values = {t["key"]: t["max_abs_diff"] for t in report["tensors"] if t["key"].startswith("model.")}
        assert values == {"model.safetensors:weight": 0.0,
                          "model.safetensors:bias": expected}
    finally:
        fsspec.filesystem("memory").rm("/cli-remote", recursive=True)


def test_storage_option_values_parse_and_nest():
    from statekit.cli.output import parse_key_values, storage_options_of

    got = storage_options_of(("key=abc", "anon=false", "client_kwargs.endpoint_url=http://127.0.0.1:9000",
                              "config_kwargs.retries.max_attempts=2", "use_ssl=true"))
    assert got == {"key": "abc", "anon": False, "use_ssl": True,
                   "client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"},
                   "config_kwargs": {"retries": {"max_attempts": 2}}}
    assert storage_options_of(()) is None
    assert parse_key_values(("a.b=1",), "--option") == {"a.b": 1}  # --option does not nest


def test_storage_option_errors_are_usage_errors(tmp_path):
    for bad, why in (("novalue", "expects KEY=VALUE"), ("a..b=1", "expects KEY=VALUE"), ("=1", "expects KEY=VALUE")):
        result = CliRunner().invoke(main, ["ls", str(tmp_path), "--storage-option", bad])
        assert result.exit_code == 2 and why in result.output, result.output
    result = CliRunner().invoke(main, ["ls", str(tmp_path), "--storage-option", "a=1", "--storage-option", "a.b=2"])
    assert result.exit_code == 2 and "'a' already has a value" in result.output


def test_every_command_takes_storage_option():
    for name, command in main.commands.items():
        if name != "plugins":
            assert "--storage-option" in CliRunner().invoke(main, [name, "--help"]).output, name


@pytest.mark.s3
def test_cli_reads_s3_with_storage_options_alone(s3_server, s3_bucket, monkeypatch, tmp_path):
    """No AWS_* variables: the endpoint and credentials come from --storage-option only."""
    import s3fs

    options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": s3_server.endpoint_url}}
    root = f"{s3_bucket}/run"
    CheckpointManager({"w": torch.arange(6.0)}, root, storage_options=options).save(3)
    for var in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    s3fs.S3FileSystem.clear_instance_cache()
    flags = ["--storage-option", "key=testing", "--storage-option", "secret=testing",
             "--storage-option", f"client_kwargs.endpoint_url={s3_server.endpoint_url}"]
    listed = json.loads(_run("ls", root, "--json", *flags).output)
    assert [i["step"] for i in listed] == [3] and listed[0]["committed"]
    url = listed[0]["url"]
    assert json.loads(_run("verify", url, "--json", *flags).output)["ok"] is True
    assert json.loads(_run("inspect", url, "--json", *flags).output)["step"] == 3
    s3fs.S3FileSystem.clear_instance_cache()
    without = CliRunner().invoke(main, ["ls", root])  # the same command without the options fails, naming the URL
    assert without.exit_code == 1 and root in without.output
    s3fs.S3FileSystem.clear_instance_cache()


def test_ls_of_a_missing_root_or_of_a_checkpoint_is_an_error(tmp_path):
    """A typo in the root (or the bucket) is exit 1, not "no checkpoints"; an empty root is fine."""
    root = _root(tmp_path)
    missing = CliRunner().invoke(main, ["ls", str(tmp_path / "typo")])
    assert missing.exit_code == 1 and "does not exist" in missing.output
    one = CliRunner().invoke(main, ["ls", str(root / "checkpoint-00000001")])
    assert one.exit_code == 1 and "statekit inspect" in one.output
    (tmp_path / "empty").mkdir()
    empty = CliRunner().invoke(main, ["ls", str(tmp_path / "empty"), "--json"])
    assert empty.exit_code == 0 and json.loads(empty.output) == []


def test_verify_of_a_root_or_another_format_says_what_it_is(tmp_path):
    root = _root(tmp_path)
    result = CliRunner().invoke(main, ["verify", str(root)])
    assert result.exit_code == 1 and "checkpoint root" in result.output and "never committed" not in result.output
    torch.save({"w": torch.ones(2)}, tmp_path / "m.pt")
    result = CliRunner().invoke(main, ["verify", str(tmp_path / "m.pt")])
    assert result.exit_code == 3  # not verified: a torch file has no checksums (exit 1 is kept for a problem found)
    assert "is not a statekit checkpoint but a torch.save file" in result.output and "no checksums" in result.output
    assert "torch zip archive readable" in result.output


def test_ls_replica_words_the_copies_as_the_tier_plugin_declares(tmp_path):
    from statekit.hooks.registry import CopyListing, PluginManager, use_plugin_manager
    from statekit.storage.inuse import mark_in_use

    objects = {"model": torch.nn.Linear(2, 2)}
    local, other = tmp_path / "local", tmp_path / "other"
    for step, roots in ((1, (local, other)), (2, (local,)), (3, (other,))):
        for root in roots:
            statekit.save(str(root / f"checkpoint-{step:08d}"), objects, step=step)

    def states(pm):
        with use_plugin_manager(pm):
            rows = json.loads(_run("ls", str(local), "--replica", str(other), "--json").output)
            return [(r["step"], r["tiers"], r[copied], r[field]) for r in rows], _run("ls", str(local), "--replica", str(other)).output

    copied, field = "copied", "copy"  # no tier plugin: the generic words
    rows, text = states(PluginManager())
    assert rows == [(1, ["local", "remote"], True, "copied"), (2, ["local"], False, "not copied"),
                    (3, ["remote"], True, "copied")]
    assert "local (not copied)" in text and "local + remote" in text

    class Mirror:
        STATEKIT_COPY_LISTING = CopyListing(frozenset({"mirror"}), copied="mirrored", state_field="mirroring")

    pm = PluginManager()
    pm.register(Mirror(), name="mirror")
    mark_in_use(str(local / "checkpoint-00000002"), by="mirror")
    copied, field = "mirrored", "mirroring"
    rows, text = states(pm)
    assert rows[1] == (2, ["local"], False, "copying") and rows[0][3] == "mirrored"
    assert "local (copying to remote)" in text
