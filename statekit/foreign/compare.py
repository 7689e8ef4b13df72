"""Tensor-by-tensor comparison of two checkpoints of any readable formats (:func:`diff`),
one pair of tensors in memory at a time.
"""

from __future__ import annotations

from typing import Any

import torch

from statekit.foreign.base import CheckpointReader


def diff(a: CheckpointReader, b: CheckpointReader, *, advance: Any = None) -> dict[str, Any]:
    """Compare two checkpoints tensor by tensor (``statekit diff --json``, docs/cli.md): matched by
    key, then by :meth:`CheckpointReader.match_key`; the maximum absolute difference in float64
    (``inf`` where infinities differ, ``nan`` where only one side is NaN).

    Args:
        a: the old checkpoint.
        b: the new checkpoint.
        advance: ``callable(n_bytes)`` called after each compared pair (progress).

    Returns:
        A JSON-able dict: ``a``/``b``, ``added``, ``removed``, ``changed``, ``not_compared``,
        ``tensors``, ``files``, ``size_delta_bytes`` (``b - a``), ``identical``.
    """
    ta, tb = a.tensors(), b.tensors()
    pairs = _pairs(a, b, ta, tb)
    added, removed, unmatched = _unpaired(a, b, ta, tb, pairs)
    changed, compared = [], []
    for key, key_b in pairs.items():
        ia, ib = ta[key], tb[key_b]
        named = {"key": key, **({"b_key": key_b} if key_b != key else {})}
        if ia.shape != ib.shape or ia.dtype != ib.dtype:
            changed.append({**named, "a": {"dtype": ia.dtype, "shape": list(ia.shape)},
                            "b": {"dtype": ib.dtype, "shape": list(ib.shape)}})
        if ia.shape != ib.shape:
            continue
        compared.append({**named, **_compare_values(a, b, key, key_b, ia, ib)})
        if advance is not None:
            advance(ia.size_bytes + ib.size_bytes)
    sa, sb = a.summary(), b.summary()
    side = ("url", "format", "description", "layout", "size_bytes", "tensor_count", "tensor_bytes", "skipped", "superseded")
    files = _file_changes(a, b, sa["files"], sb["files"])
    return {
        "a": {k: sa[k] for k in side},
        "b": {k: sb[k] for k in side},
        "added": added,
        "removed": removed,
        "changed": changed,
        "tensors": compared,
        "not_compared": unmatched,
        "files": files,
        "size_delta_bytes": sb["size_bytes"] - sa["size_bytes"],
        "identical": not (added or removed or changed or files or unmatched or any(not t["equal"] for t in compared)),
    }


def _unpaired(
    a: CheckpointReader, b: CheckpointReader, ta: dict[str, Any], tb: dict[str, Any], pairs: dict[str, str]
) -> tuple[list[str], list[str], list[str]]:
    """``(added, removed, not_compared)``: keys without a counterpart (not compared where it would
    be in a file the other side did not read).
    """
    paired_b = set(pairs.values())
    unread_a, unread_b = _unread_files(a), _unread_files(b)  # the other side's tensors there are not "added"
    added = [k for k in tb if k not in paired_b and _file_of(b.match_key(k)) not in unread_a]
    removed = [k for k in ta if k not in pairs and _file_of(a.match_key(k)) not in unread_b]
    unmatched = [k for k in tb if k not in paired_b and k not in added] + [k for k in ta if k not in pairs and k not in removed]
    return added, removed, unmatched


def _compare_values(a: CheckpointReader, b: CheckpointReader, key: str, key_b: str, ia: Any, ib: Any) -> dict[str, Any]:
    """One pair of tensors of the same shape, loaded and compared (the only pair in memory):
    ``{dtype, shape, max_abs_diff, equal}``."""
    x, y = a.load_tensor(key), b.load_tensor(key_b)
    max_abs = _max_abs_diff(x, y)
    equal = ia.dtype == ib.dtype and _equal_values(x, y, max_abs)
    del x, y
    return {"dtype": ib.dtype, "shape": list(ib.shape), "max_abs_diff": max_abs, "equal": equal}


def _pairs(a: CheckpointReader, b: CheckpointReader, ta: dict[str, Any], tb: dict[str, Any]) -> dict[str, str]:
    """``key in a -> key in b`` of the tensors compared: equal keys, then by ``match_key``."""
    pairs = {k: k for k in ta if k in tb}
    left_b = {b.match_key(k): k for k in tb if k not in pairs}
    for key in ta:
        if key not in pairs and (found := left_b.pop(a.match_key(key), None)) is not None:
            pairs[key] = found
    return pairs


def _unread_files(reader: CheckpointReader) -> set[str]:
    """The files a reader did not read (pickles without ``allow_pickle``, superseded files),
    under the names :meth:`CheckpointReader.match_key` gives their tensors."""
    return {_file_of(reader.match_key(f"{rel}:")) for rel in [*reader.skipped, *reader.superseded]}


def _file_of(key: str) -> str:
    return key.partition(":")[0]


def _checksums(reader: CheckpointReader) -> dict[str, str]:
    """A statekit checkpoint's file checksums from its manifest (other formats record none)."""
    manifest = getattr(reader, "manifest", None) if reader.format == "statekit" else None
    return {rel: e.checksum for rel, e in manifest.files.items()} if manifest is not None else {}


def _file_changes(a: CheckpointReader, b: CheckpointReader, files_a: dict[str, int], files_b: dict[str, int]) -> list[dict[str, Any]]:
    """Files of two directories of one format and layout whose size or (statekit) manifest checksum differs."""
    if not (a.format == b.format and a.layout == b.layout and a.format in ("statekit", "accelerate", "dcp")):
        return []
    sums_a = _checksums(a)
    sums_b = _checksums(b)
    files = []
    for rel in sorted(set(files_a) | set(files_b)):
        size_a, size_b = files_a.get(rel), files_b.get(rel)
        same = sums_a.get(rel) == sums_b.get(rel) if rel in sums_a and rel in sums_b else None
        if size_a != size_b or same is False:
            files.append({"file": rel, "a_bytes": size_a, "b_bytes": size_b, "checksum_equal": same})
    return files


def _equal_values(x: torch.Tensor, y: torch.Tensor, max_abs: float | None) -> bool:
    """Bit-equal, or equal with NaN at the same places (integers never by the float64
    difference, which rounds above 2**53).
    """
    if torch.equal(x, y):
        return True
    return (x.is_floating_point() or x.is_complex()) and max_abs == 0.0


def _max_abs_diff(x: torch.Tensor, y: torch.Tensor) -> float | None:
    """max |x - y| in float64 (None for empty tensors; bool/int compared as numbers)."""
    if x.numel() == 0:
        return None
    if x.is_complex() or y.is_complex():
        d = (x.to(torch.complex128) - y.to(torch.complex128)).abs()
    elif not (x.is_floating_point() or y.is_floating_point()) and x.dtype != torch.uint64 and y.dtype != torch.uint64:
        # integers and bools: exact in int64 (float64 rounds above 2**53)
        d = (x.to(torch.int64) - y.to(torch.int64)).abs()
        return float(d.max().item())
    else:
        xd, yd = x.to(torch.float64), y.to(torch.float64)
        d = (xd - yd).abs()
        same = (xd == yd) | (torch.isnan(xd) & torch.isnan(yd))  # inf == inf and NaN at NaN: no difference
        d = torch.where(same, torch.zeros((), dtype=torch.float64), d)
    return float(d.max().item())
