"""Two-tier checkpoints of a run that references its frozen base, replicated to S3 (moto
server over HTTP): the base is carried once to ``<remote>/.statekit-bases/<base_id>/`` and
the remote copy loads bit for bit after the base folder and the local tier are gone; ``gc``
of the bucket removes the carried base once no committed copy references it."""

from __future__ import annotations

import shutil

import pytest
from click.testing import CliRunner

import statekit
from statekit.cli import main as cli
from statekit.storage import Storage

pytestmark = pytest.mark.s3
transformers = pytest.importorskip("transformers")
from transformers import GPT2LMHeadModel  # noqa: E402

from reference_helpers import BASE_FILE, assert_same, base_folder, config, fine_tune, frozen_but_h1, optimizer, step  # noqa: E402


def test_an_s3_replica_carries_the_base_once_and_loads_without_it(tmp_path, s3_bucket, plugin_manager):
    remote = f"{s3_bucket}/run"
    folder = base_folder(tmp_path / "base")
    model, optim = fine_tune(folder)
    manager = statekit.CheckpointManager({"model": model, "optim": optim}, str(tmp_path / "local"), replicate_to=remote,
                                         remote_keep_last=1)
    manager.save(1)
    manager.wait(timeout=120)
    replicator = manager.plugin_state["replicate"]
    carried_bytes = replicator.carried_bytes
    bases = Storage(f"{remote}/.statekit-bases")
    [base_id] = bases.listdir()
    assert bases.child(base_id).size(BASE_FILE) == carried_bytes == (tmp_path / "base" / BASE_FILE).stat().st_size
    step(model, optim, 2)
    manager.save(2)
    manager.wait(timeout=120)
    assert replicator.carried_bytes == carried_bytes  # carried once
    assert [i.step for i in replicator.list() if i.committed] == [2]  # remote retention: the base stays
    assert bases.listdir() == [base_id]

    shutil.rmtree(folder)
    shutil.rmtree(tmp_path / "local")
    fresh = frozen_but_h1(GPT2LMHeadModel(config()))
    statekit.load(f"{remote}/checkpoint-00000002", {"model": fresh, "optim": optimizer(fresh)})
    assert_same(model, fresh)

    kept = CliRunner().invoke(cli, ["gc", remote, "--json"])
    assert kept.exit_code == 0, kept.output
    assert '"removed": []' in kept.output and "referenced by" in kept.output
    Storage(f"{remote}/checkpoint-00000002").remove_tree()  # no copy references the base any more
    removed = CliRunner().invoke(cli, ["gc", remote])
    assert removed.exit_code == 0, removed.output
    assert f"removed {remote}/.statekit-bases/{base_id}" in removed.output
    bases.invalidate()
    assert bases.listdir() == []
