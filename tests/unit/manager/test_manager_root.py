"""What a CheckpointManager accepts as its root: a missing bucket is an error naming it
(statekit never creates buckets), an empty bucket a fresh run, a checkpoint (statekit's or
Accelerate's) is refused with the root to pass instead, a folder of Accelerate checkpoints is
a root."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import statekit

pytest.importorskip("accelerate")

from accelerate_helpers import fresh_accelerator, prepared_linear  # noqa: E402


def test_resume_on_a_missing_bucket_raises_naming_it(s3_server, installed_plugin_manager):
    pytest.importorskip("s3fs")
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = statekit.CheckpointManager({"model": model, "optim": optimizer}, "s3://statekit-no-such-bucket/run")
    with pytest.raises(statekit.StorageError, match=r"bucket 'statekit-no-such-bucket' does not exist") as caught:
        manager.resume()
    assert caught.value.url == "s3://statekit-no-such-bucket/run"


def test_resume_on_an_empty_existing_bucket_is_a_fresh_run(s3_bucket, installed_plugin_manager):
    model = torch.nn.Linear(4, 2)
    manager = statekit.CheckpointManager({"model": model}, f"{s3_bucket}/run")
    assert manager.resume() is None


def test_a_checkpoint_as_manager_root_is_refused(tmp_path, installed_plugin_manager):
    accelerator, _ = prepared_linear()
    statekit.save_state(accelerator, str(tmp_path / "ckpt"))
    with pytest.raises(statekit.InvalidOptionError, match=r"ckpt' is a statekit checkpoint \(it holds statekit.json\).*statekit.load_state"):
        statekit.CheckpointManager(accelerator, str(tmp_path / "ckpt"))
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("checkpoint")) == []


def test_an_accelerate_checkpoint_as_manager_root_is_refused(tmp_path, installed_plugin_manager):
    accelerator, _ = prepared_linear()
    accelerator.save_state(str(tmp_path / "acc"), safe_serialization=True)
    with pytest.raises(statekit.InvalidOptionError, match=r"acc' is a checkpoint written by Accelerator.save_state"):
        statekit.CheckpointManager(accelerator, str(tmp_path / "acc"))


def test_an_accelerate_checkpoints_folder_is_still_a_root(tmp_path, installed_plugin_manager):
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    fresh_accelerator()
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
    accelerator = Accelerator(cpu=True, project_config=config)
    model = torch.nn.Linear(4, 2)
    model = accelerator.prepare(model)
    accelerator.save_state()  # <project_dir>/checkpoints/checkpoint_0
    manager = statekit.CheckpointManager(accelerator, str(tmp_path / "checkpoints"), allow_pickle=True)
    assert manager.resume() == 0
