"""Loads that fail with a named error (docs/bad-input.md): a missing path, an incomplete or
newer-format checkpoint, a plugin that is not installed, shape/dtype/key mismatches, an
object the checkpoint lacks, another world size, an edited or malformed manifest, a
malformed tensor-file header."""

from __future__ import annotations

import json

import pytest
import torch

import statekit
from statekit.testing import rewrite_manifest


def _saved(tmp_path, **extra):
    url = str(tmp_path / "c")
    statekit.save(url, {"model": torch.nn.Linear(4, 2), **extra})
    return url


def test_missing_path(tmp_path):
    with pytest.raises(statekit.CheckpointNotFoundError, match="no checkpoint at"):
        statekit.load(str(tmp_path / "nothing"), {"t": torch.zeros(1)})


def test_incomplete_checkpoint(tmp_path):
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "model_0.safetensors").write_bytes(b"x")  # statekit's name, not Accelerate's
    with pytest.raises(statekit.IncompleteCheckpointError, match="never committed"):
        statekit.load(str(tmp_path / "half"), {"model": torch.nn.Linear(4, 2)})


def test_newer_format_version(tmp_path):
    url = _saved(tmp_path)
    manifest = json.loads((tmp_path / "c" / "statekit.json").read_text())
    manifest["format"] = "statekit/4"
    (tmp_path / "c" / "statekit.json").write_text(json.dumps(manifest))
    with pytest.raises(statekit.FormatVersionError, match="statekit/4.*upgrade statekit"):
        statekit.load(url, {"model": torch.nn.Linear(4, 2)})


def test_plugin_needed_but_not_installed(tmp_path, plugin_manager):
    class Taker:
        @statekit.hookimpl
        def statekit_save_state_pre(self, models, weights, checkpoint):
            models.pop(0)
            weights.pop(0)

    plugin_manager.register(Taker(), name="taker")
    url = _saved(tmp_path)
    plugin_manager.unregister(name="taker")
    with pytest.raises(statekit.PluginMissingError, match="pip install statekit-taker") as info:
        statekit.load(url, {"model": torch.nn.Linear(4, 2)})
    assert info.value.plugin_name == "taker" and info.value.distribution == "statekit-taker"


@pytest.mark.parametrize(
    ("target", "pattern"),
    [
        (torch.nn.Linear(4, 3), r"shape/dtype differences: .*weight \(saved \[2, 4\]"),
        (torch.nn.Linear(4, 2).double(), r"torch.float32 vs model \[2, 4\] torch.float64"),
        (torch.nn.Linear(4, 2, bias=False), r"unexpected keys: bias"),
        (torch.nn.Sequential(torch.nn.Linear(4, 2)), r"missing keys: 0.bias, 0.weight"),
    ],
    ids=["shape", "dtype", "unexpected-key", "missing-key"],
)
def test_shape_dtype_key_mismatch(tmp_path, target, pattern):
    url = _saved(tmp_path)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(statekit.StateMismatchError, match=pattern):
        statekit.load(url, {"model": target})
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())  # untouched


def test_object_missing_from_checkpoint(tmp_path):
    url = _saved(tmp_path)
    with pytest.raises(statekit.StateMismatchError, match="missing keys: optim"):
        statekit.load(url, {"model": torch.nn.Linear(4, 2), "optim": torch.optim.SGD([torch.zeros(1)], lr=1)})


def test_world_size_mismatch_warns_what_was_not_restored(tmp_path):
    url = str(tmp_path / "c")
    statekit.save(url, {"pos": {"batch": 3}}, per_rank=("pos",))
    rewrite_manifest(tmp_path / "c", lambda manifest: manifest.update(world_size=4))
    state: dict = {}
    with pytest.warns(statekit.StatekitWarning, match=r"ranks 1\.\.3 for pos \(saved with world size 4, loaded with 1\)"):
        statekit.load(url, {"pos": state})
    assert state == {"batch": 3}  # rank 0's state is restored


def test_a_manifest_edited_after_its_commit_fails_its_own_checksum(tmp_path):
    """One flipped bit in the manifest (step 8 read as 9) would resume at the wrong step."""
    url = str(tmp_path / "c")
    statekit.save(url, {"model": torch.nn.Linear(4, 2)}, step=8)
    path = tmp_path / "c" / "statekit.json"
    raw = bytearray(path.read_bytes())
    raw[raw.index(b'"step": 8') + 8] ^= 0x01  # '8' -> '9'
    path.write_bytes(bytes(raw))
    with pytest.raises(statekit.CorruptCheckpointError, match=r"statekit.json: the manifest does not match its own checksum") as info:
        statekit.verify(url)
    assert info.value.path.endswith("statekit.json")
    with pytest.raises(statekit.CorruptCheckpointError, match="its own checksum"):
        statekit.load(url, {"model": torch.nn.Linear(4, 2)})


def test_a_manifest_without_a_checksum_still_loads(tmp_path):
    """Manifests written before the self-checksum existed (format 1 all the same)."""
    url = str(tmp_path / "c")
    model = torch.nn.Linear(4, 2)
    statekit.save(url, {"model": model})
    path = tmp_path / "c" / "statekit.json"
    manifest = json.loads(path.read_text())
    del manifest["manifest_checksum"]
    path.write_text(json.dumps(manifest, indent=1))
    fresh = torch.nn.Linear(4, 2)
    statekit.load(url, {"model": fresh})
    assert torch.equal(fresh.weight, model.weight)


def test_loading_a_checkpoint_root_says_what_it_is(tmp_path):
    manager = statekit.CheckpointManager({"model": torch.nn.Linear(4, 2)}, str(tmp_path / "run"))
    manager.save(1)
    manager.save(2)
    with pytest.raises(statekit.IncompleteCheckpointError, match=r"run is a checkpoint root, not a checkpoint: it holds 2 .*'checkpoint-00000002'"):
        statekit.load(str(tmp_path / "run"), {"model": torch.nn.Linear(4, 2)})


def test_malformed_manifest_json(tmp_path):
    url = _saved(tmp_path)
    (tmp_path / "c" / "statekit.json").write_text('{"format": "statekit/1", ')
    with pytest.raises(statekit.CorruptCheckpointError, match=r"statekit.json: manifest is not valid JSON"):
        statekit.load(url, {"model": torch.nn.Linear(4, 2)})


def test_malformed_safetensors_header(tmp_path):
    url = _saved(tmp_path)
    target = tmp_path / "c" / "model.safetensors"
    data = bytearray(target.read_bytes())
    data[8:12] = b"!!!!"  # break the JSON header; size stays the same
    target.write_bytes(bytes(data))
    with pytest.raises(statekit.CorruptCheckpointError, match=r"model.safetensors"):
        statekit.load(url, {"model": torch.nn.Linear(4, 2)}, verify=False)
    with pytest.raises(statekit.CorruptCheckpointError, match=r"model.safetensors: malformed safetensors header"):
        statekit.load(url, {"model": torch.nn.Linear(4, 2)})
