"""The checkpoints ``CheckpointManager.resume()`` tries, in order: those under the
manager's root and under every root a plugin offers (``statekit_resume_roots``: a
tier plugin offers its root).

Order: newest step first; for one step the manager's own root first, then the offered
roots in the order offered, and in one root the checkpoint committed last first (two
runs' or branches' checkpoints of one step, ``checkpoint-<step>`` and
``checkpoint-<step>.<branch>``: the one the root's ``latest`` hint names, else the newer
``created``). With several ranks rank 0 decides for all, and a checkpoint
under the manager's root is a candidate only where every rank's own root holds it
committed (roots may be node-local disks: a checkpoint saved across nodes is then
resumed from another root, or not at all). The first candidate that loads is resumed;
a damaged one is passed over (:func:`load_first`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from statekit import distributed, format as fmt
from statekit.manager.listing import LATEST_NAME, CheckpointDir, list_checkpoints
from statekit.engine import commit as commits
from statekit.errors import (
    PickleNotAllowedError,
    PluginError,
    ResumeMismatchError,
    StatekitError,
    StatekitWarning,
    StateMismatchError,
    BaseReferenceError,
    warn_user,
)
from statekit.hooks.registry import call_each, get_plugin_manager
from statekit.storage import Storage

Candidate = tuple[CheckpointDir, "dict[str, Any] | None"]
"""A committed checkpoint and the fsspec options to read it with."""


def resume_candidates(manager: Any) -> list[Candidate]:
    """Every committed checkpoint ``manager.resume()`` may load, best first (every rank
    calls it when ``world_size > 1``: a collective).

    Args:
        manager: the :class:`statekit.CheckpointManager`.

    Returns:
        ``(CheckpointDir, storage_options)`` pairs; those under the manager's root point
        at this rank's own root.

    Raises:
        PluginError: a ``statekit_resume_roots`` implementation failed (on every rank).
        StorageError: the manager's root cannot be listed.
    """
    rank, world = distributed.rank_and_world_size()
    local = [i for i in manager.list() if i.committed]
    everywhere = distributed.gather_to_rank0({i.name for i in local}) if world > 1 else None

    def decide() -> list[tuple[CheckpointDir, int, dict[str, Any] | None]]:
        shared = local if everywhere is None else [i for i in local if i.name in set.intersection(*everywhere)]
        offered = call_each(get_plugin_manager(), "statekit_resume_roots", None, {"manager": manager})
        return _ordered(shared, manager.storage_options, [root for name, roots in offered for root in _roots(name, roots)],
                        _latest_name(manager.root))

    if world == 1:
        ordered = decide()
    else:
        ordered = commits.agree(lambda: decide() if rank == 0 else None, manager.root_url, broadcast=True)
    return [
        (dataclasses.replace(info, url=manager.root.url_of(info.name)), manager.storage_options) if tier == 0
        else (info, options)
        for info, tier, options in ordered
    ]


def _roots(plugin: str, offered: Any) -> list[Storage]:
    """A ``statekit_resume_roots`` result, checked: a list of :class:`Storage`, or None."""
    roots = [] if offered is None else offered
    if not isinstance(roots, (list, tuple)) or not all(isinstance(root, Storage) for root in roots):
        raise PluginError(
            f"plugin {plugin!r}: statekit_resume_roots must return a list of Storage, got {offered!r}",
            plugin_name=plugin,
            hook_name="statekit_resume_roots",
        )
    return list(roots)


def _latest_name(root: Storage) -> str | None:
    """The folder the root's ``latest`` hint names (the checkpoint committed last), or None."""
    try:
        return root.read_bytes(LATEST_NAME).decode("ascii").strip() or None
    except (StatekitError, OSError, UnicodeDecodeError):
        return None


def _ordered(
    local: list[CheckpointDir], local_options: dict[str, Any] | None, roots: list[Storage], latest: str | None = None,
) -> list[tuple[CheckpointDir, int, dict[str, Any] | None]]:
    """``(info, tier, storage_options)``, best first; tier 0 is the manager's root, tier k
    the k-th root offered; in one root, of one step, the checkpoint the ``latest`` hint
    names, then the one committed last."""
    tiers = [(i, 0, local_options) for i in local]
    newest = local[-1] if local else None
    for k, root in enumerate(roots, start=1):
        options = root.storage_options
        try:
            infos = [i for i in list_checkpoints(root) if i.committed and not i.accelerate]
        except StatekitError as exc:
            warn_user(f"cannot list {root.url} ({exc}); resuming without it", StatekitWarning)
            continue
        for twin in infos:
            if newest is not None and twin.name == newest.name and not _same_manifest(
                Storage(newest.url, local_options), Storage(twin.url, options)
            ):
                warn_user(f"{newest.url} and {twin.url} hold step {newest.step} with different manifests; "
                          "using the local one", StatekitWarning)
        tiers += [(i, k, options) for i in infos]
    tiers.sort(key=lambda it: it[0].created or "", reverse=True)  # one step of two runs or branches: the newer first
    return sorted(tiers, key=lambda it: (-it[0].step, it[1], not (it[1] == 0 and it[0].name == latest)))


def _same_manifest(a: Storage, b: Storage) -> bool:
    try:
        return a.read_bytes(fmt.MANIFEST_NAME) == b.read_bytes(fmt.MANIFEST_NAME)
    except (StatekitError, OSError):
        return True  # unreadable: loading it will say what is wrong


def load_first(candidates: list[Candidate], skip: Callable[[CheckpointDir, StatekitError], None],
               load: Callable[[str, dict[str, Any] | None], Any]) -> tuple[CheckpointDir, Any] | None:
    """Load the first of ``candidates`` that loads cleanly, passing over each one that is
    damaged or an incomplete Accelerate folder (:func:`skippable`).

    Args:
        candidates: in the order to try (:func:`resume_candidates`).
        skip: called with each checkpoint passed over and its error (the manager warns).
        load: ``load(url, storage_options)``, returning the manifest loaded.

    Returns:
        The checkpoint loaded and its manifest; None when there is no candidate.

    Raises:
        StatekitError: every candidate failed (the last one's error); or a failure that is
            the run's, not the checkpoint's.
    """
    last_error: StatekitError | None = None
    for info, options in candidates:
        try:
            return info, load(info.url, options)
        except StatekitError as exc:
            if not skippable(info, exc):
                raise
            skip(info, exc)
            last_error = exc
    if last_error is not None:
        raise last_error
    return None


def skippable(info: CheckpointDir, exc: StatekitError) -> bool:
    """Whether ``resume()`` passes over ``info`` after ``exc`` and tries the previous
    checkpoint: a damaged checkpoint is passed over; an error of the run's settings is
    raised (an older checkpoint fits no better), and so is a state mismatch, unless it is
    an Accelerate folder missing keys only (an interrupted Accelerate save looks like that),
    and a referenced frozen base that is gone or changed (resuming an older checkpoint
    would drop the run's progress for a fault of the folder's)."""
    if isinstance(exc, (PickleNotAllowedError, ResumeMismatchError, BaseReferenceError)):
        return False  # (a moved or edited frozen base: the older checkpoints reference it too)
    if isinstance(exc, StateMismatchError):
        return info.accelerate and bool(exc.missing) and not exc.mismatched
    return True
