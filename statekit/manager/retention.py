"""What follows a commit under a :class:`~statekit.CheckpointManager` root, on every rank
and on the thread that committed: ``latest``, retention (the manager's policies and the
plugins' ``statekit_retention_keep`` vetoes), the deletion of a deleted checkpoint's parts
on node-local roots, and the ``statekit_checkpoint_committed`` hook.
"""

from __future__ import annotations

from typing import Any

from statekit import distributed
from statekit.manager import lineage
from statekit.manager.listing import LATEST_NAME, delete_all_but
from statekit.errors import PluginError
from statekit.format.manifest_types import Manifest
from statekit.hooks.registry import call_each, get_plugin_manager


def after_commit(manager: Any, step: int, url: str, manifest: Manifest) -> None:
    """Every rank, right after ``manager``'s checkpoint ``url`` committed: rank 0 updates
    ``latest`` and applies retention; a rank whose root is not rank 0's (a node-local
    disk) deletes its part of what retention deleted; then ``statekit_checkpoint_committed``
    runs, even if rank 0's part failed (every rank reaches the same collectives).

    Args:
        manager: the :class:`statekit.CheckpointManager`.
        step: the committed step.
        url: its URL under the manager's root.
        manifest: the committed manifest.

    Raises:
        StorageError: rank 0 could not write ``latest`` or delete a checkpoint.
        PluginError: a ``statekit_retention_keep`` or ``statekit_checkpoint_committed``
            implementation failed (the checkpoint stays committed).
    """
    rank, world = distributed.rank_and_world_size()
    error: Exception | None = None
    deleted: list[str] = []
    if rank == 0:
        try:
            write_latest(manager, url)
            deleted = apply_retention(manager, url)
        except Exception as exc:  # noqa: BLE001 - raised below, once the other ranks are released
            error = exc
    if world > 1:
        deleted, root0 = distributed.broadcast_from_rank0((deleted, manager.root.url))
        if rank != 0 and root0 != manager.root.url:  # a node-local root: delete this node's parts
            for name in deleted:
                manager.root.child(name).remove_tree()
    try:  # on the writer thread for an async save: no RNG guard (docs/hooks.md)
        call_each(get_plugin_manager(), "statekit_checkpoint_committed", None,
                  {"url": url, "manifest": manifest, "manager": manager}, guard_rng=False)
    except Exception as exc:  # noqa: BLE001 - rank 0's own failure, if any, is reported first
        error = error or exc
    if error is not None:
        raise error


def write_latest(manager: Any, url: str) -> None:
    """Rank 0: the root's ``latest`` hint names ``url``'s folder (``checkpoint-<step>``, or
    ``checkpoint-<step>.<branch>`` on a branch).

    Raises:
        StorageError: the hint could not be written.
    """
    manager.root.write_bytes(LATEST_NAME, url.rstrip("/").rsplit("/", 1)[-1].encode("ascii") + b"\n")


def apply_retention(manager: Any, newest_url: str) -> list[str]:
    """Delete ``manager``'s committed checkpoints that no policy, no plugin
    (``statekit_retention_keep``) and the manager (the newest, the resumed-from one unless
    the policy says otherwise (``RetentionPolicy.keeps_resumed``), the target of a rollback
    waiting for this save: ``rollback_targets``) keep;
    a checkpoint in use by a live process warns and stays (rank 0 only).

    Under branches (``docs/concepts.md``, Lineage) the policies count the live history's
    checkpoints only; an abandoned checkpoint is kept until the live branch holds
    ``keep_last`` (or, without ``keep_last``, one) committed checkpoints of its own, then
    deleted.

    Only ``checkpoint-<step>`` folders are deleted: a pretrained folder a checkpoint
    references, and a copy of it carried under the root (``.statekit-bases``, a replica
    tier's), are never touched; ``statekit gc`` removes a carried copy no committed
    checkpoint references (:mod:`statekit.manager.bases`).

    Args:
        manager: the :class:`statekit.CheckpointManager` (its ``retention``).
        newest_url: the checkpoint just committed.

    Returns:
        The names of the deleted checkpoints.
    """
    if manager.retention.keeps_all:
        return []
    committed = [i for i in manager.list() if i.committed and not i.accelerate]  # never Accelerate's folders
    keep = {newest_url, *manager.rollback_targets}
    if manager.retention.keeps_resumed:
        keep.add(manager.resumed_from)
    vetoes = call_each(get_plugin_manager(), "statekit_retention_keep", None, {"checkpoints": committed, "manager": manager})
    for plugin, urls in vetoes:
        urls = [urls] if isinstance(urls, str) else urls  # one URL: not its characters
        try:
            keep |= {str(url) for url in urls}
        except TypeError:
            raise PluginError(
                f"plugin {plugin!r}: statekit_retention_keep must return URLs to keep, got {urls!r}",
                plugin_name=plugin, hook_name="statekit_retention_keep",
            ) from None
    state = manager._lineage.state  # the root's lineage file as the manager knows it (None: no branches)
    live = [i for i in committed if lineage.is_live(state, i)]
    keep |= manager.retention.kept(live)  # an abandoned checkpoint counts for nothing in the policies
    after = manager.retention.keep_last or 1
    keep |= {i.url for i in committed if i not in live} - lineage.abandoned_to_delete(state, committed, after)
    if manager.resumed_from is not None and manager.resumed_from not in keep:
        manager.release_resumed()  # this process's own in-use marker would keep it
    return delete_all_but(committed, keep, manager.storage_options)
