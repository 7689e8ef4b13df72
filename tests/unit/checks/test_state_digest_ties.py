"""The state digest's ``ties`` (issue 44): an optional, additive field of the manifest's
``state_digest`` record, the groups of tensor paths of a model that were one tensor at save.
It round-trips, the schema accepts it, a malformed one is refused, and a checkpoint written
before it existed (no ``ties``) still loads, its ties not checked and nothing named."""

from __future__ import annotations

import json
import warnings
from importlib import resources

import pytest
import torch

import statekit
from statekit.errors import CorruptCheckpointError
from statekit.format.manifest import manifest_bytes, read_manifest
from statekit.format.manifest_types import StateDigest
from statekit.storage import Storage


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(6, 4)
        self.head = torch.nn.Linear(4, 6, bias=False)
        self.head.weight = self.embed.weight


RECORD = {"algorithm": "emix64", "sampling": {"block": 16, "stride": 4096, "full_below": 65536},
          "objects": {"model": {"embed.weight": "float32:0123456789abcdef", "head.weight": "float32:0123456789abcdef"}}}


def test_ties_round_trip_and_an_old_record_has_none():
    old = StateDigest.from_json(dict(RECORD), "m")
    assert old.ties is None and "ties" not in old.to_json()
    new = StateDigest.from_json({**RECORD, "ties": {"model": [["embed.weight", "head.weight"]]}}, "m")
    assert new.ties == {"model": [["embed.weight", "head.weight"]]}
    assert new.to_json() == {**RECORD, "ties": {"model": [["embed.weight", "head.weight"]]}}
    built = StateDigest(algorithm="emix64", sampling=RECORD["sampling"], objects=RECORD["objects"],
                        ties={"model": [["embed.weight", "head.weight"]]})
    assert list(built.to_json()) == ["algorithm", "sampling", "objects", "ties"]


@pytest.mark.parametrize("ties", [["embed.weight"], {"model": "embed.weight"}, {"model": ["embed.weight"]},
                                  {"model": [["embed.weight", 3]]}], ids=["list", "string", "flat", "not-a-path"])
def test_malformed_ties_are_refused(ties):
    with pytest.raises(CorruptCheckpointError, match="'state_digest' is malformed"):
        StateDigest.from_json({**RECORD, "ties": ties}, "m")


def test_the_schema_accepts_a_saved_manifest_with_ties_and_refuses_a_group_of_one(tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(resources.files("statekit").joinpath("manifest.schema.json").read_text())
    url = str(tmp_path / "ckpt")
    statekit.save(url, {"model": Tied()})
    manifest = read_manifest(Storage(url)).to_json()
    assert manifest["state_digest"]["ties"] == {"model": [["embed.weight", "head.weight"]]}
    validator = jsonschema.Draft202012Validator(schema)
    validator.validate(manifest)
    manifest["state_digest"]["ties"] = {"model": [["embed.weight"]]}
    assert not validator.is_valid(manifest)


def test_a_checkpoint_without_ties_loads_and_checks_values_only(tmp_path, monkeypatch):
    torch.manual_seed(0)
    url = str(tmp_path / "ckpt")
    statekit.save(url, {"model": Tied()})
    path = tmp_path / "ckpt" / "statekit.json"
    written = json.loads(path.read_text())
    del written["state_digest"]["ties"]  # as written before the field existed
    path.write_bytes(manifest_bytes(written))
    assert read_manifest(Storage(url)).state_digest.ties is None

    from statekit.engine import read

    original = read.LoadPlan.read
    other = Tied()

    def untie(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        other.head.weight = torch.nn.Parameter(other.head.weight.detach().clone())
        return result

    monkeypatch.setattr(read.LoadPlan, "read", untie)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no tie recorded: not checked, not a false alarm
        statekit.load(url, {"model": other}, strict_resume=True)
    assert torch.equal(other.head.weight, other.embed.weight)
