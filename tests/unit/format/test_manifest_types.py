"""The typed manifest (``statekit.Manifest``): what a save returns and a load reads is a
dataclass, and the file on disk stays format ``statekit/1`` byte for byte, in the canonical order.

The two files in ``tests/data`` were written by the dict-based writer (statekit at commit
8d63845, before the typed manifest): a manager's resumed save (records, fingerprint with a
data loader, resume audit) and a plain ``statekit.save``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import warnings
from importlib import resources
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import statekit
from statekit.format import FileEntry, Fingerprint, Lineage, Manifest, ObjectEntry, Reference, ResumeAudit, SourceFile, SourceTensor
from statekit.plugin_api import Storage, read_manifest
from statekit.format.manifest import manifest_bytes

from repo_paths import DATA  # noqa: E402
GOLDEN = [DATA / "manifest-v1-before-typed.json", DATA / "manifest-v1-before-typed-plain.json"]


def key_layout(value):
    """Every key of a JSON value, in order, recursively (the layout ``json.dumps`` writes)."""
    if isinstance(value, dict):
        return [(k, key_layout(v)) for k, v in value.items()]
    if isinstance(value, list):
        return [key_layout(v) for v in value]
    return type(value).__name__


@pytest.mark.parametrize("golden", GOLDEN, ids=lambda p: p.stem)
def test_a_manifest_written_before_the_typed_manifest_round_trips_byte_for_byte(golden, tmp_path):
    raw = golden.read_bytes()
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "statekit.json").write_bytes(raw)

    manifest = read_manifest(Storage(str(ckpt)))

    assert isinstance(manifest, Manifest)
    assert manifest.to_json() == json.loads(raw)
    assert key_layout(manifest.to_json()) == key_layout(json.loads(raw))
    assert manifest_bytes(manifest) == raw
    assert manifest.sealed() == (manifest, raw)  # its checksum is the one it carries


def test_a_save_writes_the_layout_the_dict_writer_wrote(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    url = str(tmp_path / "ckpt")

    returned = statekit.save(url, {"model": model, "optimizer": optimizer, "scheduler": scheduler, "extra": torch.arange(4)},
                             step=7, metadata={"metrics": {"loss": 0.25}, "note": "golden"})

    raw = (tmp_path / "ckpt" / "statekit.json").read_bytes()
    golden = json.loads(GOLDEN[1].read_bytes())
    written = json.loads(raw)
    # the one field added since (issue 38): the state digest, written before the manifest checksum
    digest = written["state_digest"]
    assert list(written)[-2:] == ["state_digest", "manifest_checksum"] and digest["algorithm"] == "emix64"
    assert set(digest["objects"]) == {"model", "extra"}  # plain SGD and the scheduler hold no tensor
    golden = {**{k: v for k, v in golden.items() if k != "manifest_checksum"}, "state_digest": digest,
              "manifest_checksum": golden["manifest_checksum"]}
    fixed = ("created", "manifest_checksum", "fingerprint", "files")  # a time, its checksum, this machine's versions
    assert {k: v for k, v in written.items() if k not in fixed} == {k: v for k, v in golden.items() if k not in fixed}
    unseeded = "rng/"  # statekit-rng's files hold Python's and NumPy's unseeded generators
    assert {r: e for r, e in written["files"].items() if not r.startswith(unseeded)} == {
        r: e for r, e in golden["files"].items() if not r.startswith(unseeded)}
    assert key_layout(written) == key_layout(golden)
    assert list(written["fingerprint"]) == list(golden["fingerprint"])
    assert manifest_bytes(copy.deepcopy(written)) == raw  # the dict writer's bytes for the same object
    assert isinstance(returned, Manifest) and returned.to_json() == written
    assert returned == read_manifest(Storage(url))
    assert returned.step == 7 and returned.metadata["note"] == "golden"
    assert returned.objects["extra"] == ObjectEntry(kind="tensor", owner="statekit", per_rank=False,
                                                     files=("extra.json", "extra.safetensors"))
    assert returned.size_bytes == sum(
        p.stat().st_size for p in (tmp_path / "ckpt").rglob("*") if p.is_file() and p.name != "statekit.json")


def test_a_resumed_manager_save_carries_a_typed_fingerprint_and_resume_audit(tmp_path):
    from accelerate import Accelerator

    def run(resume):
        torch.manual_seed(0)
        accelerator = Accelerator()
        model = torch.nn.Linear(3, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = DataLoader(TensorDataset(torch.arange(32.0).reshape(16, 2)), batch_size=2, shuffle=True,
                            generator=torch.Generator().manual_seed(1))
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        # a full save: the layout of the files written before the typed manifest (an
        # incremental save adds its optional file fields: tests/unit/engine/test_incremental.py)
        manager = statekit.CheckpointManager(accelerator, str(tmp_path / "run"), incremental=False)
        start = (manager.resume() or 0) if resume else 0
        batches = iter(loader)
        next(batches), next(batches)
        return manager.save(step=start + 2, metrics={"loss": 0.5, "acc": 1})

    run(resume=False)
    manifest = run(resume=True)

    raw = (tmp_path / "run" / "checkpoint-00000004" / "statekit.json").read_bytes()
    written = json.loads(raw)
    # what issue 38 added to the layout: the state check in resume_audit, the state digest,
    assert written["resume_audit"].pop("state") == {
        "verdict": "verified", "detail": "2 tensors equal their saved digests (sampled)", "compared": 2, "sampled": True}
    assert list(written.pop("state_digest")) == ["algorithm", "sampling", "objects"]
    # and lineage (issue 38, item 3): run, branch, the checkpoint resumed from
    assert written.pop("lineage")["parent"] == "checkpoint-00000002"
    assert key_layout(written) == key_layout(json.loads(GOLDEN[0].read_bytes()))
    assert isinstance(manifest.fingerprint, Fingerprint) and manifest.fingerprint.world_size == 1
    assert manifest.fingerprint.dataloaders["dataloader_0"].batch_size == 2
    assert isinstance(manifest.resume_audit, ResumeAudit)
    assert manifest.resume_audit.verdict == "verified"
    assert manifest.resume_audit.resumed_from == {"url": str(tmp_path / "run" / "checkpoint-00000002"), "step": 2}
    assert all(isinstance(f, FileEntry) for f in manifest.files.values())
    assert manifest.to_json() == json.loads(raw)


def test_fields_of_a_newer_minor_writer_are_ignored_and_not_written_back(tmp_path):
    """A newer minor writer's keys (same format, fields added) are read past: what this
    version knows loads, and a rewrite by this version writes the canonical manifest without them."""
    newer = json.loads(GOLDEN[0].read_bytes())
    newer["shards"] = {"layout": "flat"}  # top level
    first_file = next(iter(newer["files"]))
    newer["files"][first_file]["compression"] = "zstd"  # a file entry
    newer["objects"]["model_0"]["dtype_policy"] = "bf16"  # an object entry
    newer["fingerprint"]["tensor_parallel"] = 2
    newer["resume_audit"]["batches_compared"] = 8
    raw = manifest_bytes(newer)  # sealed as that writer would

    manifest = Manifest.from_json(raw, "s3://b/ckpt/statekit.json")

    same = Manifest.from_json(GOLDEN[0].read_bytes(), "s3://b/ckpt/statekit.json")
    assert dataclasses.replace(manifest, manifest_checksum=None) == dataclasses.replace(same, manifest_checksum=None)
    assert manifest_bytes(manifest) == GOLDEN[0].read_bytes()


@pytest.mark.parametrize(
    "edit, error, message",
    [
        (lambda m: m.pop("files"), statekit.CorruptCheckpointError, r"s3://b/c/statekit.json: manifest field 'files' missing or not dict"),
        (lambda m: m["files"].update({"x.json": {"size_bytes": "1"}}), statekit.CorruptCheckpointError,
         r"s3://b/c/statekit.json: manifest entry for file 'x.json' is malformed"),
        (lambda m: m["files"].update({"../x.json": next(iter(m["files"].values()))}), statekit.CorruptCheckpointError,
         r"invalid relative path '../x.json'"),
        (lambda m: m["objects"].update({"k": {"kind": 1, "owner": "statekit"}}), statekit.CorruptCheckpointError,
         r"manifest entry for object 'k' is malformed"),
        (lambda m: m.update(step="7"), statekit.CorruptCheckpointError, r"manifest field 'step' is not an integer"),
        (lambda m: m.update(resume_audit=[]), statekit.CorruptCheckpointError, r"manifest field 'resume_audit' is not an object"),
        (lambda m: m.update(format="statekit/4"), statekit.FormatVersionError, r"checkpoint format 'statekit/4' is not supported"),
    ],
)
def test_a_malformed_manifest_is_refused_naming_the_file_and_the_field(edit, error, message):
    manifest = json.loads(GOLDEN[0].read_bytes())
    edit(manifest)
    with pytest.raises(error, match=message):
        Manifest.from_json(manifest_bytes(manifest), "s3://b/c/statekit.json")


def test_an_edited_manifest_fails_its_own_checksum():
    raw = GOLDEN[1].read_bytes().replace(b'"step": 7', b'"step": 8')
    with pytest.raises(statekit.CorruptCheckpointError, match=r"c/statekit.json: the manifest does not match its own checksum"):
        Manifest.from_json(raw, "c/statekit.json")
    with pytest.raises(statekit.CorruptCheckpointError, match=r"c/statekit.json: manifest is not valid JSON"):
        Manifest.from_json(b"{", "c/statekit.json")


def test_the_manifest_is_read_by_attribute_only(tmp_path):
    """The pre-release dict reads are gone: a key read is a TypeError, the JSON form is to_json()."""
    manifest = statekit.save(str(tmp_path / "ckpt"), {"t": torch.ones(2)}, step=3)
    with pytest.raises(TypeError):
        manifest["step"]  # noqa: B018
    assert not hasattr(manifest, "get") and not hasattr(manifest, "keys")
    assert manifest.step == 3 and manifest.to_json()["step"] == 3
    assert manifest.to_json()["files"]["t.safetensors"]["size_bytes"] == manifest.files["t.safetensors"].size_bytes


def test_a_non_strict_load_reports_on_the_manifest_it_returns(tmp_path):
    url = str(tmp_path / "ckpt")
    statekit.save(url, {"model": torch.nn.Linear(2, 2)})
    bigger = torch.nn.Sequential(torch.nn.Linear(2, 2))

    manifest = statekit.load(url, {"model": bigger, "aux": torch.zeros(1)}, strict=False)

    assert manifest.incompatible_keys == {"model": {"missing_keys": ["0.bias", "0.weight"], "unexpected_keys": ["bias", "weight"]}}
    assert manifest.missing_objects == ("aux",)
    assert "incompatible_keys" not in manifest.to_json()  # a load's report, never written


def test_the_schema_and_the_dataclasses_name_the_same_fields():
    schema = json.loads(resources.files("statekit").joinpath("manifest.schema.json").read_text())
    json_fields = lambda cls: {f.name for f in dataclasses.fields(cls) if f.name not in cls._NOT_WRITTEN}  # noqa: E731

    assert set(schema["properties"]) == json_fields(Manifest)
    assert set(schema["$defs"]["file"]["properties"]) == json_fields(FileEntry)
    assert set(schema["$defs"]["object"]["properties"]) == json_fields(ObjectEntry)
    assert set(schema["$defs"]["fingerprint"]["properties"]) == json_fields(Fingerprint)
    assert set(schema["properties"]["resume_audit"]["properties"]) == json_fields(ResumeAudit)
    assert set(schema["properties"]["lineage"]["properties"]) == json_fields(Lineage)
    reference = schema["properties"]["references"]["additionalProperties"]
    assert set(reference["properties"]) == json_fields(Reference)
    assert set(reference["properties"]["files"]["additionalProperties"]["properties"]) == json_fields(SourceFile)
    assert set(reference["properties"]["tensors"]["additionalProperties"]["properties"]) == json_fields(SourceTensor)
    assert set(schema["required"]) == {f for f in json_fields(Manifest) if f not in
                                       ("fingerprint", "resume_audit", "state_digest", "lineage", "references", "manifest_checksum")}


def test_statekit_itself_never_reads_the_manifest_by_key(tmp_path, tiny_accelerate):
    """Every public path (save, load, verify, the manager with Accelerate, attach mode,
    convert, the CLI) reads the typed manifest by attribute: a key read inside statekit
    would warn here."""
    from click.testing import CliRunner

    from statekit.cli import main

    run = tiny_accelerate
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        url = str(tmp_path / "plain")
        statekit.save(url, {"model": torch.nn.Linear(2, 2), "t": torch.ones(2)}, step=1)
        statekit.load(url, {"model": torch.nn.Linear(2, 2), "t": torch.zeros(2), "aux": torch.zeros(1)}, strict=False)
        statekit.verify(url)
        manager = statekit.CheckpointManager(run.accelerator, str(tmp_path / "run"))
        for i, batch in enumerate(run.loader):
            run.train_step(batch)
            if i == 1:
                manager.save(2, metrics={"loss": 0.5})
                break
        statekit.CheckpointManager(run.accelerator, str(tmp_path / "run")).resume()
        statekit.attach(run.accelerator)
        run.accelerator.save_state(str(tmp_path / "attached"))
        run.accelerator.load_state(str(tmp_path / "attached"))
        runner = CliRunner()
        for args in (["inspect", url], ["inspect", str(tmp_path / "run" / "checkpoint-00000002"), "--json"],
                     ["verify", url], ["ls", str(tmp_path / "run")], ["diff", url, url],
                     ["convert", str(tmp_path / "attached"), str(tmp_path / "converted"), "--allow-pickle"]):
            assert runner.invoke(main, args, catch_exceptions=False).exit_code == 0, args
    key_reads = [str(w.message) for w in caught if "is deprecated: the manifest is a typed object" in str(w.message)]
    assert not key_reads


def test_a_manifest_is_written_in_the_canonical_order_whatever_order_it_was_read_in():
    """The canonical order is the fields' declaration order (docs/format.md's tables): a
    manifest whose keys another tool reordered is written back in it, checksum still valid."""
    raw = GOLDEN[0].read_bytes()
    shuffled = json.loads(raw)
    shuffled = {k: shuffled[k] for k in reversed(list(shuffled))}
    shuffled["files"] = {rel: dict(reversed(list(e.items()))) for rel, e in shuffled["files"].items()}
    manifest = Manifest.from_json(json.dumps(shuffled).encode(), "c/statekit.json")

    assert manifest_bytes(manifest) == raw
    written = manifest.to_json()
    assert list(written) == [f.name for f in dataclasses.fields(Manifest) if f.name in written]
