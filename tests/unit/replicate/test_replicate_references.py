"""Two-tier checkpoints of a run that references its frozen base (issue 47): the replica
carries the pretrained folder's files once per ``base_id`` to ``<replica>/.statekit-bases/``
before its manifest commits, so it loads bit for bit after the primary machine and the
original folder are gone; retention never deletes a carried base; ``statekit gc`` removes
one no committed checkpoint references, and never what statekit did not write."""

from __future__ import annotations

import json
import os
import shutil
import warnings

import pytest
import torch
from click.testing import CliRunner

import statekit
from statekit.cli import main as cli
from statekit.plugin_api import CarriedCopy, MANIFEST_NAME, Storage, carry_references, read_manifest
from statekit_replicate import remote_copy

transformers = pytest.importorskip("transformers")
from transformers import GPT2LMHeadModel  # noqa: E402

from reference_helpers import (  # noqa: E402
    BASE_FILE, assert_same, base_folder, config, fine_tune, frozen_but_h1, optimizer, step,
)


def base_id_of(ckpt: str) -> str:
    with open(os.path.join(ckpt, MANIFEST_NAME)) as f:
        return json.load(f)["references"]["model"]["base_id"]


def gc(root, *args: str) -> dict:
    result = CliRunner().invoke(cli, ["gc", str(root), "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def replicating_manager(objects: dict, tmp_path, **options) -> statekit.CheckpointManager:
    return statekit.CheckpointManager(objects, str(tmp_path / "local"), replicate_to=str(tmp_path / "replica"), **options)


def test_a_replica_loads_bit_exact_after_the_base_and_the_primary_are_gone_and_carries_the_base_once(tmp_path, plugin_manager):
    folder = base_folder(tmp_path / "base")
    model, optim = fine_tune(folder)
    manager = replicating_manager({"model": model, "optim": optim}, tmp_path)
    manager.save(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", statekit.StatekitWarning)  # replicated, nothing left behind
        manager.wait(timeout=60)
    replica = tmp_path / "replica"
    base_id = base_id_of(str(replica / "checkpoint-00000001"))
    carried = replica / ".statekit-bases" / base_id
    assert sorted(os.listdir(carried)) == [BASE_FILE, "statekit-base.json"]  # only the referenced file, and the record
    assert (carried / BASE_FILE).read_bytes() == (tmp_path / "base" / BASE_FILE).read_bytes()
    replicator = manager.plugin_state["replicate"]
    size = os.path.getsize(carried / BASE_FILE)
    assert replicator.carried_bytes == size
    before = os.stat(carried / BASE_FILE)

    step(model, optim, 2)
    manager.save(2)
    manager.wait(timeout=60)
    assert base_id_of(str(replica / "checkpoint-00000002")) == base_id
    assert replicator.carried_bytes == size  # the second copy found the base carried: not one byte again
    after = os.stat(carried / BASE_FILE)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert os.listdir(replica / ".statekit-bases") == [base_id]

    shutil.rmtree(folder)  # the pretrained folder and the primary tier are gone
    shutil.rmtree(tmp_path / "local")
    statekit.verify(str(replica / "checkpoint-00000002"))  # every referenced tensor checked in the carried copy
    fresh = frozen_but_h1(GPT2LMHeadModel(config()))
    fresh_optim = optimizer(fresh)
    statekit.load(str(replica / "checkpoint-00000002"), {"model": fresh, "optim": fresh_optim})
    assert_same(model, fresh)
    step(model, optim, 3), step(fresh, fresh_optim, 3)  # the optimizer state came back too
    assert_same(model, fresh)


def test_a_fresh_node_resumes_from_the_replica_without_the_base(tmp_path, plugin_manager):
    folder = base_folder(tmp_path / "base")
    model, optim = fine_tune(folder)
    manager = replicating_manager({"model": model, "optim": optim}, tmp_path)
    manager.save(4)
    manager.wait(timeout=60)
    shutil.rmtree(folder)
    fresh = frozen_but_h1(GPT2LMHeadModel(config()))
    objects = {"model": fresh, "optim": optimizer(fresh)}
    other = statekit.CheckpointManager(objects, str(tmp_path / "node-b"), replicate_to=str(tmp_path / "replica"))
    assert other.resume() == 4
    assert other.resumed_from == str(tmp_path / "replica" / "checkpoint-00000004")
    assert_same(model, fresh)


def test_a_replica_is_never_committed_without_its_base(tmp_path, plugin_manager):
    folder = base_folder(tmp_path / "base")
    model, _ = fine_tune(folder)
    src = str(tmp_path / "local" / "checkpoint-00000001")
    statekit.save(src, {"model": model})
    shutil.rmtree(folder)  # before the copy: no folder, no carried copy beside the source
    dst = Storage(str(tmp_path / "replica" / "checkpoint-00000001"))
    with pytest.raises(statekit.MissingBaseError, match=r"references frozen tensors in .*base.*no carried copy"):
        remote_copy.copy_checkpoint(Storage(src), dst)
    assert not dst.exists(MANIFEST_NAME)


def test_a_carried_file_that_differs_is_copied_again(tmp_path):
    folder = base_folder(tmp_path / "base")
    model, _ = fine_tune(folder)
    src = Storage(str(tmp_path / "local" / "checkpoint-00000001"))
    statekit.save(src.url, {"model": model})
    references = read_manifest(src).references
    dst = Storage(str(tmp_path / "replica" / "checkpoint-00000001"))
    [first] = carry_references(references, src, dst)
    size = os.path.getsize(os.path.join(folder, BASE_FILE))
    assert first == CarriedCopy(base_id_of(src.url), f"{tmp_path}/replica/.statekit-bases/{first.base_id}", 1, size)
    assert carry_references(references, src, dst) == [CarriedCopy(first.base_id, first.url, 0, 0)]  # there: not again
    with open(os.path.join(first.url, BASE_FILE), "r+b") as f:  # a damaged header (same size)
        f.seek(20)
        f.write(b"#")
    assert carry_references(references, src, dst) == [first]
    with open(os.path.join(first.url, BASE_FILE), "rb") as a, open(os.path.join(folder, BASE_FILE), "rb") as b:
        assert a.read() == b.read()


def test_retention_keeps_a_carried_base_while_referenced_and_gc_removes_it_when_not(tmp_path, plugin_manager):
    folder = base_folder(tmp_path / "base")
    original = {n: (tmp_path / "base" / n).read_bytes() for n in os.listdir(folder)}
    model, optim = fine_tune(folder)
    manager = replicating_manager({"model": model, "optim": optim}, tmp_path, keep_last=1, remote_keep_last=1)
    for s in (1, 2):
        step(model, optim, s)
        manager.save(s)
        manager.wait(timeout=60)
    replica, local = tmp_path / "replica", tmp_path / "local"
    carried = replica / ".statekit-bases" / base_id_of(str(replica / "checkpoint-00000002"))
    assert sorted(n for n in os.listdir(replica) if n.startswith("checkpoint-")) == ["checkpoint-00000002"]
    assert sorted(n for n in os.listdir(local) if n.startswith("checkpoint-")) == ["checkpoint-00000002"]
    assert carried.is_dir()  # retention of both tiers deleted checkpoint 1, never the base
    report = gc(replica)
    assert report["removed"] == []
    assert report["kept"] == [{"url": str(carried), "reason": f"referenced by {replica}/checkpoint-00000002",
                               "kind": "carried base"}]

    statekit.reference_pretrained(model, None)  # from now on the base is written: no checkpoint references it
    step(model, optim, 3)
    manager.save(3)
    manager.wait(timeout=60)
    assert read_manifest(Storage(str(replica / "checkpoint-00000003"))).references is None
    assert sorted(n for n in os.listdir(replica) if n.startswith("checkpoint-")) == ["checkpoint-00000003"]
    assert carried.is_dir()  # retention still leaves it: gc's to remove
    assert gc(replica, "--dry-run") == {"dry_run": True, "removed": [str(carried)], "kept": []}
    assert carried.is_dir()
    assert gc(replica) == {"dry_run": False, "removed": [str(carried)], "kept": []}
    assert os.listdir(replica / ".statekit-bases") == []
    assert gc(local) == {"dry_run": False, "removed": [], "kept": []}  # the primary carries nothing
    assert {n: (tmp_path / "base" / n).read_bytes() for n in os.listdir(folder)} == original  # never touched

    fresh = frozen_but_h1(GPT2LMHeadModel(config()))
    statekit.load(str(replica / "checkpoint-00000003"), {"model": fresh})
    assert_same(model, fresh)


def test_gc_never_removes_a_base_folder_statekit_did_not_write(tmp_path):
    folder = base_folder(tmp_path / "base")
    mine = tmp_path / "root" / ".statekit-bases" / "0123456789abcdef"
    shutil.copytree(folder, mine)  # put there by hand: no statekit record
    statekit.save(str(tmp_path / "root" / "checkpoint-00000001"), {"t": torch.arange(3.0)})
    report = gc(tmp_path / "root")
    assert report["removed"] == []
    assert report["kept"] == [{"url": str(mine), "reason": "not written by statekit", "kind": "carried base"}]
    assert sorted(os.listdir(mine)) == sorted(os.listdir(folder))


def test_gc_of_the_replica_keeps_an_unreferenced_base_while_a_copy_is_in_progress(tmp_path, monkeypatch):
    folder = base_folder(tmp_path / "base")
    model, _ = fine_tune(folder)
    src = Storage(str(tmp_path / "local" / "checkpoint-00000001"))
    statekit.save(src.url, {"model": model})
    dst = Storage(str(tmp_path / "replica" / "checkpoint-00000001"))
    carried = f"{tmp_path}/replica/.statekit-bases/{base_id_of(src.url)}"
    reports = []
    real_commit = Storage.commit

    def gc_then_commit(self, rel, data, exclusive=False):  # gc runs once the base is carried, before the manifest
        reports.append(gc(tmp_path / "replica"))
        return real_commit(self, rel, data, exclusive)

    monkeypatch.setattr(Storage, "commit", gc_then_commit)
    remote_copy.copy_checkpoint(src, dst)
    [report] = reports
    assert report["removed"] == []
    kept = {k["url"]: k["reason"] for k in report["kept"]}
    assert kept[carried] == f"{dst.url} is being saved or copied and may reference it"
    shutil.rmtree(folder)
    fresh = frozen_but_h1(GPT2LMHeadModel(config()))
    statekit.load(dst.url, {"model": fresh})
    assert_same(model, fresh)
