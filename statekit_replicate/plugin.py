"""Two-tier checkpoints as a built-in plugin, ``replicate``, on the manager hooks.

``CheckpointManager(..., replicate_to="s3://bucket/run")`` registers
:class:`Replicate` (:func:`ensure_registered`); everything two-tier happens in its hook
implementations, through the contract any plugin has (``docs/hooks.md``, Manager hooks):

* ``statekit_manager_start``: start a :class:`~statekit_replicate.replication.Replicator` for the
  manager (kept in ``manager.plugin_state["replicate"]``) and queue what a killed process
  left unreplicated;
* ``statekit_checkpoint_committed``: queue the new checkpoint (an async save's at its
  commit, from the writer thread);
* ``statekit_retention_keep``: local retention keeps every checkpoint whose remote copy
  has not committed (unless ``delete_unreplicated=True``);
* ``statekit_resume_roots``: offer the remote root, so ``resume()`` considers both tiers;
* ``statekit_manager_wait``: ``manager.wait(timeout)`` waits for the copies.

Remote retention (``remote_keep_last``) runs on the replicator's thread after each remote
commit and never deletes the checkpoint the run resumed from nor one being copied. The
copying itself is :mod:`statekit_replicate.replication` and :mod:`statekit_replicate.remote_copy`.
"""

from __future__ import annotations

import weakref
from typing import Any

from statekit import distributed
from statekit._version import __version__
from statekit.manager.listing import CheckpointInfo, delete_all_but
from statekit_replicate.replication import Replicator, start_replication
from statekit.errors import PluginMissingError
from statekit.hooks.registry import hookimpl

REPLICATE_PLUGIN = "replicate"
"""Name of the built-in two-tier plugin (and its key in ``manager.plugin_state``)."""


def replicator_of(manager: Any) -> Replicator | None:
    """The manager's :class:`Replicator`, or None without ``replicate_to``."""
    return manager.plugin_state.get(REPLICATE_PLUGIN)


class Replicate:
    """The built-in plugin that copies a manager's checkpoints to ``replicate_to`` (see the module)."""

    STATEKIT_OPTIONS: frozenset[str] = frozenset()  # reads no checkpoint.options (its settings are the manager's)

    @hookimpl
    def statekit_manager_start(self, manager: Any) -> None:
        """Start the replicator and catch up (every rank; collectives with several)."""
        if manager.replicate_to is None:
            return
        owner = weakref.ref(manager)  # the replicator's thread must not keep the manager alive

        def on_replicated(name: str) -> None:
            live = owner()
            if live is not None:
                remote_retention(replicator_of(live), live.remote_keep_last, live.resumed_from, just_copied=name)

        rank, _ = distributed.rank_and_world_size()
        manager.plugin_state[REPLICATE_PLUGIN] = start_replication(
            manager.replicate_to, manager.replicate_options, manager.list, manager.root.url_of,
            on_replicated=on_replicated if rank == 0 else None, keep_last=manager.remote_keep_last,
        )

    @hookimpl
    def statekit_checkpoint_committed(self, url: str, manager: Any) -> None:
        """Queue the committed checkpoint (every rank; rank 0 shares the manifest)."""
        replicator = replicator_of(manager)
        if replicator is not None:
            replicator.submit_committed(url, manager.storage_options)

    @hookimpl
    def statekit_retention_keep(self, checkpoints: list[CheckpointInfo], manager: Any) -> set[str] | None:
        """Keep the local checkpoints without a committed remote copy."""
        replicator = replicator_of(manager)
        if replicator is None or manager.delete_unreplicated:
            return None
        return unreplicated(replicator, checkpoints)

    @hookimpl
    def statekit_resume_roots(self, manager: Any) -> list[tuple[str, Any]] | None:
        """Offer the remote root to ``resume()``."""
        replicator = replicator_of(manager)
        return None if replicator is None else [(replicator.remote_url, replicator.storage_options)]

    @hookimpl
    def statekit_manager_wait(self, manager: Any, timeout: float | None) -> None:
        """Wait for the copies; warn about each one not done."""
        replicator = replicator_of(manager)
        if replicator is not None:
            replicator.wait(timeout)


def ensure_registered(pm: Any, replicate_to: str | None) -> None:
    """Register :class:`Replicate` as :data:`REPLICATE_PLUGIN` on ``pm`` once.

    Args:
        pm: the plugin manager.
        replicate_to: the manager's remote root, or None.

    Raises:
        PluginMissingError: ``replicate_to`` is set but ``STATEKIT_DISABLE_PLUGINS``
            blocks the plugin (the remote tier would silently not exist).
    """
    if not pm.register_builtin(Replicate, REPLICATE_PLUGIN, __version__) and replicate_to is not None:
        raise PluginMissingError(
            f"replicate_to={replicate_to!r} needs the built-in plugin {REPLICATE_PLUGIN!r}, "
            "which STATEKIT_DISABLE_PLUGINS blocks",
            plugin_name=REPLICATE_PLUGIN,
        )


def unreplicated(replicator: Replicator, local: list[CheckpointInfo]) -> set[str]:
    """URLs of the ``local`` checkpoints not known to have a committed remote copy: local
    retention keeps these. Known from the replicator's own record, so a save never waits
    on the remote tier (which may be down or frozen)."""
    replicated = replicator.replicated_names()
    return {i.url for i in local if i.name not in replicated}


def remote_retention(
    replicator: Replicator | None, keep_last: int | None, resumed_from: str | None, just_copied: str | None = None
) -> None:
    """Delete remote copies beyond the newest ``keep_last`` committed ones, never the one
    the run resumed from nor one being copied; a copy in use warns and is kept.

    Args:
        replicator: the remote tier (None: nothing to do).
        keep_last: committed remote checkpoints to keep (None: keep every one).
        resumed_from: URL the run resumed from (kept), or None.
        just_copied: name of the checkpoint whose remote commit runs this (on the
            replicator's thread, before it leaves the pending list); it is not "being
            copied" any more, so the policy may count and delete it like any other.
    """
    if replicator is None or keep_last is None:
        return
    committed = [i for i in replicator.list() if i.committed and not i.accelerate]
    keep = {i.url for i in committed[-keep_last:]} | {resumed_from}
    copying = set(replicator.pending()) - {just_copied}  # the copy that just committed is still listed as pending
    keep |= {replicator.remote.url_of(name) for name in copying}
    delete_all_but(committed, keep, replicator.storage_options, "remote retention")
