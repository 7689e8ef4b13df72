"""Names inside a checkpoint directory that follow a rule: the per-rank path
``<key>/rank-<r:05d>`` (:func:`rank_path`, :func:`rank_name`, :func:`parse_rank_path`; every
module and plugin goes through them) and what a checkpoint-relative path may be
(:func:`check_relpath`). docs/format.md.
"""

from __future__ import annotations

import re

from statekit.errors import CorruptCheckpointError

_RANK_PATH = re.compile(r"^(?P<key>.+)/rank-(?P<rank>\d{5,})(?P<suffix>\..*)?$")


def rank_name(rank: int) -> str:
    """The per-rank component of a path: ``rank-<rank:05d>``.

    Args:
        rank: the process rank (``0`` .. world size - 1).

    Returns:
        ``"rank-00003"`` for rank 3.
    """
    return f"rank-{int(rank):05d}"


def rank_path(key: str, rank: int) -> str:
    """Where one rank's copy of a per-rank state lives, relative to the checkpoint directory and
    without a suffix (the writer adds ``.json`` / ``.safetensors``).

    Args:
        key: the state's stable key (``"dataloader_0"``, ``"rng"``).
        rank: the rank that writes it.

    Returns:
        ``"<key>/rank-<rank:05d>"`` (``"dataloader_0/rank-00003"``).
    """
    return f"{key}/{rank_name(rank)}"


NEXT_BATCH_DIR = "next-batch"
"""The folder of the next-batch records beside a checkpoint: written after its commit, never
listed in a manifest (a save into the folder again must not list the previous save's)."""


def next_batch_path(key: str, rank: int) -> str:
    """Where a loader's next-batch record lives (written after the commit, not in the manifest).

    Returns:
        ``"next-batch/<key>/rank-<rank:05d>.json"``.
    """
    return f"{NEXT_BATCH_DIR}/{rank_path(key, rank)}.json"


def parse_rank_path(rel: str) -> tuple[str, int] | None:
    """The inverse of :func:`rank_path`, for a path with or without a file suffix.

    Args:
        rel: a path relative to the checkpoint directory (``"rng/rank-00001.json"``).

    Returns:
        ``(key, rank)`` (``("rng", 1)``), or None when ``rel`` is not a per-rank path.
    """
    match = _RANK_PATH.match(rel)
    if match is None:
        return None
    return match.group("key"), int(match.group("rank"))


def check_relpath(path: str, source: str = "manifest", error: type[Exception] = CorruptCheckpointError) -> str:
    """Validate a checkpoint-relative path: no scheme, no absolute path, no ``..``.

    Args:
        path: the relative path.
        source: what holds it (a manifest URL), named in the error.
        error: the error class to raise (writers pass ``StatekitError``: a caller bug).

    Returns:
        ``path`` unchanged.

    Raises:
        CorruptCheckpointError: (or ``error``) the path escapes the checkpoint or is malformed.
    """
    parts = path.split("/") if isinstance(path, str) else []
    if (
        not parts
        or "://" in path
        or path.startswith("/")
        or "\\" in path
        or any(p in ("", ".", "..") for p in parts)
    ):
        message = f"{source}: invalid relative path {path!r} (must stay inside the checkpoint)"
        raise error(message, path=source) if error is CorruptCheckpointError else error(message)
    return path
