"""Lineage (issue 38, item 3): rollbacks with resume(step=K), the live history a resume
continues, run ids, names that never collide between branches, retention under branches,
the remote tier, ``statekit ls --tree``."""

from __future__ import annotations

import json
import logging
import threading
import warnings

import pytest
import torch

import statekit
from statekit.errors import CheckpointNotFoundError, StatekitError
from statekit.format.manifest import read_manifest
from statekit.manager.lineage import STATE_NAME
from statekit.storage import Storage


def objects(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}


def set_step(objs, step):
    """Make the model's weights say which step (and branch) they are from."""
    with torch.no_grad():
        objs["model"].weight.fill_(float(step))


def weight(objs):
    return float(objs["model"].weight[0, 0].detach())


def run(root, steps, objs=None, **kwargs):
    objs = objs or objects()
    manager = statekit.CheckpointManager(objs, root, **kwargs)
    for s in steps:
        set_step(objs, s)
        manager.save(s)
    return manager, objs


def names(root):
    return [i.name for i in statekit.CheckpointManager(objects(), root).list() if i.committed]


def fresh_resume(root, **kwargs):
    objs = objects(seed=1)
    manager = statekit.CheckpointManager(objs, root, **{k: v for k, v in kwargs.items() if k != "other_runs"})
    step = manager.resume(**({"other_runs": kwargs["other_runs"]} if "other_runs" in kwargs else {}))
    return manager, objs, step


def test_every_save_records_its_lineage(tmp_path):
    root = str(tmp_path / "run")
    manager, _ = run(root, [1, 2])
    first = read_manifest(Storage(manager.url_for(1)))
    second = read_manifest(Storage(manager.url_for(2)))
    assert first.lineage.parent is None and second.lineage.parent == "checkpoint-00000001"
    assert first.lineage.run_id == second.lineage.run_id == manager.lineage_run_id
    assert first.lineage.branch == second.lineage.branch
    assert list(first.to_json())[-2:] == ["lineage", "manifest_checksum"]

    resumed, _, step = fresh_resume(root)
    resumed.save(3)
    third = read_manifest(Storage(resumed.url_for(3)))
    assert step == 2 and third.lineage.parent == "checkpoint-00000002"
    assert (third.lineage.run_id, third.lineage.branch) == (first.lineage.run_id, first.lineage.branch)


def test_rollback_then_crash_before_the_first_new_save_resumes_the_rollback_step(tmp_path):
    root = str(tmp_path / "run")
    run(root, [100, 200, 300, 400])
    manager, objs, _ = fresh_resume(root)
    assert manager.resume(step=200) == 200 and weight(objs) == 200.0
    assert (tmp_path / "run" / STATE_NAME).exists()
    assert manager.latest() == manager.url_for(200)  # not the abandoned 400
    # the process dies here; a new one resumes
    _, objs, step = fresh_resume(root)
    assert step == 200 and weight(objs) == 200.0


def test_rollback_then_crash_after_the_first_new_save_resumes_the_branch(tmp_path):
    root = str(tmp_path / "run")
    run(root, [100, 200, 300, 400])
    manager, objs, _ = fresh_resume(root)
    manager.resume(step=200)
    set_step(objs, 250)
    manager.save(250)
    first = read_manifest(Storage(manager.url_for(250)))
    assert first.lineage.parent == "checkpoint-00000200"
    _, objs, step = fresh_resume(root)
    assert step == 250 and weight(objs) == 250.0
    assert manager.latest() == manager.url_for(250)


def test_two_rollbacks(tmp_path):
    root = str(tmp_path / "run")
    run(root, [100, 200, 300, 400])
    manager, objs, _ = fresh_resume(root)
    manager.resume(step=300)
    for s in (350, 360):
        set_step(objs, s)
        manager.save(s)
    manager.resume(step=350)  # the second rollback, within the first branch
    set_step(objs, 355)
    manager.save(355)
    _, objs, step = fresh_resume(root)
    assert step == 355 and weight(objs) == 355.0
    # and a rollback to the original branch before the first fork
    manager.resume(step=100)
    _, objs, step = fresh_resume(root)
    assert step == 100 and weight(objs) == 100.0


def test_saves_past_the_abandoned_steps_never_collide(tmp_path):
    root = str(tmp_path / "run")
    run(root, [100, 200, 300])
    before = {n: (tmp_path / "run" / n / "statekit.json").read_bytes() for n in names(root)}
    manager, objs, _ = fresh_resume(root)
    manager.resume(step=100)
    for s in (200, 300, 400):
        set_step(objs, s + 0.5)
        manager.save(s)
    listed = names(root)
    branch = read_manifest(Storage(manager.url_of(listed[-1]))).lineage.branch[:8]
    assert f"checkpoint-00000200.{branch}" in listed and f"checkpoint-00000300.{branch}" in listed
    assert "checkpoint-00000400" in listed  # a free plain name stays plain
    for name, data in before.items():  # the abandoned ones are intact
        assert (tmp_path / "run" / name / "statekit.json").read_bytes() == data
    _, objs, step = fresh_resume(root)
    assert step == 400 and weight(objs) == 400.5
    # a crash-resume that rolls back again to the branch's step 300 takes the branch's copy
    manager, objs, _ = fresh_resume(root)
    assert manager.resume(step=300) == 300 and weight(objs) == 300.5


def test_another_run_id_is_refused_naming_both_runs(tmp_path):
    root = str(tmp_path / "run")
    run(root, [100, 200], run_id="exp1")
    objs = objects(seed=1)
    manager = statekit.CheckpointManager(objs, root, run_id="exp2")
    with pytest.raises(StatekitError, match="exp1.*exp2"):
        manager.resume()
    assert manager.resume(other_runs="ignore") is None  # a fresh start
    assert manager.resume(other_runs="resume") == 200
    manager.save(300)
    assert read_manifest(Storage(manager.url_for(300))).lineage.run_id == "exp2"
    same = statekit.CheckpointManager(objects(), root, run_id="exp2")
    assert same.resume() == 300


def test_a_fresh_run_without_run_id_resumes_and_logs_which_run(tmp_path, caplog):
    root = str(tmp_path / "run")
    first, _ = run(root, [100, 200])
    with caplog.at_level(logging.INFO, logger="statekit"):
        manager, objs, step = fresh_resume(root)
    assert step == 200 and manager.lineage_run_id == first.lineage_run_id
    assert any(first.lineage_run_id in r.getMessage() and "checkpoint-00000200" in r.getMessage()
               for r in caplog.records)


def test_a_fresh_run_in_a_root_with_branches_becomes_the_live_one(tmp_path):
    root = str(tmp_path / "run")
    run(root, [100, 200, 300])
    manager, _, _ = fresh_resume(root)
    manager.resume(step=100)  # the root now has branches
    other, _ = run(root, [50], run_id="exp2")  # a fresh run (no resume): its first save makes it live
    _, objs, step = fresh_resume(root, run_id="exp2")
    assert step == 50 and weight(objs) == 50.0


def test_retention_keeps_the_live_branch_and_prunes_abandoned_by_policy(tmp_path):
    root = str(tmp_path / "run")
    run(root, [100, 200, 300, 400, 500], keep_last=2)
    assert names(root) == ["checkpoint-00000400", "checkpoint-00000500"]
    manager = statekit.CheckpointManager(objects(), root, keep_last=2)
    objs = manager.objects
    manager.resume(step=400)
    set_step(objs, 410)
    manager.save(410)
    # one save on the branch: the abandoned 500 is kept (until keep_last=2 saves past the fork),
    # the live 400 (rolled back to) and 410 are kept
    assert names(root) == ["checkpoint-00000400", "checkpoint-00000410", "checkpoint-00000500"]
    set_step(objs, 420)
    manager.save(420)
    # two on the branch: the abandoned 500 goes; keep_last counts the live history only
    # (400 stays: the checkpoint the run resumed from is never deleted)
    assert names(root) == ["checkpoint-00000400", "checkpoint-00000410", "checkpoint-00000420"]
    _, objs, step = fresh_resume(root, keep_last=2)
    assert step == 420


def test_an_async_save_in_flight_at_the_rollback_commits_on_the_abandoned_branch(tmp_path):
    root = str(tmp_path / "run")
    manager, objs = run(root, [100, 200])
    set_step(objs, 300)
    pending = manager.save(300, blocking=False)
    assert manager.resume(step=100) == 100  # waits for 300, which commits on the old branch
    assert "checkpoint-00000300" in names(root)
    _, objs, step = fresh_resume(root)
    assert step == 100 and weight(objs) == 100.0


def test_the_remote_tier_lets_a_fresh_node_resume_the_live_branch(tmp_path):
    root, remote = str(tmp_path / "local"), str(tmp_path / "remote")
    manager, objs = run(root, [100, 200, 300], replicate_to=remote)
    manager.wait()
    manager.resume(step=100)
    set_step(objs, 150)
    manager.save(150)
    manager.wait()
    assert (tmp_path / "remote" / STATE_NAME).read_bytes() == (tmp_path / "local" / STATE_NAME).read_bytes()
    # a fresh node: an empty local root
    node = statekit.CheckpointManager(objs2 := objects(seed=2), str(tmp_path / "node"), replicate_to=remote)
    assert node.resume() == 150 and weight(objs2) == 150.0
    node.wait()


def test_the_remote_tier_before_the_first_new_save(tmp_path):
    root, remote = str(tmp_path / "local"), str(tmp_path / "remote")
    manager, objs = run(root, [100, 200, 300], replicate_to=remote)
    manager.wait()
    manager.resume(step=200)
    node = statekit.CheckpointManager(objs2 := objects(seed=2), str(tmp_path / "node"), replicate_to=remote)
    assert node.resume() == 200 and weight(objs2) == 200.0
    node.wait()


def test_rollback_to_a_step_that_does_not_exist(tmp_path):
    root = str(tmp_path / "run")
    run(root, [100, 200])
    manager, _, _ = fresh_resume(root)
    with pytest.raises(CheckpointNotFoundError, match="step 150.*100, 200"):
        manager.resume(step=150)
    assert not (tmp_path / "run" / STATE_NAME).exists()


def test_checkpoints_without_lineage_resume_the_newest_step(tmp_path):
    root = str(tmp_path / "run")
    run(root, [100, 200, 300])
    for name in names(root):  # as written before lineage existed
        path = tmp_path / "run" / name / "statekit.json"
        body = json.loads(path.read_bytes())
        del body["lineage"], body["manifest_checksum"]
        path.write_text(json.dumps(body))
    manager, objs, step = fresh_resume(root)
    assert step == 300 and weight(objs) == 300.0
    manager.save(400)
    assert read_manifest(Storage(manager.url_for(400))).lineage.parent == "checkpoint-00000300"
    # a rollback among them works too
    manager.resume(step=200)
    set_step(objs, 250)
    manager.save(250)
    _, objs, step = fresh_resume(root)
    assert step == 250 and weight(objs) == 250.0


def test_ls_tree_shows_the_branches(tmp_path):
    from click.testing import CliRunner

    from statekit.cli import main

    root = str(tmp_path / "run")
    run(root, [100, 200, 300])
    manager, objs, _ = fresh_resume(root)
    manager.resume(step=100)
    set_step(objs, 200)
    manager.save(200)
    result = CliRunner().invoke(main, ["ls", root, "--tree"])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "(live)" in out and "abandoned" in out
    assert out.index("checkpoint-00000100") < out.index("checkpoint-00000200.")
    assert "forked from checkpoint-00000100" in out


def test_remote_retention_counts_the_live_branch_only(tmp_path):
    root, remote = str(tmp_path / "local"), str(tmp_path / "remote")
    manager, objs = run(root, [100, 200, 300], replicate_to=remote, remote_keep_last=2)
    manager.wait()
    manager.resume(step=200)
    set_step(objs, 210)
    manager.save(210)
    manager.wait()
    remote_names = names(remote)
    assert "checkpoint-00000210" in remote_names and "checkpoint-00000200" in remote_names
    assert "checkpoint-00000300" in remote_names  # abandoned: kept until 2 saves on the branch
    set_step(objs, 220)
    manager.save(220)
    manager.wait()
    remote_names = names(remote)
    assert remote_names[-2:] == ["checkpoint-00000210", "checkpoint-00000220"]
    assert "checkpoint-00000300" not in remote_names


def test_automatic_steps_after_a_rollback_continue_the_live_history(tmp_path):
    root = str(tmp_path / "run")
    run(root, [1, 2, 3])
    manager, _, _ = fresh_resume(root)
    manager.resume(step=1)
    assert manager.next_step() == 2
    manager.save()
    assert any(n.startswith("checkpoint-00000002.") for n in names(root))


def test_record_resume_continues_the_lineage_of_the_checkpoint_loaded(tmp_path):
    """An integration that loads itself (statekit-transformers) and calls record_resume:
    the next save continues the run, its branch and names the checkpoint as parent, and
    after a rollback elsewhere a record_resume of the live branch's checkpoint stays on it."""
    root = str(tmp_path / "run")
    first, _ = run(root, [1, 2])
    saved = read_manifest(Storage(first.url_for(2)))
    objs = objects(seed=1)
    manager = statekit.CheckpointManager(objs, root)
    manifest = statekit.load(manager.url_for(2), objs)
    assert manager.record_resume(manager.url_for(2), manifest) == 2
    manager.save(3)
    third = read_manifest(Storage(manager.url_for(3)))
    assert third.lineage.run_id == saved.lineage.run_id
    assert third.lineage.branch == saved.lineage.branch
    assert third.lineage.parent == "checkpoint-00000002"

    rolled, objs = fresh_resume(root)[:2]
    rolled.resume(step=1)
    rolled.save(2)  # the new branch's step 2: the abandoned one keeps the plain name
    (branch_two,) = [i for i in rolled.list() if i.name.startswith("checkpoint-00000002.")]
    objs = objects(seed=2)
    later = statekit.CheckpointManager(objs, root)
    later.record_resume(branch_two.url, statekit.load(branch_two.url, objs))
    later.save(3)
    assert later.latest().rsplit("/", 1)[-1].startswith("checkpoint-00000003.")  # on the live branch, no collision
    assert read_manifest(Storage(later.latest())).lineage.branch == read_manifest(Storage(branch_two.url)).lineage.branch


def test_an_async_save_in_flight_does_not_delete_the_rollback_target(tmp_path, plugin_manager, monkeypatch):
    """resume(step=K) waits for the save in flight; its retention (keep_last) would delete K:
    the target is kept, the rollback loads it. The save's retention is held (an event) until
    resume() waits for it, so the save is in flight at the call."""
    resumed_waits = threading.Event()

    class HoldRetention:
        @statekit.hookimpl
        def statekit_retention_keep(self, checkpoints, manager):
            if any(i.step == 5 for i in checkpoints):
                assert resumed_waits.wait(60)
            return []

    root = str(tmp_path / "run")
    objs = objects()
    manager = statekit.CheckpointManager(objs, root, keep_last=2, async_save=True)
    for s in (1, 2, 3, 4):
        set_step(objs, s)
        manager.save(s)
    manager.wait()
    plugin_manager.register(HoldRetention(), name="hold-retention")
    wait_save = manager._wait_save
    monkeypatch.setattr(manager, "_wait_save", lambda: (resumed_waits.set(), wait_save())[1])
    set_step(objs, 5)
    manager.save(5)  # in flight until resume() waits for it
    assert manager.resume(step=3) == 3
    assert weight(objs) == 3.0
    assert sorted(i.step for i in manager.list() if i.committed) == [3, 4, 5]  # 4 and 5 kept, 3 as the target


@pytest.mark.parametrize("step", [True, "3", 3.0])
def test_a_step_that_is_not_an_int_is_refused_not_a_rollback(tmp_path, step):
    root = str(tmp_path / "run")
    run(root, [1, 2, 3])
    with pytest.raises(statekit.InvalidOptionError, match=r"resume\(step=\.\.\.\) takes a checkpoint's step"):
        statekit.CheckpointManager(objects(), root).resume(step)
    assert not (tmp_path / "run" / STATE_NAME).exists()  # nothing rolled back


def test_the_latest_hint_follows_the_rollback_and_the_branch(tmp_path):
    root = tmp_path / "run"
    run(str(root), [1, 2, 3])
    manager = statekit.CheckpointManager(objects(), str(root))
    manager.resume(step=1)
    assert (root / "latest").read_text().strip() == "checkpoint-00000001"
    manager.save(2)
    assert (root / "latest").read_text().strip() == manager.latest().rsplit("/", 1)[-1]
    assert (root / "latest").read_text().strip().startswith("checkpoint-00000002.")


def test_a_named_fresh_run_in_a_reused_root_saves_beside_the_other_runs_checkpoints(tmp_path):
    """run_id + other_runs="ignore" in a root another run filled (no branches yet): the
    fresh run's saves never collide with (or overwrite) the other run's, and its own
    resume continues them."""
    root = str(tmp_path / "run")
    run(root, [1, 2, 3])
    objs = objects()
    mine = statekit.CheckpointManager(objs, root, run_id="exp2")
    assert mine.resume(other_runs="ignore") is None
    set_step(objs, 11)
    mine.save(1)
    mine.save(2)
    assert sorted(names(root))[:2] == ["checkpoint-00000001", "checkpoint-00000001." + mine._lineage.branch[:8]]
    other = objects(seed=3)
    statekit.load(f"{root}/checkpoint-00000001", other)
    assert weight(other) == 1.0  # the other run's, untouched
    again, objs2, step = fresh_resume(root, run_id="exp2", other_runs="ignore")
    assert step == 2 and weight(objs2) == 11.0


def test_at_one_step_of_two_runs_resume_takes_the_one_committed_last_as_latest_does(tmp_path):
    """Run B saves beside run A's checkpoint of the same step (other_runs="ignore"): its
    restart resumes its own, the newer one, and the latest hint names the same."""
    root = str(tmp_path / "run")
    a, _ = run(root, [1, 2], run_id="runA")
    objs = objects()
    b = statekit.CheckpointManager(objs, root, run_id="runB")
    assert b.resume(other_runs="ignore") is None
    set_step(objs, 22)
    b.save(2)
    again, objs2, step = fresh_resume(root, run_id="runB")
    assert step == 2 and weight(objs2) == 22.0
    assert again.resumed_from.rsplit("/", 1)[-1] == (tmp_path / "run" / "latest").read_text().strip()


def _accelerate_run(root, run_id, steps, value, resume_with=None):
    """A named run with an Accelerator: resume (``resume_with``: its ``other_runs``) and save
    ``steps`` with the model's weights set to ``value + step``."""
    pytest.importorskip("accelerate")
    from accelerate_helpers import prepared_linear

    accelerator, (model, _optimizer) = prepared_linear()
    manager = statekit.CheckpointManager(accelerator, root, run_id=run_id)
    if resume_with is not None:
        assert manager.resume(other_runs=resume_with) is None
    for s in steps:
        with torch.no_grad():
            model.weight.fill_(value + s)
        manager.save(s)
    return manager, model


def test_a_named_run_restarting_in_a_shared_root_resumes_its_own_newest_and_warns_of_the_other_runs(tmp_path):
    """Issue 44: exp-B's own step 2 is committed, exp-A's step 4 is newer (the two runs share
    the root). exp-B's restart resumes its own step 2, every time, with an OtherRunWarning at
    the user's resume() line naming exp-A's checkpoint-00000004; exp-A's restart still
    resumes its own step 4 without a word."""
    from statekit import OtherRunWarning

    root = str(tmp_path / "shared")
    _accelerate_run(root, "exp-B", [1, 2], 100.0)
    _accelerate_run(root, "exp-A", [1, 2, 3, 4], 200.0, resume_with="ignore")  # beside exp-B's
    for _attempt in range(2):  # an automatic restart: the same call, again
        pytest.importorskip("accelerate")
        from accelerate_helpers import prepared_linear

        accelerator, (model, _optimizer) = prepared_linear()
        manager = statekit.CheckpointManager(accelerator, root, run_id="exp-B")
        with pytest.warns(OtherRunWarning) as caught:
            step = manager.resume()
        assert step == 2 and float(model.weight[0, 0].detach()) == 102.0
        assert manager.resumed_from.rsplit("/", 1)[-1] == "checkpoint-00000002"
        [warning] = [w for w in caught if issubclass(w.category, OtherRunWarning)]
        assert issubclass(warning.category, statekit.StatekitWarning)
        assert warning.filename == __file__  # warn_user: the user's resume() line
        message = str(warning.message)
        assert "checkpoint-00000004" in message and "'exp-A'" in message and "'exp-B'" in message
        assert "checkpoint-00000002" in message
    with torch.no_grad():
        model.weight.fill_(103.0)
    manager.save(3)  # exp-B's step 3: beside exp-A's, never over it
    saved = (tmp_path / "shared" / "latest").read_text().strip()
    assert saved.startswith("checkpoint-00000003.")
    assert read_manifest(Storage(f"{root}/{saved}")).lineage.run_id == "exp-B"
    assert read_manifest(Storage(f"{root}/checkpoint-00000003")).lineage.run_id == "exp-A"
    accelerator, (model, _optimizer) = prepared_linear()
    statekit.load_state(accelerator, f"{root}/checkpoint-00000004")
    assert float(model.weight[0, 0].detach()) == 204.0  # exp-A's, untouched
    # exp-A's own restart: its checkpoint is the newest, no warning
    accelerator, (model, _optimizer) = prepared_linear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", OtherRunWarning)
        step = statekit.CheckpointManager(accelerator, root, run_id="exp-A").resume()
    assert step == 4 and float(model.weight[0, 0].detach()) == 204.0


def test_a_named_run_with_checkpoints_of_its_own_is_not_warned_with_other_runs_ignore_and_continues_with_resume(tmp_path):
    """other_runs="ignore" resumes the run's own newest silently (it was asked for);
    other_runs="resume" still continues the other run's newer checkpoint; with no
    checkpoint of its own the default still refuses (test_another_run_id_is_refused_naming_both_runs)."""
    from statekit import OtherRunWarning

    root = str(tmp_path / "shared")
    run(root, [1, 2], run_id="exp-B")
    run(root, [3, 4], run_id="exp-A")
    objs = objects(seed=1)
    manager = statekit.CheckpointManager(objs, root, run_id="exp-B")
    with warnings.catch_warnings():
        warnings.simplefilter("error", OtherRunWarning)
        assert manager.resume(other_runs="ignore") == 2 and weight(objs) == 2.0
    assert manager.resume(other_runs="resume") == 4 and weight(objs) == 4.0
    fresh = statekit.CheckpointManager(objects(seed=1), root, run_id="exp-C")
    with pytest.raises(StatekitError, match="exp-A.*exp-C"):
        fresh.resume()
