"""Two-tier checkpoints (issue 15): local commits replicated to S3 (moto server over HTTP)
in the background, verified, manifest last; resume from the newest copy on either tier."""

from __future__ import annotations

import warnings

import pytest
import torch

import statekit
from statekit import format as fmt
from statekit_replicate import remote_copy, replication
from statekit.manager.listing import checkpoint_name
from statekit.storage import Storage

pytestmark = pytest.mark.s3


def _objects(seed: int) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Linear(64, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    return {"model": model, "optim": opt, "extra": {"seed": seed}}


def _train(objects: dict, steps: int) -> None:
    for _ in range(steps):
        objects["model"](torch.randn(4, 64)).sum().backward()
        objects["optim"].step()
        objects["optim"].zero_grad()


def _assert_same(a: dict, b: dict) -> None:
    for k, v in a["model"].state_dict().items():
        assert torch.equal(v, b["model"].state_dict()[k]), k
    sa, sb = a["optim"].state_dict()["state"], b["optim"].state_dict()["state"]
    for i in sa:
        for k in sa[i]:
            assert torch.equal(sa[i][k], sb[i][k]), (i, k)
    assert a["extra"] == b["extra"]


def test_replicated_checkpoints_verify_on_both_tiers_and_manifests_match(tmp_path, s3_bucket, plugin_manager):
    remote = f"{s3_bucket}/run"
    objects = _objects(0)
    manager = statekit.CheckpointManager(objects, str(tmp_path / "local"), replicate_to=remote)
    for step in (1, 2, 3):
        _train(objects, 1)
        manager.save(step)
    with warnings.catch_warnings():
        warnings.simplefilter("error", statekit.StatekitWarning)  # nothing left unreplicated
        manager.wait(timeout=120)
    for step in (1, 2, 3):
        name = checkpoint_name(step)
        statekit.verify(str(tmp_path / "local" / name))
        statekit.verify(f"{remote}/{name}")
        local_manifest = (tmp_path / "local" / name / fmt.MANIFEST_NAME).read_bytes()
        assert Storage(f"{remote}/{name}").read_bytes(fmt.MANIFEST_NAME) == local_manifest
    assert [i.step for i in manager.plugin_state["replicate"].list() if i.committed] == [1, 2, 3]


def test_fresh_node_resumes_bit_exactly_from_the_remote_tier(tmp_path, s3_bucket, plugin_manager):
    remote = f"{s3_bucket}/run"
    objects = _objects(0)
    manager = statekit.CheckpointManager(objects, str(tmp_path / "node-a"), replicate_to=remote, async_save=True)
    _train(objects, 2)
    manager.save(7)  # async: replication starts at its commit
    manager.wait(timeout=120)
    fresh = _objects(1)
    other = statekit.CheckpointManager(fresh, str(tmp_path / "node-b"), replicate_to=remote)  # empty local root
    assert other.resume() == 7
    assert other.resumed_from == f"{remote}/{checkpoint_name(7)}"
    _assert_same(objects, fresh)
    assert not (tmp_path / "node-b" / checkpoint_name(7)).exists()  # streamed, no staging copy


def test_same_step_with_different_manifests_warns_and_uses_local(tmp_path, s3_bucket, plugin_manager):
    remote = f"{s3_bucket}/run"
    statekit.save(f"{remote}/{checkpoint_name(5)}", _objects(9), step=5)  # another run's step 5
    objects = _objects(0)
    manager = statekit.CheckpointManager(objects, str(tmp_path / "local"), replicate_to=remote)
    manager.save(5)
    with pytest.warns(statekit.StatekitWarning, match="committed with another manifest"):
        manager.wait(timeout=60)  # the remote copy is left untouched
    fresh = _objects(1)
    again = statekit.CheckpointManager(fresh, str(tmp_path / "local"), replicate_to=remote)
    with pytest.warns(statekit.StatekitWarning, match=r"hold step 5 with different manifests; using the local one"):
        assert again.resume() == 5
    assert again.resumed_from == str(tmp_path / "local" / checkpoint_name(5))
    _assert_same(objects, fresh)


def test_resume_falls_back_to_the_remote_copy_when_the_local_one_is_corrupt(tmp_path, s3_bucket, plugin_manager):
    remote = f"{s3_bucket}/run"
    objects = _objects(0)
    manager = statekit.CheckpointManager(objects, str(tmp_path / "local"), replicate_to=remote)
    manager.save(4)
    manager.wait(timeout=60)
    bad = tmp_path / "local" / checkpoint_name(4) / "optim.safetensors"
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 1
    bad.write_bytes(bytes(data))
    fresh = _objects(1)
    again = statekit.CheckpointManager(fresh, str(tmp_path / "local"), replicate_to=remote)
    with pytest.warns(statekit.StatekitWarning, match=r"cannot resume from .*local/checkpoint-00000004"):
        assert again.resume() == 4
    assert again.resumed_from == f"{remote}/{checkpoint_name(4)}"
    _assert_same(objects, fresh)


def test_endpoint_down_training_goes_on_and_wait_names_what_is_not_replicated(tmp_path, plugin_manager):
    dead = {"key": "x", "secret": "x", "client_kwargs": {"endpoint_url": "http://127.0.0.1:9"},
            "config_kwargs": {"connect_timeout": 0.5, "read_timeout": 0.5, "retries": {"max_attempts": 1}}}
    objects = _objects(0)
    with pytest.warns(statekit.StatekitWarning):
        manager = statekit.CheckpointManager(objects, str(tmp_path / "local"), replicate_to="s3://down/run",
                                             replicate_options=dead, keep_last=1)
    manager.plugin_state["replicate"].retries, manager.plugin_state["replicate"].backoff_seconds = 2, 0.05
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        manager.save(1)
        manager.save(2)  # local saves go on
        missing = manager.plugin_state["replicate"].wait(timeout=60)
    messages = [str(w.message) for w in caught]
    assert any("s3://down/run/checkpoint-00000001: replication try 1 of 2 failed" in m for m in messages), messages
    assert any("s3://down/run/checkpoint-00000001: not replicated" in m for m in messages), messages
    assert set(missing) == {checkpoint_name(1), checkpoint_name(2)}
    # keep_last=1, but an unreplicated checkpoint is never deleted locally
    assert (tmp_path / "local" / checkpoint_name(1) / fmt.MANIFEST_NAME).exists()


def test_a_killed_upload_leaves_no_committed_remote_copy_and_the_next_start_finishes_it(tmp_path, s3_bucket, plugin_manager, monkeypatch):
    remote = f"{s3_bucket}/run"
    objects = _objects(0)
    statekit.CheckpointManager(objects, str(tmp_path / "local")).save(3)  # committed locally, never replicated
    src = Storage(str(tmp_path / "local" / checkpoint_name(3)))
    dst = Storage(f"{remote}/{checkpoint_name(3)}")
    real_commit = Storage.commit

    def killed(self, rel, data, exclusive=False):  # the process dies between the files and the manifest
        raise KeyboardInterrupt

    monkeypatch.setattr(Storage, "commit", killed)
    with pytest.raises(KeyboardInterrupt):
        remote_copy.copy_checkpoint(src, dst)
    monkeypatch.setattr(Storage, "commit", real_commit)
    assert dst.exists("model.safetensors") and not dst.exists(fmt.MANIFEST_NAME)
    with pytest.raises(statekit.IncompleteCheckpointError):
        statekit.verify(dst.url)
    manager = statekit.CheckpointManager(_objects(1), str(tmp_path / "local"), replicate_to=remote)
    assert manager.plugin_state["replicate"].pending() in ([checkpoint_name(3)], [])  # queued at start
    manager.wait(timeout=60)
    statekit.verify(dst.url)


def test_remote_retention_and_local_retention_after_replication(tmp_path, s3_bucket, plugin_manager):
    remote = f"{s3_bucket}/run"
    objects = _objects(0)
    manager = statekit.CheckpointManager(objects, str(tmp_path / "local"), keep_last=1, replicate_to=remote, remote_keep_last=2)
    for step in range(1, 5):
        manager.save(step)
        manager.wait(timeout=60)
    assert [i.step for i in manager.plugin_state["replicate"].list() if i.committed] == [3, 4]
    assert [i.step for i in manager.list() if i.committed] == [4]


def test_restarts_do_not_copy_again_what_remote_retention_deleted(tmp_path, s3_bucket, plugin_manager, monkeypatch):
    remote = f"{s3_bucket}/run"
    objects = _objects(0)
    options = dict(keep_last=3, replicate_to=remote, remote_keep_last=1)
    manager = statekit.CheckpointManager(objects, str(tmp_path / "local"), **options)
    for step in (1, 2, 3):
        manager.save(step)
        manager.wait(timeout=60)
    assert [i.step for i in manager.plugin_state["replicate"].list() if i.committed] == [3]  # the copy just made counts too
    copies: list[str] = []
    real = replication.copy_checkpoint
    monkeypatch.setattr(replication, "copy_checkpoint", lambda src, dst, *a, **k: (copies.append(dst.url), real(src, dst, *a, **k))[1])
    for _restart in range(2):
        manager = statekit.CheckpointManager(_objects(1), str(tmp_path / "local"), **options)
        assert manager.resume() == 3
        manager.wait(timeout=60)
        assert copies == []  # steps 1 and 2 were replicated once and retired by policy: not uploaded again
        assert [i.step for i in manager.plugin_state["replicate"].list() if i.committed] == [3]
    manager.save(4)  # local retention may now delete 1 (its copy was retired, not lost)
    manager.wait(timeout=60)
    assert [i.step for i in manager.list() if i.committed] == [2, 3, 4]
    assert [i.step for i in manager.plugin_state["replicate"].list() if i.committed] == [4]


def test_a_start_after_a_killed_copy_still_copies_what_remote_retention_keeps(tmp_path, s3_bucket, plugin_manager):
    remote, local = f"{s3_bucket}/run", tmp_path / "local"
    objects = _objects(0)
    manager = statekit.CheckpointManager(objects, str(local), replicate_to=remote, remote_keep_last=2)
    manager.save(1)
    manager.wait(timeout=60)
    for step in (2, 3):  # committed locally by a process killed before it copied them
        statekit.save(str(local / checkpoint_name(step)), objects, step=step)
    manager = statekit.CheckpointManager(_objects(1), str(local), replicate_to=remote, remote_keep_last=2)
    manager.wait(timeout=60)
    assert [i.step for i in manager.plugin_state["replicate"].list() if i.committed] == [2, 3]


def test_gc_of_the_remote_root_keeps_a_copy_in_progress(tmp_path, plugin_manager, monkeypatch):
    from click.testing import CliRunner

    from statekit.cli import main

    statekit.save(str(tmp_path / "src"), _objects(0))
    src, dst = Storage(str(tmp_path / "src")), Storage(str(tmp_path / "remote" / checkpoint_name(1)))
    outputs = []
    real_commit = Storage.commit

    def gc_then_commit(self, rel, data, exclusive=False):  # gc runs after the files, before the manifest
        outputs.append(CliRunner().invoke(main, ["gc", str(tmp_path / "remote"), "--json"]).output)
        return real_commit(self, rel, data, exclusive)

    monkeypatch.setattr(Storage, "commit", gc_then_commit)
    remote_copy.copy_checkpoint(src, dst)
    report = __import__("json").loads(outputs[0])
    assert report["removed"] == [] and report["kept"][0]["url"] == dst.url
    statekit.verify(dst.url)
    assert ".statekit-lock" not in dst.listdir()  # released at the commit


def test_copy_refuses_a_destination_file_that_differs(tmp_path, plugin_manager, monkeypatch):
    """A file altered on its way is caught at the destination (size and checksum)."""
    statekit.save(str(tmp_path / "src"), _objects(0))
    src, dst = Storage(str(tmp_path / "src")), Storage(str(tmp_path / "dst"))
    real_open_write = Storage.open_write

    class Flip:
        def __init__(self, inner):
            self._inner, self._done = inner, False

        def write(self, data):
            data = bytearray(data)
            if not self._done and data:
                data[0] ^= 1
                self._done = True
            return self._inner.write(bytes(data))

    from contextlib import contextmanager

    @contextmanager
    def flipping(self, rel):
        with real_open_write(self, rel) as f:
            yield Flip(f) if rel == "optim.safetensors" else f

    monkeypatch.setattr(Storage, "open_write", flipping)
    with pytest.raises(statekit.CorruptCheckpointError, match=r"dst/optim.safetensors"):
        remote_copy.copy_checkpoint(src, dst)
    assert not dst.exists(fmt.MANIFEST_NAME)


def _two_node_checkpoint(tmp_path) -> tuple[bytes, Storage, Storage]:
    """A committed checkpoint whose manifest says rank 1 wrote the optimizer files,
    split over two local directories as two nodes' disks would hold it."""
    import json
    import shutil

    statekit.save(str(tmp_path / "node0" / "c"), _objects(0), step=1)
    manifest = json.loads((tmp_path / "node0" / "c" / fmt.MANIFEST_NAME).read_bytes())
    for rel, meta in manifest["files"].items():
        if rel.startswith("optim"):
            meta["rank"] = 1
            (tmp_path / "node1" / "c").mkdir(parents=True, exist_ok=True)
            shutil.move(tmp_path / "node0" / "c" / rel, tmp_path / "node1" / "c" / rel)
    assert any(m["rank"] == 1 for m in manifest["files"].values())
    raw = fmt.manifest_bytes(manifest)  # re-sealed: the rank fields changed
    return raw, Storage(str(tmp_path / "node0" / "c")), Storage(str(tmp_path / "node1" / "c"))


def test_each_rank_copies_its_own_files_and_rank0_commits_after_every_marker(tmp_path):
    import threading

    raw, node0, node1 = _two_node_checkpoint(tmp_path)
    dst = Storage(str(tmp_path / "remote" / "c"))
    rank1 = threading.Thread(target=lambda: remote_copy.copy_checkpoint(node1, dst, raw, rank=1, world_size=2))
    rank0_done = []
    rank0 = threading.Thread(target=lambda: rank0_done.append(remote_copy.copy_checkpoint(node0, dst, raw, rank=0, world_size=2)))
    rank0.start()
    rank0.join(1.5)
    assert rank0.is_alive() and not dst.exists(fmt.MANIFEST_NAME)  # waits for rank 1's part
    rank1.start()
    rank1.join(60)
    rank0.join(60)
    assert rank0_done and dst.read_bytes(fmt.MANIFEST_NAME) == raw
    assert set(dst.find()) == set(rank0_done[0].files) | {fmt.MANIFEST_NAME}  # the markers are gone
    statekit.verify(dst.url)


def test_rank0_never_commits_without_every_ranks_part(tmp_path):
    raw, node0, _ = _two_node_checkpoint(tmp_path)
    dst = Storage(str(tmp_path / "remote" / "c"))
    with pytest.raises(statekit.StatekitError, match=r"rank\(s\) \[1\] did not replicate their files within 1 s"):
        remote_copy.copy_checkpoint(node0, dst, raw, rank=0, world_size=2, peer_timeout_seconds=1)
    assert not dst.exists(fmt.MANIFEST_NAME)
    stale = {"manifest": "xxh3_64:0000000000000000", "files": ["optim.json"]}  # an older manifest's marker
    dst.write_bytes(remote_copy.MARKER_PREFIX + "00001.json", __import__("json").dumps(stale).encode())
    with pytest.raises(statekit.StatekitError, match="did not replicate"):
        remote_copy.copy_checkpoint(node0, dst, raw, rank=0, world_size=2, peer_timeout_seconds=1)
    assert not dst.exists(fmt.MANIFEST_NAME)


def test_ls_shows_each_checkpoints_tiers(tmp_path, s3_bucket, plugin_manager):
    import json

    from click.testing import CliRunner

    from statekit.cli import main

    remote = f"{s3_bucket}/run"
    objects = _objects(0)
    manager = statekit.CheckpointManager(objects, str(tmp_path / "local"), replicate_to=remote)
    manager.save(1)
    manager.wait(timeout=60)
    statekit.CheckpointManager(objects, str(tmp_path / "local")).save(2)  # not replicated
    statekit.save(f"{remote}/{checkpoint_name(3)}", objects, step=3)  # only remote
    result = CliRunner().invoke(main, ["ls", str(tmp_path / "local"), "--replica", remote, "--json"])
    assert result.exit_code == 0, result.output
    rows = {r["step"]: (r["tiers"], r["replicated"], r["replication"]) for r in json.loads(result.output)}
    assert rows == {
        1: (["local", "remote"], True, "replicated"),
        2: (["local"], False, "not replicated"),
        3: (["remote"], True, "replicated"),
    }
    text = CliRunner().invoke(main, ["ls", str(tmp_path / "local"), "--replica", remote]).output
    assert "local (not replicated)" in text and "local + remote" in text

    # a copy in progress (this process holds the replicator's in-use marker), and a copy a
    # killed process left without its manifest
    from statekit.storage.inuse import mark_in_use, release_in_use

    marker = mark_in_use(str(tmp_path / "local" / checkpoint_name(2)), by="statekit-replicate")
    rows = {r["step"]: r["replication"] for r in json.loads(CliRunner().invoke(
        main, ["ls", str(tmp_path / "local"), "--replica", remote, "--json"]).output)}
    assert rows[2] == "copying"
    release_in_use(marker)
    Storage(f"{remote}/{checkpoint_name(2)}").write_bytes("model.safetensors", b"part of a copy")
    text = CliRunner().invoke(main, ["ls", str(tmp_path / "local"), "--replica", remote]).output
    assert "local (remote copy incomplete)" in text


def test_checkpoints_being_replicated_and_resumed_from_are_marked_in_use(tmp_path, s3_bucket, plugin_manager, monkeypatch):
    import gc

    from statekit.storage import inuse

    seen = []
    real_copy = replication.copy_checkpoint

    def watching_copy(src, dst, *args, **kwargs):
        seen.append([m.by for m in inuse.in_use_markers(src.url)])
        with pytest.raises(statekit.CheckpointInUseError):  # statekit gc / another run's retention
            statekit.manager.listing.delete_checkpoint(src.url)
        return real_copy(src, dst, *args, **kwargs)

    monkeypatch.setattr(replication, "copy_checkpoint", watching_copy)
    objects = _objects(0)
    manager = statekit.CheckpointManager(objects, str(tmp_path / "local"), replicate_to=f"{s3_bucket}/run")
    manager.save(1)
    assert manager.plugin_state["replicate"].wait(timeout=60) == []
    assert seen == [["statekit-replicate"]]
    local = manager.url_for(1)
    assert not inuse.is_in_use(local)  # released after the copy

    resumed = statekit.CheckpointManager(_objects(1), str(tmp_path / "local"))
    assert resumed.resume() == 1 and resumed.resumed_from == local
    assert [m.by for m in inuse.in_use_markers(local)] == ["statekit"]
    with pytest.raises(statekit.CheckpointInUseError):
        statekit.manager.listing.delete_checkpoint(local)
    del resumed
    gc.collect()
    assert not inuse.is_in_use(local)  # the run that resumed from it is gone


def test_a_growing_replication_backlog_warns_once(tmp_path, monkeypatch):
    import threading

    release = threading.Event()
    monkeypatch.setattr(replication, "copy_checkpoint", lambda *a, **k: release.wait(30))
    replicator = replication.Replicator(str(tmp_path / "remote"), backlog_warning=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, 6):
            replicator.submit(str(tmp_path / "local" / checkpoint_name(step)))
    behind = [str(w.message) for w in caught if "checkpoints behind" in str(w.message)]
    assert len(behind) == 1 and "replication is 3 checkpoints behind" in behind[0]
    release.set()
    assert replicator.wait(timeout=30) == []


KILLED_SAVER = """
import sys, time, torch, statekit
torch.manual_seed(0)
model = torch.nn.Linear(2048, 2048)
optim = torch.optim.AdamW(model.parameters())
model(torch.randn(2, 2048)).sum().backward()
optim.step()
manager = statekit.CheckpointManager({"model": model, "optim": optim}, sys.argv[1], replicate_to=sys.argv[2])
manager.save(1)
print("saved", flush=True)
time.sleep(600)
"""


def test_a_process_killed_mid_replication_leaves_no_committed_remote_copy(tmp_path, s3_bucket, plugin_manager):
    """A real SIGKILL while the replicator uploads (48 MiB at moto's ~40 MB/s): the remote
    copy has files but no manifest, never counts as committed, and the next manager start
    finishes it; both tiers then verify."""
    import signal
    import subprocess
    import sys
    import time

    remote, local = f"{s3_bucket}/run", str(tmp_path / "local")
    dst = Storage(f"{remote}/{checkpoint_name(1)}")
    proc = subprocess.Popen([sys.executable, "-c", KILLED_SAVER, local, remote], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "saved"
        deadline = time.monotonic() + 60
        while not dst.find() and time.monotonic() < deadline:  # the first file has arrived
            time.sleep(0.05)
            dst.invalidate()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert dst.find() and not dst.exists(fmt.MANIFEST_NAME), dst.find()  # killed between files and manifest
    assert not [i for i in statekit.manager.listing.list_checkpoints(remote) if i.committed]
    manager = statekit.CheckpointManager({"t": torch.zeros(1)}, local, replicate_to=remote)  # the next start
    assert manager.plugin_state["replicate"].wait(timeout=120) == []
    statekit.verify(dst.url)
    statekit.verify(f"{local}/{checkpoint_name(1)}")


ENDS_RIGHT_AFTER_SAVING = """
import sys, torch, statekit
manager = statekit.CheckpointManager({"model": torch.nn.Linear(512, 512)}, sys.argv[1], replicate_to=sys.argv[2])
manager.save(1)
manager.save(2)
"""


def test_a_script_ending_right_after_its_last_save_still_replicates_it(tmp_path, s3_bucket, plugin_manager):
    """No manager.wait() at the end: the exit waits for the queued copies (they would die
    with the daemon thread, silently, and a node-local disk goes with the node)."""
    import subprocess
    import sys

    remote = f"{s3_bucket}/run"
    done = subprocess.run([sys.executable, "-c", ENDS_RIGHT_AFTER_SAVING, str(tmp_path / "local"), remote],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert [i.step for i in statekit.manager.listing.list_checkpoints(remote) if i.committed] == [1, 2]
