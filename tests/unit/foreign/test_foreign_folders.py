"""Folders statekit did not write, beside its own under one root (issue 36, item 4): a
transformers Trainer checkpoint, an ``Accelerator.save_state`` folder and a DCP directory.

ls, inspect, verify and diff name each for what it is; gc, retention and a save into the
same name never delete them; a manager's resume ignores them; statekit's own incomplete
saves (its lock, no manifest) are still cleared.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import statekit
from statekit.cli import main
from statekit.engine.locking import LOCK_NAME
from statekit.foreign.detect import detect_format, folder_kind, survey
from statekit.manager.listing import delete_all_but, delete_checkpoint, list_checkpoints

from accelerate_helpers import fresh_accelerator  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:no installed plugin saves random-number-generator state")

TRAINER = "checkpoint-500"  # Trainer's own unpadded name
ACCELERATE = "checkpoint-00000200"  # the manager's name, written by Accelerator.save_state
DCP = "checkpoint-00000300"


def _run(*args: str):
    return CliRunner().invoke(main, list(args))


def trainer_checkpoint(path: Path) -> Path:
    """What ``Trainer._save_checkpoint`` writes, by hand (transformers is never imported by statekit)."""
    import safetensors.torch

    path.mkdir(parents=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    safetensors.torch.save_file(model.state_dict(), str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps({"model_type": "tiny", "hidden_size": 4}))
    (path / "trainer_state.json").write_text(json.dumps({"global_step": 500, "epoch": 1.5, "max_steps": 1000,
                                                         "log_history": []}))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    torch.save(optimizer.state_dict(), path / "optimizer.pt")
    torch.save({"step_size": 10}, path / "scheduler.pt")
    torch.save({"python": 1, "cpu": torch.get_rng_state()}, path / "rng_state.pth")
    torch.save({"output_dir": "out"}, path / "training_args.bin")
    return path


def accelerate_folder(path: Path) -> Path:
    accelerator = fresh_accelerator()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    accelerator.save_state(str(path))
    return path


def dcp_folder(path: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to save in a single process"
        dcp.save({"model": torch.nn.Linear(4, 2).state_dict()}, checkpoint_id=str(path))
    return path


def crashed_statekit_save(path: Path) -> Path:
    """What a statekit save killed mid-write leaves: its lock (of a process that is gone) and a partial file."""
    path.mkdir(parents=True)
    (path / LOCK_NAME).write_text(json.dumps({"host": "a-host-long-gone", "pid": 1, "created": 0}))
    (path / "model_0.safetensors").write_bytes(b"partial")
    return path


def digests(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` and its content hash: "byte-identical" made checkable."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def root(tmp_path, plugin_manager):
    """A manager root: statekit checkpoints of steps 1 and 2, the three foreign folders, and
    a crashed statekit save (step 400)."""
    run = tmp_path / "run"
    model = torch.nn.Linear(4, 2)
    manager = statekit.CheckpointManager({"model": model}, str(run))
    manager.save(1)
    manager.save(2)
    trainer_checkpoint(run / TRAINER)
    accelerate_folder(run / ACCELERATE)
    dcp_folder(run / DCP)
    crashed_statekit_save(run / "checkpoint-00000400")
    return run


def foreign_digests(run: Path) -> dict[str, dict[str, str]]:
    return {name: digests(run / name) for name in (TRAINER, ACCELERATE, DCP)}


# --------------------------------------------------------------------------- detection and listing


def test_detection_by_layout(root):
    assert detect_format(str(root / TRAINER)) == "trainer"
    assert detect_format(str(root / ACCELERATE)) == "accelerate"
    assert detect_format(str(root / DCP)) == "dcp"
    from statekit.storage import Storage

    kinds = {name: folder_kind(Storage(str(root / name))) for name in
             ("checkpoint-00000001", TRAINER, ACCELERATE, DCP, "checkpoint-00000400")}
    assert kinds == {"checkpoint-00000001": "statekit", TRAINER: "trainer", ACCELERATE: "accelerate", DCP: "dcp",
                     "checkpoint-00000400": "incomplete"}


def test_trainer_layout_needs_trainer_state(tmp_path):
    from statekit.storage import Storage

    folder = trainer_checkpoint(tmp_path / "t")
    (folder / "trainer_state.json").unlink()
    assert folder_kind(Storage(str(folder))) == "unknown"  # by layout only: no trainer_state.json, no Trainer


def test_listing_classifies_by_content_and_accepts_unpadded_names(root):
    infos = {i.name: i for i in list_checkpoints(str(root))}
    assert {n: (i.kind, i.committed, i.step) for n, i in infos.items()} == {
        "checkpoint-00000001": ("statekit", True, 1),
        "checkpoint-00000002": ("statekit", True, 2),
        ACCELERATE: ("accelerate", False, 200),
        DCP: ("dcp", False, 300),
        "checkpoint-00000400": ("incomplete", False, 400),
        TRAINER: ("trainer", False, 500),
    }
    assert [i.foreign for i in infos.values()].count(True) == 3
    assert infos[TRAINER].description == "a transformers Trainer checkpoint"


def test_an_unpadded_statekit_checkpoint_is_a_committed_checkpoint(tmp_path, plugin_manager):
    """The statekit-transformers plugin names its checkpoints as Trainer does: by content, they are statekit's."""
    statekit.save(str(tmp_path / "out" / "checkpoint-500"), {"model": torch.nn.Linear(2, 2)}, step=500)
    (info,) = list_checkpoints(str(tmp_path / "out"))
    assert (info.name, info.step, info.kind, info.committed) == ("checkpoint-500", 500, "statekit", True)


# --------------------------------------------------------------------------- the CLI


def test_ls_names_foreign_folders(root):
    rows = {Path(r["url"]).name: r for r in json.loads(_run("ls", str(root), "--json").output)}
    assert rows[TRAINER]["kind"] == "trainer" and rows[TRAINER]["committed"] is False
    assert rows[DCP]["description"] == "a torch.distributed.checkpoint (DCP) directory"
    text = CliRunner().invoke(main, ["ls", str(root)], env={"COLUMNS": "400"}).output  # no cell squeezed
    assert "no: a transformers Trainer checkpoint (not written by statekit)" in text
    assert "no: an Accelerate save_state folder (not written by statekit)" in text
    assert "no: a torch.distributed.checkpoint (DCP) directory (not written by statekit)" in text
    assert text.count("NO (incomplete)") == 1  # only statekit's own crashed save


def test_inspect_names_foreign_folders(root):
    text = _run("inspect", str(root / TRAINER), "--tensors")
    assert text.exit_code == 0, text.output
    assert "trainer: a transformers Trainer checkpoint, not a statekit checkpoint" in text.output
    assert "incomplete" not in text.output and "never committed" not in text.output
    assert "model.safetensors:weight" in text.output and '"global_step": 500' in text.output
    assert "optimizer.pt" in text.output and "(pickle: use --allow-pickle)" in text.output
    payload = json.loads(_run("inspect", str(root / TRAINER), "--json").output)
    assert payload["format"] == "trainer" and payload["tensor_count"] == 2
    assert payload["metadata"] == {"global_step": 500, "epoch": 1.5, "max_steps": 1000}
    assert set(payload["files"]) == {"model.safetensors", "config.json", "trainer_state.json", "optimizer.pt",
                                     "scheduler.pt", "rng_state.pth", "training_args.bin"}
    accelerate = _run("inspect", str(root / ACCELERATE))
    assert accelerate.exit_code == 0 and "an Accelerate save_state folder, not a statekit checkpoint" in accelerate.output


def test_inspect_with_pickle_reads_the_trainer_optimizer(root):
    payload = json.loads(_run("inspect", str(root / TRAINER), "--allow-pickle", "--tensors", "--json").output)
    keys = {t["key"] for t in payload["tensors"]}
    assert {"model.safetensors:weight", "optimizer.pt:state.0.exp_avg"} <= keys
    assert payload["skipped"] == []


@pytest.mark.parametrize("name, what", [
    (TRAINER, "a transformers Trainer checkpoint"),
    (ACCELERATE, "an Accelerate save_state folder"),
    (DCP, "a torch.distributed.checkpoint (DCP) directory"),
])
def test_verify_of_a_foreign_folder_claims_no_checksums(root, name, what):
    result = _run("verify", str(root / name))
    assert result.exit_code == 3, result.output  # not verified: there is nothing to verify against
    assert f"not verified: {root / name} is not a statekit checkpoint but {what}" in result.output
    assert "no checksums to verify" in result.output and "incomplete" not in result.output
    assert "ok:" not in result.output and "verified (" not in result.output
    if name != DCP:
        assert "checked     model.safetensors: safetensors header readable: 2 tensors" in result.output
    else:
        assert "not read    .metadata: a pickle" in result.output
    report = json.loads(_run("verify", str(root / name), "--json").output)
    assert report["ok"] is False and report["checks_ok"] is True and report["description"] == what
    assert report["size_bytes"] == sum(report["files"].values()) > 0


def test_verify_of_a_trainer_checkpoint_with_a_damaged_model_fails(root):
    model = root / TRAINER / "model.safetensors"
    model.write_bytes(model.read_bytes()[:-3])  # truncated: the header promises more data than the file holds
    result = _run("verify", str(root / TRAINER))
    assert result.exit_code == 1
    assert "FAILED" in result.output and f"error: {root / TRAINER}/model.safetensors" in result.output


def test_verify_of_a_sharded_trainer_model_checks_its_index(tmp_path):
    folder = trainer_checkpoint(tmp_path / "checkpoint-7")
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"weight": "model-00001-of-00002.safetensors",
                                            "bias": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    checks = {c.file: c for c in survey(str(folder)).checks}
    assert checks["model-00001-of-00002.safetensors"].ok is True
    assert checks["model.safetensors.index.json"].ok is False
    assert "model-00002-of-00002.safetensors" in checks["model.safetensors.index.json"].detail


def test_verify_of_a_crashed_statekit_save_still_says_so(root):
    result = _run("verify", str(root / "checkpoint-00000400"))
    assert result.exit_code == 1 and "never committed" in result.output


def test_diff_names_both_sides(root):
    result = _run("diff", str(root / TRAINER), str(root / "checkpoint-00000001"))
    assert result.exit_code == 0, result.output
    assert f"a  {root / TRAINER}  (trainer: a transformers Trainer checkpoint, 2 tensors" in result.output
    assert f"b  {root / 'checkpoint-00000001'}  (statekit, 2 tensors" in result.output
    report = json.loads(_run("diff", str(root / TRAINER), str(root / ACCELERATE), "--json").output)
    assert report["a"]["description"] == "a transformers Trainer checkpoint"
    assert report["b"]["description"] == "an Accelerate save_state folder"
    assert report["identical"] is False or report["tensors"]  # same seed: the model tensors were compared
    assert {t["key"] for t in report["tensors"]} == {"model.safetensors:weight", "model.safetensors:bias"}


def test_gc_deletes_nothing_foreign(root):
    before = foreign_digests(root)
    dry = _run("gc", str(root), "--dry-run")
    assert dry.exit_code == 0, dry.output
    assert f"would remove {root / 'checkpoint-00000400'}" in dry.output
    assert f"kept {root / TRAINER} (a transformers Trainer checkpoint, not written by statekit)" in dry.output
    assert f"kept {root / ACCELERATE} (an Accelerate save_state folder, not written by statekit)" in dry.output
    assert f"kept {root / DCP} (a torch.distributed.checkpoint (DCP) directory, not written by statekit)" in dry.output
    assert (root / "checkpoint-00000400").exists()
    report = json.loads(_run("gc", str(root), "--json").output)
    assert report["removed"] == [str(root / "checkpoint-00000400")]
    assert {Path(k["url"]).name: k["kind"] for k in report["kept"]} == {TRAINER: "trainer", ACCELERATE: "accelerate",
                                                                       DCP: "dcp"}
    assert not (root / "checkpoint-00000400").exists()
    assert foreign_digests(root) == before  # every file still there, byte for byte
    statekit.verify(str(root / "checkpoint-00000002"))


def test_gc_keeps_unknown_and_empty_folders(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoint-00000001").mkdir(parents=True)
    (run / "checkpoint-00000001" / "notes.txt").write_text("mine")
    (run / "checkpoint-00000002").mkdir()
    result = _run("gc", str(run))
    assert result.exit_code == 0
    assert "kept" in result.output and "'notes.txt'" in result.output and "an empty folder" in result.output
    assert (run / "checkpoint-00000001" / "notes.txt").read_text() == "mine" and (run / "checkpoint-00000002").is_dir()


# --------------------------------------------------------------------------- the manager and the save path


def test_retention_resume_and_deletion_leave_foreign_folders_alone(root, plugin_manager):
    before = foreign_digests(root)
    model = torch.nn.Linear(4, 2)
    manager = statekit.CheckpointManager({"model": model}, str(root), keep_last=1)
    assert manager.resume() == 2  # not 500, 300 or 200: those are not statekit checkpoints
    for step in (3, 4, 5):
        manager.save(step)
    names = sorted(p.name for p in root.iterdir() if p.is_dir())
    # kept: the newest, the one resumed from (the manager's rule), and everything statekit did not write
    assert names == ["checkpoint-00000002", "checkpoint-00000005", ACCELERATE, DCP, "checkpoint-00000400", TRAINER]
    assert foreign_digests(root) == before
    assert manager.latest() == str(root / "checkpoint-00000005")
    # the deletion loop and the deletion itself refuse a foreign folder, whatever they are handed
    infos = list_checkpoints(str(root))
    with pytest.warns(statekit.StatekitWarning, match="checkpoint-00000002"):  # the manager reads it: in use
        assert delete_all_but(infos, set(), None) == ["checkpoint-00000005"]
    with pytest.raises(statekit.StatekitError, match="a transformers Trainer checkpoint, not written by statekit: not deleted"):
        delete_checkpoint(str(root / TRAINER))
    assert foreign_digests(root) == before


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_save_into_a_foreign_folder_refuses(root, overwrite):
    before = foreign_digests(root)
    manager = statekit.CheckpointManager({"model": torch.nn.Linear(4, 2)}, str(root))
    with pytest.raises(statekit.CheckpointExistsError) as info:
        manager.save(300, overwrite=overwrite)
    message = str(info.value)
    assert str(root / DCP) in message and "a torch.distributed.checkpoint (DCP) directory" in message
    assert "not written by statekit" in message
    with pytest.raises(statekit.CheckpointExistsError, match="a transformers Trainer checkpoint"):
        statekit.save(str(root / TRAINER), {"model": torch.nn.Linear(4, 2)}, overwrite=overwrite)
    assert foreign_digests(root) == before
    assert not (root / DCP / LOCK_NAME).exists() and not (root / TRAINER / LOCK_NAME).exists()


def test_a_save_takes_over_a_crashed_statekit_save(root):
    statekit.save(str(root / "checkpoint-00000400"), {"w": torch.ones(2)}, step=400)
    statekit.verify(str(root / "checkpoint-00000400"))
    assert not (root / "checkpoint-00000400" / "model_0.safetensors").exists()  # the crashed save's partial file


def test_a_failed_save_leaves_statekit_s_mark_and_gc_removes_it(tmp_path, plugin_manager):
    class Broken:
        def state_dict(self):
            raise RuntimeError("broken state")

        def load_state_dict(self, state):
            pass

    run = tmp_path / "run"
    with pytest.raises(RuntimeError, match="broken state"):
        statekit.save(str(run / "checkpoint-00000001"), {"t": torch.ones(1), "b": Broken()})
    lock = json.loads((run / "checkpoint-00000001" / LOCK_NAME).read_text())
    assert lock["failed"] is True and lock["host"] == socket.gethostname()
    (info,) = list_checkpoints(str(run))
    assert info.kind == "incomplete"
    statekit.save(str(run / "checkpoint-00000001"), {"t": torch.ones(1)})  # a retry takes it over
    statekit.save(str(run / "checkpoint-00000002"), {"t": torch.ones(1)})
    with pytest.raises(RuntimeError):
        statekit.save(str(run / "checkpoint-00000003"), {"t": torch.ones(1), "b": Broken()})
    report = json.loads(_run("gc", str(run), "--json").output)
    assert report["removed"] == [str(run / "checkpoint-00000003")] and not (run / "checkpoint-00000003").exists()


def test_an_interrupted_deletion_is_left_recognisably_statekits(tmp_path, plugin_manager, monkeypatch):
    """A deletion stopped after the manifest went: statekit's lock stays, so gc finishes it."""
    from statekit.engine import locking

    url = str(tmp_path / "run" / "checkpoint-00000001")
    statekit.save(url, {"t": torch.ones(1)})

    def stop(storage):
        storage.remove("statekit.json")
        raise OSError("killed")

    monkeypatch.setattr(locking, "_clear_owned", stop)
    with pytest.raises(OSError):
        delete_checkpoint(url)
    monkeypatch.undo()
    (info,) = list_checkpoints(str(tmp_path / "run"))
    assert (info.kind, info.committed) == ("incomplete", False)
    assert json.loads(_run("gc", str(tmp_path / "run"), "--json").output)["removed"] == [url]


def test_loading_a_dcp_directory_says_what_it_is(root):
    with pytest.raises(statekit.IncompleteCheckpointError) as info:
        statekit.load(str(root / DCP), {"model": torch.nn.Linear(4, 2)})
    assert "is a torch.distributed.checkpoint (DCP) directory, not a statekit checkpoint" in str(info.value)
    assert "never committed" not in str(info.value)
