"""Rank, world size and the save's own gloo process group.

statekit's collectives (gathering manifest entries, agreeing on success, the commit
barrier) run on a gloo group created for statekit, so a training barrier on the default
group can never interleave with them (KempnerForge#104).
"""

from __future__ import annotations

import atexit
from typing import Any

import torch.distributed as dist

_group: Any = None
_group_key: Any = None


def rank_and_world_size() -> tuple[int, int]:
    """``(rank, world_size)`` of this process; ``(0, 1)`` without torch.distributed."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def statekit_group() -> Any:
    """The gloo group statekit's collectives use (created on first multi-rank call; every
    rank must reach the first call, as they do at the start of every save and load)."""
    global _group, _group_key
    key = id(dist.distributed_c10d._get_default_group())
    if _group is None or _group_key != key:
        if _group is None:
            atexit.register(_forget_group)
        _group = dist.new_group(backend="gloo")
        _group_key = key
    return _group


def _forget_group() -> None:
    """Drop statekit's reference to its group at exit, while the interpreter is whole: a
    gloo group first freed during interpreter finalization can abort the process
    ("terminate called without an active exception", pytorch/pytorch PR 179291)."""
    global _group, _group_key
    _group = _group_key = None


def gather_to_rank0(obj: Any) -> list[Any] | None:
    """Gather a picklable object from every rank to rank 0 (internal metadata only, never
    checkpoint content). Returns the list on rank 0, None elsewhere; single process: ``[obj]``."""
    rank, world = rank_and_world_size()
    if world == 1:
        return [obj]
    group = statekit_group()
    out: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(obj, out, dst=0, group=group)
    return out


def broadcast_from_rank0(obj: Any) -> Any:
    """Broadcast a picklable object from rank 0 to every rank (a collective on statekit's
    own gloo group: every rank calls it at the same point).

    Args:
        obj: the object on rank 0 (other ranks' values are ignored; pass None).

    Returns:
        Rank 0's object, on every rank (``obj`` itself in one process).
    """
    _, world = rank_and_world_size()
    if world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=statekit_group())
    return box[0]


def barrier() -> None:
    """Barrier on statekit's own group (no-op in one process)."""
    if rank_and_world_size()[1] > 1:
        dist.barrier(group=statekit_group())


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` is True on any rank: one all-reduce (MAX) of a one-element int64
    tensor on statekit's own gloo group (every rank calls it at the same point). In one
    process: ``flag`` itself, no collective.

    Args:
        flag: this rank's value.

    Returns:
        True on every rank when at least one rank passed True.
    """
    if rank_and_world_size()[1] == 1:
        return bool(flag)
    import torch

    box = torch.tensor([1 if flag else 0], dtype=torch.int64)
    dist.all_reduce(box, op=dist.ReduceOp.MAX, group=statekit_group())
    return bool(box.item())
