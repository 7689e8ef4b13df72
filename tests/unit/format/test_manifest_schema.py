"""The manifest JSON Schema (``statekit/manifest.schema.json``) accepts real manifests and rejects broken ones."""

from __future__ import annotations

import copy
import json
from importlib import resources

import pytest
import torch

import statekit
from statekit.format.manifest import read_manifest
from statekit.storage import Storage

jsonschema = pytest.importorskip("jsonschema")


@pytest.fixture(scope="module")
def schema():
    text = resources.files("statekit").joinpath("manifest.schema.json").read_text()
    schema = json.loads(text)
    jsonschema.Draft202012Validator.check_schema(schema)
    return schema


def validate(manifest, schema):
    jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker()).validate(manifest)


def manifest_at(url):
    """The committed manifest as its JSON object (what the schema describes)."""
    return read_manifest(Storage(url)).to_json()


def test_schema_ships_as_package_data():
    assert resources.files("statekit").joinpath("manifest.schema.json").is_file()


def test_statekit_save_manifest(schema, tmp_path):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(1, 3)).sum().backward()
    optimizer.step()
    url = str(tmp_path / "ckpt")
    statekit.save(url, {"model": model, "optim": optimizer, "epoch": {"n": 3}, "t": torch.ones(2)}, step=7, metadata={"loss": 0.5})
    manifest = manifest_at(url)
    validate(manifest, schema)
    assert manifest["step"] == 7 and set(manifest["objects"]) == {"model", "optim", "epoch", "t"}
    assert manifest["fingerprint"]["world_size"] == 1 and manifest["fingerprint"]["dataloaders"] == {}


def test_save_state_with_accelerate_manifest(schema, tmp_path, tiny_accelerate):
    run = tiny_accelerate
    for i, batch in enumerate(run.loader):
        run.train_step(batch)
        if i == 2:
            break
    url = str(tmp_path / "acc")
    statekit.save_state(run.accelerator, url, step=3)
    manifest = manifest_at(url)
    validate(manifest, schema)
    kinds = {o["kind"] for o in manifest["objects"].values()}
    assert {"model", "optimizer", "scheduler", "dataloader"} <= kinds
    assert manifest["fingerprint"]["dataloaders"]["dataloader_0"]["dataset_length"] == len(run.loader.dataset)


def test_checkpoint_manager_manifest(schema):
    model = torch.nn.Linear(2, 2)
    url = "memory://statekit-schema-test/run"
    manager = statekit.CheckpointManager({"model": model}, url, keep_last=2)
    manager.save(10, metrics={"loss": 1.25})
    manager.wait()
    manifest = manifest_at(manager.url_for(10))
    validate(manifest, schema)
    assert manifest["metadata"]


def test_schema_rejects_broken_manifests(schema, tmp_path):
    url = str(tmp_path / "ckpt")
    statekit.save(url, {"t": torch.zeros(1)})
    good = manifest_at(url)
    validate(good, schema)
    broken = []
    m = copy.deepcopy(good); m["format"] = "statekit/4"; broken.append(m)
    m = copy.deepcopy(good); del m["files"]; broken.append(m)
    m = copy.deepcopy(good); next(iter(m["files"].values()))["checksum"] = "md5:00"; broken.append(m)
    m = copy.deepcopy(good); m["files"]["../escape.json"] = next(iter(m["files"].values())); broken.append(m)
    m = copy.deepcopy(good); m["objects"]["t"]["kind"] = "pickle"; broken.append(m)
    m = copy.deepcopy(good); m["world_size"] = 0; broken.append(m)
    m = copy.deepcopy(good); m["fingerprint"] = "world size 1"; broken.append(m)
    m = copy.deepcopy(good); m["fingerprint"]["dataloaders"] = {"d": {"batch_size": "8"}}; broken.append(m)
    for manifest in broken:
        with pytest.raises(jsonschema.ValidationError):
            validate(manifest, schema)
    old = copy.deepcopy(good); del old["fingerprint"]  # optional: checkpoints written before it existed
    validate(old, schema)


def test_reader_rejects_a_fingerprint_that_is_not_an_object(tmp_path):
    from statekit.errors import CorruptCheckpointError
    from statekit.format.manifest import validate_manifest

    url = str(tmp_path / "ckpt")
    statekit.save(url, {"t": torch.zeros(1)})
    manifest = manifest_at(url)
    del manifest["fingerprint"], manifest["manifest_checksum"]  # as written before either existed
    assert validate_manifest(manifest, url) is manifest
    manifest["fingerprint"] = ["world size", 1]
    with pytest.raises(CorruptCheckpointError, match=r"manifest field 'fingerprint' is not an object"):
        validate_manifest(manifest, url)
