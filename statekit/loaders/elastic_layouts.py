"""Elastic data position, the layout models: which positions of an epoch (ints ``0..L-1``
standing for ``P[p]``) each rank of a layout yields (:func:`shard`: Accelerate's
``BatchSamplerShard`` and ``DataLoaderDispatcher``, torch's ``DistributedSampler``), what the
consumed segments left (:func:`remaining`), and ``P`` drawn again (:func:`permutation`).
Sources: :mod:`statekit.loaders.elastic`; tests/unit/loaders/test_elastic.py checks them.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from statekit.errors import StateMismatchError

SHARD, DISPATCH, DISTRIBUTED, UNSUPPORTED = "shard", "dispatch", "distributed", "unsupported"


def remaining(length: int, segments: list[dict[str, Any]]) -> list[int]:
    """The positions of an epoch of ``length`` samples that no rank consumed, in order.

    Args:
        length: ``L``.
        segments: ``{"layout": describe(...), "batches": [consumed batches per rank, -1 = all]}``
            in resume order; each segment hands what the earlier ones left to its layout.

    Returns:
        The remaining positions (ints in ``0..L-1``), ascending.
    """
    epoch = list(range(length))
    left = epoch
    for segment in segments:
        per_rank = shard(left, segment["layout"], epoch)
        seen = {p for r, k in enumerate(segment["batches"]) for batch in (per_rank[r] if k < 0 else per_rank[r][:k]) for p in batch}
        left = [p for p in left if p not in seen]
    return left


def shard(positions: list[int], layout: dict[str, Any], epoch: list[int]) -> list[list[list[int]]]:
    """Per rank, the position batches a loader of ``layout`` yields for ``positions``.

    Args:
        positions: what is left of the epoch (the whole ``epoch`` for an uninterrupted one).
        layout: :func:`statekit.loaders.elastic.describe` of the loader (``kind``,
            ``world_size``, ``batch_size``, ``drop_last``, ``even_batches``,
            ``split_batches``, ``sampler``).
        epoch: all positions of the epoch; padding is taken from its start.

    Returns:
        ``[rank][step] -> list of positions`` for every rank of the layout.
    """
    n, size, drop = int(layout["world_size"]), int(layout["batch_size"]), bool(layout["drop_last"])
    if layout["kind"] == DISTRIBUTED:
        return _distributed(positions, n, size, drop, bool(layout["sampler"].get("drop_last")), epoch)
    batches = chunk(positions, size, drop)
    if layout["kind"] == DISPATCH:
        return _dispatch(batches, n, bool(layout["split_batches"]), drop)
    if layout["split_batches"]:
        first = chunk(epoch, size, drop)[:1]
        return [_split(batches, n, r, size, bool(layout["even_batches"]), drop, first[0] if first else []) for r in range(n)]
    initial = [p for b in chunk(epoch, size, drop)[:n] for p in b]
    return [_no_split(batches, n, r, size, bool(layout["even_batches"]), drop, initial) for r in range(n)]


def chunk(positions: list[int], size: int, drop_last: bool) -> list[list[int]]:
    """torch ``BatchSampler``: batches of ``size``, the short last one dropped with ``drop_last``."""
    batches = [positions[i : i + size] for i in range(0, len(positions), size)]
    return batches[:-1] if drop_last and batches and len(batches[-1]) < size else batches


def _no_split(batches: list[list[int]], n: int, r: int, size: int, even: bool, drop: bool, initial: list[int]) -> list[list[int]]:
    """``BatchSamplerShard._iter_with_no_split`` for rank ``r``, padding from ``initial``."""
    out: list[list[int]] = []
    to_yield: list[int] | None = None
    idx, batch = -1, []
    for idx, batch in enumerate(batches):
        if idx % n == r:
            to_yield = batch
        if idx % n == n - 1 and len(batch) == size:
            out.append(to_yield or [])
            to_yield = None
    if drop or not batches:
        return out
    if not even:
        return out + ([to_yield] if to_yield else [])
    if to_yield and len(to_yield) == size:
        out.append(to_yield)
    initial = list(initial)
    while initial and len(initial) < n * size:
        initial += initial
    if len(batch) == size:  # the last batch was whole and yielded: padding starts a new slot
        batch, idx = [], idx + 1
    cycle = 0
    while idx % n != 0 or batch:
        end = cycle + size - len(batch)
        batch = batch + initial[cycle:end]
        if idx % n == r:
            out.append(batch)
        cycle, batch, idx = end, [], idx + 1
    return out


def _split(batches: list[list[int]], n: int, r: int, size: int, even: bool, drop: bool, first: list[int]) -> list[list[int]]:
    """``BatchSamplerShard._iter_with_split`` for rank ``r``, padding from ``first``."""
    part = size // n
    out = [b[part * r : part * (r + 1)] for b in batches if len(b) == size]
    if drop or not batches or len(batches[-1]) == size:
        return out
    last = batches[-1]
    if not even:
        return out + ([last[part * r : part * (r + 1)]] if len(last) > part * r else [])
    initial = list(first)
    while initial and len(initial) < size:
        initial += initial
    return out + [(last + initial)[part * r : part * (r + 1)]]


def _dispatch(batches: list[list[int]], n: int, split: bool, drop: bool) -> list[list[list[int]]]:
    """``DataLoaderDispatcher``: each step concatenates ``n`` base batches (one with
    ``split``) and gives rank ``r`` slice ``r``; the last step is padded with the first
    ``n`` samples of the iteration when it does not divide by ``n``."""
    groups = [batches[i : i + 1] for i in range(len(batches))] if split else [batches[i : i + n] for i in range(0, len(batches), n)]
    if drop and not split:
        groups = [g for g in groups if len(g) == n]
    out: list[list[list[int]]] = [[] for _ in range(n)]
    first = [p for b in groups[0] for p in b][:n] if groups else []
    for i, group in enumerate(groups):
        flat = [p for b in group for p in b]
        each = len(flat) // n
        if not drop and i == len(groups) - 1 and len(flat) % n:
            flat, each = flat + first, each + 1
        for r in range(n):
            out[r].append(flat[r * each : (r + 1) * each])
    return out


def _distributed(positions: list[int], n: int, size: int, drop: bool, sampler_drop: bool, epoch: list[int]) -> list[list[list[int]]]:
    """``DistributedSampler`` (pad from the epoch's start, or cut) then ``BatchSampler`` per rank."""
    count = len(positions)
    each = math.ceil((count - n) / n) if sampler_drop and count % n else math.ceil(count / n)
    total = each * n
    if sampler_drop:
        padded = positions[:total]
    else:
        pad = total - count
        source = epoch if pad <= len(epoch) else epoch * math.ceil(pad / max(len(epoch), 1))
        padded = positions + source[:pad]
    return [chunk(padded[r:total:n], size, drop) for r in range(n)]


def permutation(source: dict[str, Any], sampler: Any, length: int) -> list[int]:
    """The epoch's permutation ``P``: ``DistributedSampler``'s shuffle with the saved ``seed`` and
    ``epoch``, or the live sampler (at its epoch-start state) iterated once.

    Raises:
        StateMismatchError: the sampler yields another number of samples than saved.
    """
    if source["kind"] == DISTRIBUTED:
        if not source["shuffle"]:
            return list(range(length))
        g = torch.Generator()
        g.manual_seed(int(source["seed"]) + int(source["epoch"]))
        return torch.randperm(length, generator=g).tolist()
    order = list(sampler)
    if len(order) != length:
        raise StateMismatchError(f"sampler {type(sampler).__name__} (it yields {len(order)} samples, the checkpoint's epoch {length})")
    return order
