"""Rank, world size and the save's own gloo process groups, so a training barrier on the
default group never interleaves with statekit's collectives (KempnerForge#104). They time
out after :data:`COLLECTIVE_TIMEOUT_ENV` (300 s, half the NCCL watchdog's) with a
:class:`~statekit.errors.CollectiveTimeoutError` naming the collective. docs/backpressure.md.
"""

from __future__ import annotations

import atexit
import re
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from statekit.errors import CollectiveTimeoutError, InvalidOptionError, seconds_from_env

COLLECTIVE_TIMEOUT_ENV = "STATEKIT_COLLECTIVE_TIMEOUT"
"""Seconds each collective on statekit's gloo group waits for every rank (a number > 0;
read when the group is created, at the first save or load with several ranks)."""

DEFAULT_COLLECTIVE_TIMEOUT_SECONDS = 300.0

_group: Any = None
_control_group: Any = None
_signal_group: Any = None
_group_key: Any = None

SIGNAL_AGREE_TIMEOUT_SECONDS = 5.0
"""Seconds the ranks' signal watchers wait for each other (:func:`watchers_agree`): every
rank's watcher wakes within milliseconds of a launcher forwarding the signal; a rank that
does not answer by then makes every rank save at its next safe point instead."""


def rank_and_world_size() -> tuple[int, int]:
    """``(rank, world_size)`` of this process; ``(0, 1)`` without torch.distributed."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def collective_timeout_seconds() -> float:
    """The timeout of statekit's collectives: :data:`COLLECTIVE_TIMEOUT_ENV`, or 300 s when unset.

    Returns:
        Seconds, a finite number > 0.

    Raises:
        InvalidOptionError: the variable is not a finite number of seconds > 0 (naming it
            and its value).
    """
    return seconds_from_env(COLLECTIVE_TIMEOUT_ENV, DEFAULT_COLLECTIVE_TIMEOUT_SECONDS,
                            what="the timeout of statekit's collectives", zero_allowed=False)


def statekit_group() -> Any:
    """The gloo group statekit's collectives use, created with :func:`control_group` on the first
    multi-rank call (every rank, in one order), with :func:`collective_timeout_seconds`.

    Raises:
        InvalidOptionError: :data:`COLLECTIVE_TIMEOUT_ENV` is invalid.
    """
    global _group, _control_group, _signal_group, _group_key
    key = id(dist.distributed_c10d._get_default_group())
    if _group is None or _group_key != key:
        timeout = timedelta(seconds=collective_timeout_seconds())
        if _group is None:
            atexit.register(_forget_group)
        _group = dist.new_group(backend="gloo", timeout=timeout)
        _control_group = dist.new_group(backend="gloo", timeout=timeout)
        _signal_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=SIGNAL_AGREE_TIMEOUT_SECONDS))
        _group_key = key
    return _group


def control_group() -> Any:
    """A second gloo group, for the training thread's agreements while an async save may run
    collectives on :func:`statekit_group` on its writer thread: two threads sharing one group
    would issue collectives in different orders on different ranks (a hang).

    Raises:
        InvalidOptionError: :data:`COLLECTIVE_TIMEOUT_ENV` is invalid.
    """
    statekit_group()
    return _control_group


def signal_group() -> Any:
    """The gloo group the ranks' signal watchers agree on (:func:`watchers_agree`), created
    with :func:`statekit_group` (same order on every rank), its timeout
    :data:`SIGNAL_AGREE_TIMEOUT_SECONDS`. A manager with ``save_on_signal`` calls it when
    created on every rank: a watcher thread must never be the one to create a group.

    Returns:
        The group (None in one process).
    """
    if rank_and_world_size()[1] == 1:
        return None
    statekit_group()
    return _signal_group


def watchers_agree(step: int, clean: bool) -> bool:
    """The ranks' signal watchers agree to save ``step`` from the watcher: one all-reduce
    (MIN) of ``[step, -step, clean]`` on :func:`signal_group`, bounded by its timeout.

    Args:
        step: this rank's step boundary (-1: none).
        clean: this rank can save it (its live state is that boundary's).

    Returns:
        True when every rank answered in time with the same step and clean; False when one
        did not, or differs, or did not answer (the group is not used again: a late rank's
        call times out too).
    """
    global _signal_group
    if rank_and_world_size()[1] == 1:
        return clean and step >= 0
    group = _signal_group
    if group is None:
        return False
    box = torch.tensor([step, -step, int(clean)], dtype=torch.int64)
    try:
        dist.all_reduce(box, op=dist.ReduceOp.MIN, group=group)
    except RuntimeError:  # gloo: "Timed out", "Connection closed by peer"
        _signal_group = None  # one round per process: a late rank must not meet a stale one
        return False
    low, minus_high, all_clean = (int(v) for v in box.tolist())
    return bool(all_clean) and low == -minus_high and low >= 0


def _collective(name: str, call: Callable[[], Any]) -> Any:
    """Run one collective on statekit's group; a timeout or a gone peer is a ``CollectiveTimeoutError``."""
    try:
        return call()
    except RuntimeError as exc:  # gloo: DistBackendError / RuntimeError "Timed out ...", "Connection closed by peer"
        rank, world = rank_and_world_size()
        timeout = collective_timeout_seconds()
        ranks = sorted({int(r) for r in re.findall(r"\brank[ =:]*(\d+)", str(exc), flags=re.IGNORECASE)} - {rank})
        if not ranks and world == 2:
            ranks = [1 - rank]  # the only other rank
        missing = f"rank(s) {ranks} did not answer" if ranks else "which rank(s) did not answer is not known"
        raise CollectiveTimeoutError(
            f"statekit collective {name} on rank {rank} of {world} failed or did not complete within {timeout:g} s "
            f"({COLLECTIVE_TIMEOUT_ENV}) (gloo: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}): "
            f"{missing}; a rank never reached this save or load (crashed, or busy elsewhere). Nothing was "
            f"committed by it; statekit's process group is unusable now: end the process",
            name, timeout, ranks or None,
        ) from exc


def _forget_group() -> None:
    """Drop the groups at exit: one freed during finalization can abort the process (pytorch PR 179291)."""
    global _group, _control_group, _signal_group, _group_key
    _group = _control_group = _signal_group = _group_key = None


def gather_to_rank0(obj: Any) -> list[Any] | None:
    """Gather a picklable object from every rank to rank 0 (internal metadata only, never
    checkpoint content). Returns the list on rank 0, None elsewhere; single process: ``[obj]``."""
    rank, world = rank_and_world_size()
    if world == 1:
        return [obj]
    out: list[Any] | None = [None] * world if rank == 0 else None
    _collective("gather_to_rank0", lambda: dist.gather_object(obj, out, dst=0, group=statekit_group()))
    return out


def broadcast_from_rank0(obj: Any) -> Any:
    """Broadcast a picklable object from rank 0 to every rank (a collective: every rank calls it).

    Args:
        obj: the object on rank 0 (other ranks' values are ignored; pass None).

    Returns:
        Rank 0's object, on every rank (``obj`` itself in one process).
    """
    _, world = rank_and_world_size()
    if world == 1:
        return obj
    box = [obj]
    _collective("broadcast_from_rank0", lambda: dist.broadcast_object_list(box, src=0, group=statekit_group()))
    return box[0]


def barrier() -> None:
    """Barrier on statekit's own group (no-op in one process)."""
    if rank_and_world_size()[1] > 1:
        _collective("barrier", lambda: dist.barrier(group=statekit_group()))


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` is True on any rank (a collective; in one process ``flag`` itself).

    Args:
        flag: this rank's value.

    Returns:
        True on every rank when at least one rank passed True.
    """
    return bool(max_over_ranks([1 if flag else 0])[0])


def max_over_ranks(values: list[int]) -> list[int]:
    """The element-wise maximum of ``values`` over the ranks: one all-reduce on
    :func:`control_group`, from the training thread (every rank, as many values).

    Args:
        values: this rank's integers.

    Returns:
        The maxima, the same list on every rank (``values`` in one process).

    Raises:
        CollectiveTimeoutError: a rank did not answer within the collective timeout.
    """
    return _all_reduce_ints("max_over_ranks", values, dist.ReduceOp.MAX, control_group)


def sum_over_ranks(values: list[int]) -> list[int]:
    """The element-wise sum of ``values`` over the ranks: one all-reduce on :func:`statekit_group`,
    from the thread running the save or load (every rank, as many values).

    Args:
        values: this rank's integers; each sum must fit in a signed 64-bit integer.

    Returns:
        The sums, the same list on every rank (``values`` in one process).

    Raises:
        CollectiveTimeoutError: a rank did not answer within the collective timeout.
    """
    return _all_reduce_ints("sum_over_ranks", values, dist.ReduceOp.SUM, statekit_group)


def _all_reduce_ints(name: str, values: list[int], op: Any, group: Callable[[], Any]) -> list[int]:
    """One all-reduce of ``values`` as an int64 tensor on ``group()`` (no collective in one process)."""
    if rank_and_world_size()[1] == 1:
        return list(values)
    box = torch.tensor(values, dtype=torch.int64)
    _collective(name, lambda: dist.all_reduce(box, op=op, group=group()))
    return [int(v) for v in box.tolist()]


def ddp_buckets_unbuilt(model: Any) -> bool:
    """True for a ``DistributedDataParallel`` model over more than two ranks whose gradient
    buckets are still in their first layout (no backward yet, no unused-parameter search, not
    rebuilt): a resume from there differs in the last bits (``Reducer::rebuild_buckets``; why:
    docs/concepts.md, "More than two ranks").

    Args:
        model: any object (only a ``torch.nn.parallel.DistributedDataParallel`` can be True).
    """
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel) or rank_and_world_size()[1] <= 2:
        return False
    if getattr(model, "find_unused_parameters", False) or getattr(model, "_has_rebuilt_buckets", False):
        return False
    try:
        stats = model.reducer.get_backward_stats()  # per parameter, the time its last backward took; 0 before any
    except (AttributeError, RuntimeError):
        return False
    return not any(stats)
