"""What the two tiers hold together: the order a resume tries their checkpoints in, and
retention per tier (local retention keeps what is not replicated; remote retention keeps
what is resumed from or being copied). The copying itself is :mod:`statekit.api.replication`.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from statekit import distributed, format as fmt
from statekit.api.listing import CheckpointInfo, delete_all_but
from statekit.api.replication import Replicator
from statekit.errors import StatekitError, StatekitWarning
from statekit.storage import Storage


def unreplicated(replicator: Replicator, local: list[CheckpointInfo]) -> set[str]:
    """URLs of the ``local`` checkpoints not known to have a committed remote copy: local
    retention keeps these. Known from the replicator's own record, so a save never waits
    on the remote tier (which may be down or frozen)."""
    replicated = replicator.replicated_names()
    return {i.url for i in local if i.name not in replicated}


def remote_retention(replicator: Replicator | None, keep_last: int | None, resumed_from: str | None) -> None:
    """Delete remote copies beyond the newest ``keep_last`` committed ones, never the one
    the run resumed from nor one being copied; a copy in use warns and is kept.

    Args:
        replicator: the remote tier (None: nothing to do).
        keep_last: committed remote checkpoints to keep (None: keep every one).
        resumed_from: URL the run resumed from (kept), or None.
    """
    if replicator is None or keep_last is None:
        return
    committed = [i for i in replicator.list() if i.committed and not i.accelerate]
    keep = {i.url for i in committed[-keep_last:]} | {resumed_from}
    keep |= {replicator.remote.url_of(name) for name in replicator.pending()}  # being copied
    delete_all_but(committed, keep, replicator.storage_options, "remote retention")


def resume_candidates(
    local: list[CheckpointInfo], replicator: Replicator, local_options: dict[str, Any] | None, local_url_of: Any
) -> list[CheckpointInfo]:
    """The committed checkpoints of both tiers in the order a resume tries them: newest
    step first, a step's local copy before its remote one. When the newest local
    checkpoint also exists remotely with a different manifest, warn (the local one is
    used). A remote tier that cannot be listed warns and is left out.

    With several ranks every rank calls it and gets rank 0's list; a local checkpoint is
    a candidate only where every rank's own local root holds it committed (a node-local
    root holds its node's files only: a checkpoint saved across nodes is then resumed
    from its remote copy).

    Args:
        local: this rank's committed local checkpoints, oldest first.
        replicator: the remote tier.
        local_options: fsspec options of the local root.
        local_url_of: ``callable(name) -> str``, this rank's local directory of a checkpoint.

    Returns:
        Candidates, best first; local ones point at this rank's own root.
    """
    if replicator.world_size == 1:
        return _ordered(local, replicator, local_options)
    everywhere = distributed.gather_to_rank0({i.name for i in local})
    ordered = None
    if everywhere is not None:  # rank 0
        shared = set.intersection(*everywhere)
        ordered = [i for i in _ordered(local, replicator, local_options) if _is_remote(replicator, i) or i.name in shared]
    ordered = distributed.broadcast_from_rank0(ordered)
    return [i if _is_remote(replicator, i) else dataclasses.replace(i, url=local_url_of(i.name)) for i in ordered]


def _ordered(local: list[CheckpointInfo], replicator: Replicator, local_options: dict[str, Any] | None) -> list[CheckpointInfo]:
    try:
        remote = [i for i in replicator.list() if i.committed and not i.accelerate]
    except StatekitError as exc:
        warnings.warn(f"cannot list the remote tier {replicator.remote_url} ({exc}); resuming from the local one",
                      StatekitWarning, stacklevel=3)
        remote = []
    newest = local[-1] if local else None
    for twin in remote:
        if newest is not None and twin.name == newest.name and not _same_manifest(
            Storage(newest.url, local_options), Storage(twin.url, replicator.storage_options)
        ):
            warnings.warn(f"{newest.url} and {twin.url} hold step {newest.step} with different manifests; using the local one",
                          StatekitWarning, stacklevel=3)
    tiers = [(i, 0) for i in local] + [(i, 1) for i in remote]
    return [i for i, _ in sorted(tiers, key=lambda it: (-it[0].step, it[1]))]


def _is_remote(replicator: Replicator, info: CheckpointInfo) -> bool:
    return info.url.startswith(replicator.remote_url + "/")


def _same_manifest(a: Storage, b: Storage) -> bool:
    try:
        return a.read_bytes(fmt.MANIFEST_NAME) == b.read_bytes(fmt.MANIFEST_NAME)
    except (StatekitError, OSError):
        return True  # unreadable: loading it will say what is wrong
