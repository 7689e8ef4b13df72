"""The state check of DTensors (statekit.checks.state_check, statekit.checks.digest):
a DTensor's digest, its ranks' shares summed in one all-reduce, equals the digest of its
whole tensor for Shard(0), Shard(1), Replicate and 2-D meshes, full and sampled; placements
without global positions are named, never a false alarm; a fault in one rank's shard is
named by tensor on every rank. The cases (tests/dtensor_helpers.py) run on a one-rank gloo
group in this process and on four ranks spawned by torch.multiprocessing."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("torch.distributed.tensor")

import dtensor_helpers  # noqa: E402


@pytest.fixture
def one_rank_group():
    """A gloo group of this process alone (an in-memory store), destroyed after the test."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_dtensors_on_one_rank(one_rank_group):
    dtensor_helpers.run_cases()


def test_dtensors_on_four_ranks(tmp_path):
    """Uneven shards (10 rows over 4 ranks), empty ones (2 rows over 4), a (2, 2) mesh."""
    torch.multiprocessing.spawn(dtensor_helpers.spawned, args=(4, str(tmp_path / "init")), nprocs=4, join=True)
