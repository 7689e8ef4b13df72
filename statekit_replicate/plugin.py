"""The ``replicate`` plugin: two-tier checkpoints on the manager hooks and the plugin API.

``CheckpointManager(..., replicate_to="s3://bucket/run")`` copies every committed
checkpoint to the remote root. The plugin is registered like any plugin, through the
entry point ``replicate`` of group ``statekit`` (the statekit distribution declares it),
imports statekit only through :mod:`statekit.plugin_api`, and uses only the contract any
plugin has (``docs/hooks.md``, Manager hooks):

* ``STATEKIT_MANAGER_OPTIONS``: the manager keyword options it owns (``replicate_to``,
  ``replicate_options``, ``remote_keep_last``, ``delete_unreplicated``,
  ``replicate_max_backlog``, ``replicate_hedge_after_s``), validated in
  ``statekit_manager_options`` and read back from ``manager.manager_options``;
* ``statekit_manager_start``: start a :class:`~statekit_replicate.replication.Replicator`
  for the manager (kept in ``manager.plugin_state["replicate"]``) and queue what a killed
  process left unreplicated;
* ``statekit_checkpoint_committed``: queue the new checkpoint (an async save's at its
  commit, from the writer thread);
* ``statekit_retention_keep``: local retention keeps every checkpoint whose remote copy
  has not committed (unless ``delete_unreplicated=True``);
* ``statekit_resume_roots``: offer the remote root, so ``resume()`` considers both tiers;
* ``statekit_manager_wait``: ``manager.wait(timeout)`` waits for the copies.

Remote retention (``remote_keep_last``) runs on the replicator's thread after each remote
commit and never deletes the checkpoint the run resumed from nor one being copied. The
copying itself is :mod:`statekit_replicate.replication` and
:mod:`statekit_replicate.remote_copy`.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping
from typing import Any

from statekit.plugin_api import (
    CheckpointDir,
    CopyListing,
    InvalidOptionError,
    ManagerView,
    delete_all_but,
    hookimpl,
    Storage,
    rank_and_world_size,
    retention_view,
)
from statekit_replicate.replication import COPY_MARKER, DEFAULT_HEDGE_AFTER_S, DEFAULT_MAX_BACKLOG, Replicator, start_replication

REPLICATE_PLUGIN = "replicate"
"""The plugin's name (its entry point) and its key in ``manager.plugin_state``."""

MANAGER_OPTIONS: Mapping[str, Any] = {
    "replicate_to": None,
    "replicate_options": None,
    "remote_keep_last": None,
    "delete_unreplicated": False,
    "replicate_max_backlog": DEFAULT_MAX_BACKLOG,
    "replicate_hedge_after_s": DEFAULT_HEDGE_AFTER_S,
}
"""The ``CheckpointManager(...)`` options this plugin owns, with their defaults:

* ``replicate_to``: the remote root (``s3://bucket/run``, any fsspec URL); None: one tier;
* ``replicate_options``: fsspec options of the remote root (the local root's are
  ``storage_options``);
* ``remote_keep_last``: keep the newest N committed checkpoints on the remote root (None:
  keep every one);
* ``delete_unreplicated``: let local retention delete a checkpoint whose remote copy has
  not committed yet (default False: it is kept until it has);
* ``replicate_max_backlog``: checkpoints queued for the remote tier at most (default 16;
  None: no bound); beyond it the oldest queued one is dropped with a warning, stays local
  and is copied at the next start, so a frozen remote tier never grows the queue without
  bound;
* ``replicate_hedge_after_s``: seconds a file's upload may make no progress before a
  second attempt races it (a hedged copy; the first to finish is committed, the other
  abandoned and its temporary file removed); default 30; None or 0: never."""


def replicator_of(manager: ManagerView) -> Replicator | None:
    """The manager's :class:`Replicator`, or None without ``replicate_to``."""
    return manager.plugin_state.get(REPLICATE_PLUGIN)


def check_options(options: Mapping[str, Any]) -> None:
    """Validate the plugin's manager options (:data:`MANAGER_OPTIONS`).

    Args:
        options: the manager options (every declared name, given or default).

    Raises:
        InvalidOptionError: ``remote_keep_last`` or ``replicate_max_backlog`` is not a
            positive integer or None, ``replicate_hedge_after_s`` is not a finite number of
            seconds >= 0 or None, or a
            remote-tier option is given without ``replicate_to`` (naming the option).
    """
    backlog = options.get("replicate_max_backlog")
    if backlog is not None and (not isinstance(backlog, int) or isinstance(backlog, bool) or backlog < 1):
        raise InvalidOptionError(f"replicate_max_backlog must be a positive integer or None, got {backlog!r}")
    hedge = options.get("replicate_hedge_after_s")
    if hedge is not None and (not isinstance(hedge, (int, float)) or isinstance(hedge, bool) or not math.isfinite(hedge)
                              or hedge < 0):
        raise InvalidOptionError(
            f"replicate_hedge_after_s must be a finite number of seconds >= 0 or None (0 or None: no hedged copies), "
            f"got {hedge!r}"
        )
    keep = options.get("remote_keep_last")
    if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < 1):
        raise InvalidOptionError(f"remote_keep_last must be a positive integer or None, got {keep!r}")
    if options.get("replicate_to") is None:
        given = {
            "remote_keep_last": keep,
            "replicate_options": options.get("replicate_options") or None,  # {} from a config is fine
            "delete_unreplicated": options.get("delete_unreplicated") or None,  # False too
        }
        for name, value in given.items():
            if value is not None:
                raise InvalidOptionError(f"{name}={value!r} needs replicate_to= (the remote root); without it there is no remote tier")


class Replicate:
    """The plugin that copies a manager's checkpoints to ``replicate_to`` (see the module)."""

    STATEKIT_OPTIONS: frozenset[str] = frozenset()  # reads no checkpoint.options
    STATEKIT_MANAGER_OPTIONS: Mapping[str, Any] = MANAGER_OPTIONS
    STATEKIT_COPY_LISTING = CopyListing(frozenset({COPY_MARKER}), copied="replicated", state_field="replication")

    @hookimpl
    def statekit_manager_options(self, options: Mapping[str, Any]) -> None:
        """Validate ``replicate_to`` and its companions (every rank, before anything is created)."""
        check_options(options)

    @hookimpl
    def statekit_manager_start(self, manager: ManagerView) -> None:
        """Start the replicator and catch up (every rank; collectives with several)."""
        settings = manager.manager_options
        if settings["replicate_to"] is None:
            return
        owner = weakref.ref(manager)  # the replicator's thread must not keep the manager alive

        def on_replicated(name: str) -> None:
            live = owner()
            if live is not None:
                remote_retention(replicator_of(live), live.manager_options["remote_keep_last"], live.resumed_from,
                                 just_copied=name)

        rank, _ = rank_and_world_size()
        manager.plugin_state[REPLICATE_PLUGIN] = start_replication(
            settings["replicate_to"], settings["replicate_options"], manager.list, manager.url_of,
            on_replicated=on_replicated if rank == 0 else None, keep_last=settings["remote_keep_last"],
            max_backlog=settings["replicate_max_backlog"], hedge_after_s=settings["replicate_hedge_after_s"],
        )

    @hookimpl
    def statekit_checkpoint_committed(self, url: str, manager: ManagerView) -> None:
        """Queue the committed checkpoint (every rank; rank 0 shares the manifest)."""
        replicator = replicator_of(manager)
        if replicator is not None:
            replicator.submit_committed(url, manager.storage_options)

    @hookimpl
    def statekit_retention_keep(self, checkpoints: list[CheckpointDir], manager: ManagerView) -> set[str] | None:
        """Keep the local checkpoints without a committed remote copy."""
        replicator = replicator_of(manager)
        if replicator is None or manager.manager_options["delete_unreplicated"]:
            return None
        return unreplicated(replicator, checkpoints)

    @hookimpl
    def statekit_resume_roots(self, manager: ManagerView) -> list[Storage] | None:
        """Offer the remote root to ``resume()``."""
        replicator = replicator_of(manager)
        return None if replicator is None else [replicator.remote]

    @hookimpl
    def statekit_manager_wait(self, manager: ManagerView, timeout: float | None) -> None:
        """Wait for the copies; warn about each one not done."""
        replicator = replicator_of(manager)
        if replicator is not None:
            replicator.wait(timeout)


plugin = Replicate()
"""The registered plugin object (entry point ``replicate = "statekit_replicate.plugin:plugin"``)."""


def unreplicated(replicator: Replicator, local: list[CheckpointDir]) -> set[str]:
    """URLs of the ``local`` checkpoints not known to have a committed remote copy: local
    retention keeps these. Known from the replicator's own record, so a save never waits
    on the remote tier (which may be down or frozen)."""
    replicated = replicator.copied_names()
    return {i.url for i in local if i.name not in replicated}


def remote_retention(
    replicator: Replicator | None, keep_last: int | None, resumed_from: str | None, just_copied: str | None = None
) -> None:
    """Delete remote copies beyond the newest ``keep_last`` committed ones, never the one
    the run resumed from nor one being copied; a copy in use warns and is kept. Under
    branches (the remote's ``lineage.json``) only the live history counts, and abandoned
    copies go once the live branch has ``keep_last`` of its own, as local retention.
    Pretrained folders carried beside the copies (``.statekit-bases``) stay: ``statekit gc``
    of the remote root removes the ones no committed copy references.

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
    live, abandoned = retention_view(replicator.remote, committed, keep_last)  # as local retention, by the remote's lineage.json
    keep = {i.url for i in live[-keep_last:]} | abandoned | {resumed_from}
    copying = set(replicator.pending()) - {just_copied}  # the copy that just committed is still listed as pending
    keep |= {replicator.remote.url_of(name) for name in copying}
    delete_all_but(committed, keep, replicator.storage_options, "remote retention")
