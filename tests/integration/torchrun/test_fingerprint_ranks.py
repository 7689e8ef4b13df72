"""The resume fingerprint of a real two-rank save (torchrun, gloo): the world size and the
``DistributedSampler`` loader are recorded, and a one-rank resume names the change
(the in-process cases are in ``unit/api/test_fingerprint.py``)."""

from __future__ import annotations

import json

import pytest
import torch

import statekit
from statekit.format.manifest import MANIFEST_NAME

pytest.importorskip("accelerate")


@pytest.mark.slow
def test_world_size_change_from_a_real_two_rank_save(tmp_path):
    from accelerate_helpers import torchrun

    url = str(tmp_path / "ddp")
    torchrun("fingerprint_save.py", url)
    saved = json.loads((tmp_path / "ddp" / MANIFEST_NAME).read_text())["fingerprint"]
    assert saved["world_size"] == 2
    assert saved["dataloaders"]["loader"] == {"batch_size": 4, "dataset_length": 40, "drop_last": False,
                                              "even_batches": None, "num_workers": 0, "sampler": "DistributedSampler",
                                              "shuffle": True, "seed": 3}
    dataset = torch.utils.data.TensorDataset(torch.arange(40.0).unsqueeze(1))
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=3)
    model = torch.nn.Linear(1, 1)
    state = {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.01),
             "loader": torch.utils.data.DataLoader(dataset, batch_size=4, sampler=sampler)}
    with pytest.raises(statekit.ResumeMismatchError) as info:
        statekit.load(url, state, strict_resume=True)
    assert info.value.differences == [
        "world size 2 -> 1: the data position is remapped to the new world size (elastic resume)"
    ]
