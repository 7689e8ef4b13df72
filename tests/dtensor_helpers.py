"""The DTensor cases of the state check (``unit/engine/test_state_check_dtensor.py``), run on
every rank of a gloo group: in the test process with one rank, in processes that
``torch.multiprocessing`` spawns with several (this module is importable by name in them).

Every assertion runs on every rank; a failure ends the spawn with the rank's traceback.
"""

from __future__ import annotations

import os
import types
import warnings
from typing import Any

import torch
import torch.distributed as dist

from statekit import StateCheckWarning, distributed
from statekit.checks import state_check
from statekit.engine import live_state
from statekit.engine.entries import Entry
from statekit.checks import digest as sd

SMALL = sd.Sampling(block=3, stride=11, full_below=0)
"""A sampling of small numbers: blocks of 3 elements every 11, on tensors of any size."""


def spawned(rank: int, world: int, init_file: str) -> None:
    """The entry point of a spawned rank: join the group, run :func:`run_cases`, leave."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        run_cases()
    finally:
        dist.destroy_process_group()


def full_tensors() -> dict[str, torch.Tensor]:
    """The whole tensors (the same on every rank): uneven shards at 2, 3 and 4 ranks, empty
    shards (2 rows over 4 ranks), several dtypes, one large enough to be sampled by default."""
    g = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(10, 7, generator=g),
        "bf16": torch.randn(3, 5, 6, generator=g).to(torch.bfloat16),
        "i64": torch.randint(-(2**40), 2**40, (9, 4), generator=g),
        "c128": torch.randn(5, 6, dtype=torch.complex128, generator=g),
        "bool": torch.rand(6, 5, generator=g) > 0.5,
        "tiny": torch.randn(2, 3, generator=g),
        "large": torch.randn(300, 301, generator=g),  # 90,300 elements: sampled by the default sampling
    }


def placements_cases(world: int) -> list[tuple[str, Any, list[Any]]]:
    """``(name, mesh, placements)`` of every layout: Shard(0), Shard(1), Replicate on a 1-D
    mesh of the world, and with 4 ranks a 2-D (2, 2) mesh: two tensor dimensions sharded,
    one dimension sharded twice, replicated and sharded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    line = init_device_mesh("cpu", (world,))
    cases = [("s0", line, [Shard(0)]), ("s1", line, [Shard(1)]), ("r", line, [Replicate()])]
    if world == 4:
        square = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        cases += [("s0s1", square, [Shard(0), Shard(1)]), ("s1s1", square, [Shard(1), Shard(1)]),
                  ("rs1", square, [Replicate(), Shard(1)]), ("s0r", square, [Shard(0), Replicate()])]
    return cases


def sharded(world: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(name -> whole tensor, name -> its DTensor)`` for every tensor in every layout; each
    rank's shard cut here as ``distribute_tensor`` cuts it (``torch.chunk`` along the
    sharded dimension, mesh dimension by mesh dimension; an empty shard past the last
    chunk), without its collectives."""
    from torch.distributed.tensor import DTensor, Shard

    whole, dtensors = {}, {}
    for layout, mesh, placements in placements_cases(world):
        coordinate = mesh.get_coordinate()
        for name, t in full_tensors().items():
            local = t
            for i, p in enumerate(placements):
                if isinstance(p, Shard):
                    chunks = torch.chunk(local, mesh.size(i), dim=p.dim)
                    c = coordinate[i]
                    local = chunks[c] if c < len(chunks) else local.narrow(p.dim, 0, 0)
            whole[f"{name}.{layout}"] = t
            dtensors[f"{name}.{layout}"] = DTensor.from_local(local.clone(), mesh, placements, run_check=False,
                                                              shape=t.shape, stride=t.stride())
    return whole, dtensors


def counting_collectives() -> list[int]:
    """Count the all-reduces of ``statekit.distributed.sum_over_ranks`` from now on (one
    list element per call: its number of values)."""
    calls: list[int] = []
    original = getattr(distributed.sum_over_ranks, "counted", distributed.sum_over_ranks)

    def counted(values: list[int]) -> list[int]:
        if distributed.rank_and_world_size()[1] > 1:  # (in one process it is no collective)
            calls.append(len(values))
        return original(values)

    counted.counted = original  # type: ignore[attr-defined]
    distributed.sum_over_ranks = counted  # (the state check reaches it through the module; run_cases restores it)
    return calls


def run_cases() -> None:
    """Every case, on this rank."""
    rank, world = distributed.rank_and_world_size()
    original = distributed.sum_over_ranks
    try:
        digests_equal_the_whole_tensors(rank, world)
        unhandled_placements_are_named_not_compared(world)
        check_names_a_fault_in_one_ranks_shard(rank, world)
    finally:
        distributed.sum_over_ranks = original


def digests_equal_the_whole_tensors(rank: int, world: int) -> None:
    """The digest of each DTensor equals the digest of its whole tensor, for the full and
    the default (sampled) check and for any sampling of global positions; one all-reduce
    for all of them."""
    whole, dtensors = sharded(world)
    entries = [Entry("obj", "dict", dtensors)]
    for mode, sampling in (("full", sd.Sampling.FULL), ("sampled", sd.Sampling())):
        os.environ[state_check.MODE_ENV] = mode
        try:
            calls = counting_collectives()
            digest = state_check.record(live_state.live_tensors(entries))
        finally:
            del os.environ[state_check.MODE_ENV]
        assert len(calls) == (1 if world > 1 else 0), calls
        if rank != 0:
            assert digest is None
            continue
        assert digest is not None and digest.uncompared is None
        expected = {name: f"{str(t.dtype).removeprefix('torch.')}:{sd.tensor_digest(t, sampling)}" for name, t in whole.items()}
        assert dict(digest.objects["obj"]) == expected
    for name, d in dtensors.items():  # shard_sum itself, under a sampling of small blocks, summed here
        box = torch.tensor([sd.shard_sum(d, SMALL) - (1 << 64) * (sd.shard_sum(d, SMALL) >= 1 << 63)], dtype=torch.int64)
        if world > 1:
            dist.all_reduce(box)  # (int64 wraps: the sum modulo 2**64)
        assert sd.format_sum(int(box)) == sd.tensor_digest(whole[name], SMALL), name


def unhandled_placements_are_named_not_compared(world: int) -> None:
    """``Partial`` and ``_StridedShard`` DTensors, and one on a mesh of part of the world, are
    not digested: the save names them, the check after a load names them, no false alarm."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (world,))
    t = torch.arange(24.0).reshape(6, 4)
    state = {
        "plain": t.clone(),
        "sharded": distribute_tensor(t, mesh, [Shard(0)]),
        "partial": DTensor.from_local(t / world, mesh, [Partial()]),
        "strided": DTensor.from_local(t, mesh, [_StridedShard(0, split_factor=2)], run_check=False),
    }
    if world == 4:
        square = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        state["part"] = distribute_tensor(t, square["tp"], [Shard(0)])  # a mesh of 2 of the 4 ranks
    entries = [Entry("obj", "dict", state)]
    digest = distributed.broadcast_from_rank0(state_check.record(live_state.live_tensors(entries)))
    assert set(digest.objects["obj"]) == {"plain", "sharded"}
    reasons = dict(digest.uncompared["obj"])
    assert set(reasons) == {"partial", "strided"} | ({"part"} if world == 4 else set()), reasons
    assert "Partial(sum)" in reasons["partial"] and "not a block of the tensor's elements" in reasons["partial"]
    assert "_StridedShard" in reasons["strided"]
    if world == 4:
        assert reasons["part"] == "a DTensor on a mesh of 2 of the 4 ranks"
    with warnings.catch_warnings():
        warnings.simplefilter("error", StateCheckWarning)
        verdict = state_check.check(types.SimpleNamespace(state_digest=digest), live_state.live_tensors(entries), "ckpt")
    assert verdict.verdict == "verified" and verdict.compared == 2, verdict
    named = {path for _, path, reason in verdict.deliberate if "not digested at save" in reason}
    assert named == set(reasons), verdict.deliberate
    assert "not digested at save" in verdict.detail


def check_names_a_fault_in_one_ranks_shard(rank: int, world: int) -> None:
    """After a clean "load" the check is verified; a slice of one rank's shard zeroed, or a
    whole DTensor zeroed, is named by tensor on every rank (one all-reduce for the digests,
    one more for "all zeros")."""
    _, dtensors = sharded(world)
    entries = [Entry("obj", "dict", dtensors)]
    digest = distributed.broadcast_from_rank0(state_check.record(live_state.live_tensors(entries)))
    manifest = types.SimpleNamespace(state_digest=digest)
    calls = counting_collectives()
    with warnings.catch_warnings():
        warnings.simplefilter("error", StateCheckWarning)
        verdict = state_check.check(manifest, live_state.live_tensors(entries), "ckpt")
    assert verdict.verdict == "verified" and verdict.compared == len(dtensors) and not verdict.deliberate
    assert len(calls) == (1 if world > 1 else 0)
    victim = world - 1  # the last rank's shard (s1: columns; uneven)
    if rank == victim:
        with torch.no_grad():
            dtensors["f32.s1"].to_local()[3:5] = 0
    dtensors["i64.s0"].to_local().zero_()  # every rank's shard: the whole tensor
    calls.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        verdict = state_check.check(manifest, live_state.live_tensors(entries), "ckpt")
    assert len(calls) == (2 if world > 1 else 0), calls
    assert verdict.verdict == "mismatch"
    assert set(verdict.mismatched) == {"obj:f32.s1", "obj:i64.s0"}, verdict.mismatched
    messages = [str(w.message) for w in caught if issubclass(w.category, StateCheckWarning)]
    assert len(messages) == 1, messages
    assert "2 tensor(s)" + (f" on rank {rank} of {world}" if world > 1 else "") + " differ" in messages[0]
    assert "dict 'obj': f32.s1 differs from the saved state" in messages[0]
    assert "dict 'obj': i64.s0 is all zeros, differs from the saved state" in messages[0]

