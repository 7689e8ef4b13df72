"""Lineage of the checkpoints under a manager root (issue 38): which run and branch wrote
each checkpoint, which one is the live history, and what a rollback changes.

Every checkpoint a :class:`~statekit.CheckpointManager` saves records a typed
:class:`~statekit.format.Lineage` in its manifest: ``run_id``, ``branch`` (new at every
rollback and for a fresh run; a crash-resume continues the branch it resumed) and
``parent`` (the checkpoint it descends from).

A rollback (``resume(step=K)``) writes one small root file, ``lineage.json``
(:data:`STATE_NAME`), in one atomic write (:meth:`Storage.commit`) to the manager's root
and to every root a plugin offers to ``resume()`` (the remote tier of ``replicate_to``):
the live branch and, for every branch it knows, the branch and step it forked from. The
live history is the live branch, then its parent branch up to the fork step, and so on:
a checkpoint is *live* when its branch is on that chain and its step is at most that
branch's fork step; every other one is *abandoned*. Without the file (no rollback ever
happened under the root) every checkpoint is live: the behaviour of a run without
rollbacks is unchanged. Of the copies of the file, the one with the highest ``seq`` wins.

Names: a save whose plain name (``checkpoint-<step>``) is held by an abandoned checkpoint
is named ``checkpoint-<step>.<branch>``; nothing is renamed or overwritten (object stores).
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any

from statekit.errors import StatekitError
from statekit.storage import Storage

STATE_NAME = "lineage.json"
"""The root file a rollback writes (the live branch and every branch's fork point)."""
STATE_FORMAT = "statekit-lineage/1"
LEGACY = ""
"""The branch of checkpoints written before lineage existed (no ``lineage`` field)."""


def new_id() -> str:
    """A new run or branch id (``uuid4().hex``, 32 hex digits)."""
    return uuid.uuid4().hex


def short(branch: str) -> str:
    """The name suffix of a branch: its first 8 characters."""
    return branch[:8] or "legacy"


@dataclasses.dataclass(frozen=True)
class Branch:
    """One branch as the root file records it.

    Attributes:
        run_id: the run that writes it (None: unknown, a checkpoint without lineage).
        parent: the checkpoint it forked from (its name), or None (a run's first branch).
        parent_branch: the branch of ``parent``, or None.
        fork_step: the step of ``parent``, or None.
    """

    run_id: str | None
    parent: str | None = None
    parent_branch: str | None = None
    fork_step: int | None = None


@dataclasses.dataclass(frozen=True)
class LineageState:
    """The root file ``lineage.json``: the live branch and every known branch.

    Attributes:
        live: the live branch's id.
        branches: branch id -> :class:`Branch`.
        seq: incremented at every write; of several roots' copies the highest wins.
    """

    live: str
    branches: dict[str, Branch]
    seq: int = 0

    def to_bytes(self) -> bytes:
        """The file's bytes (JSON)."""
        body = {"format": STATE_FORMAT, "seq": self.seq, "live": self.live,
                "branches": {b: dataclasses.asdict(v) for b, v in self.branches.items()}}
        return json.dumps(body, indent=1).encode("utf-8")

    @classmethod
    def from_bytes(cls, data: bytes, source: str) -> LineageState:
        """Parse the file.

        Args:
            data: its bytes.
            source: its URL, named in errors.

        Returns:
            The state.

        Raises:
            StatekitError: not a lineage file of this format (a resume must not guess).
        """
        try:
            body = json.loads(data.decode("utf-8"))
            if body.get("format") != STATE_FORMAT:
                raise ValueError(f"format {body.get('format')!r}")
            branches = {str(b): Branch(**v) for b, v in body["branches"].items()}
            return cls(live=str(body["live"]), branches=branches, seq=int(body["seq"]))
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
            raise StatekitError(f"{source}: the lineage file is unreadable ({exc}); resume(step=K) rewrites it") from None

    def segments(self) -> dict[str, int | None]:
        """The live history: branch -> the highest step of it that is live (None: all)."""
        out: dict[str, int | None] = {}
        branch: str | None = self.live
        until: int | None = None
        while branch is not None and branch not in out:
            out[branch] = until
            info = self.branches.get(branch)
            if info is None:
                break
            branch, until = info.parent_branch, info.fork_step
        return out


def branch_of(info: Any) -> str:
    """The branch of a listed checkpoint (:class:`CheckpointDir`); :data:`LEGACY` without lineage."""
    return info.lineage.branch if info.lineage is not None else LEGACY


def run_of(info: Any) -> str | None:
    """The run id of a listed checkpoint, or None (written before lineage existed)."""
    return info.lineage.run_id if info.lineage is not None else None


def is_live(state: LineageState | None, info: Any) -> bool:
    """Whether a listed checkpoint is on the live history (always, without a root file).

    Args:
        state: the root file, or None.
        info: a :class:`CheckpointDir`.

    Returns:
        True when live.
    """
    if state is None:
        return True
    segments = state.segments()
    branch = branch_of(info)
    if branch not in segments:
        return False
    until = segments[branch]
    return until is None or info.step <= until


def read_state(roots: list[Storage]) -> LineageState | None:
    """The root file with the highest ``seq`` among ``roots`` (the manager's root and the
    roots plugins offer), or None when none holds one.

    Args:
        roots: the roots.

    Returns:
        The state, or None.

    Raises:
        StatekitError: a copy of the file is unreadable.
    """
    best: LineageState | None = None
    for root in roots:
        try:
            if not root.exists(STATE_NAME):
                continue
            data = root.read_bytes(STATE_NAME)
        except (OSError, StatekitError):
            continue  # an unreachable remote root: the others decide
        state = LineageState.from_bytes(data, root.url_of(STATE_NAME))
        if best is None or state.seq > best.seq:
            best = state
    return best


def write_state(roots: list[Storage], state: LineageState) -> None:
    """Write the root file to every root, each in one atomic write.

    Args:
        roots: the manager's root first, then the offered roots.
        state: what to write.

    Raises:
        StorageError: a root could not be written (the rollback fails loudly).
    """
    data = state.to_bytes()
    for root in roots:
        root.commit(STATE_NAME, data, exclusive=False)


def register(state: LineageState | None, branch: str, infos: list[Any]) -> dict[str, Branch]:
    """``state``'s branches plus ``branch`` and its ancestors, derived from the manifests'
    parent links where the file does not know them yet (the branch a first rollback
    leaves, or a run started before it).

    Args:
        state: the current root file, or None.
        branch: the branch to add.
        infos: every committed checkpoint listed (local and offered roots).

    Returns:
        The branches.
    """
    branches = dict(state.branches) if state is not None else {}
    by_name = {i.name: i for i in infos}
    while branch not in branches:
        own = sorted((i for i in infos if branch_of(i) == branch), key=lambda i: i.step)
        first = own[0] if own else None
        parent = by_name.get(first.lineage.parent) if first is not None and first.lineage is not None and first.lineage.parent else None
        run = run_of(first) if first is not None else None
        if parent is None:
            branches[branch] = Branch(run)
            break
        branches[branch] = Branch(run, parent.name, branch_of(parent), parent.step)
        branch = branch_of(parent)
    return branches


def abandoned_to_delete(state: LineageState | None, committed: list[Any], after: int) -> set[str]:
    """Retention under branches: the URLs of the abandoned checkpoints to delete now. An
    abandoned checkpoint counts for nothing in the policies; it is deleted once the live
    branch holds ``after`` committed checkpoints of its own (saved since its fork).

    Args:
        state: the root file (None: nothing is abandoned).
        committed: the committed checkpoints.
        after: the count (``keep_last``, or 1).

    Returns:
        URLs to delete.
    """
    if state is None:
        return set()
    own = [i for i in committed if branch_of(i) == state.live]
    if len(own) < after:
        return set()
    return {i.url for i in committed if not is_live(state, i)}


def retention_view(root: Storage, committed: list[Any], keep_last: int | None) -> tuple[list[Any], set[str]]:
    """What a tier's retention counts under branches (the remote tier's
    ``remote_keep_last`` as the manager's ``keep_last``): the live history's checkpoints
    and the abandoned ones still kept, by ``root``'s own lineage file.

    Args:
        root: the tier's root (its ``lineage.json``, if any).
        committed: its committed checkpoints (:class:`CheckpointDir`, lineage read).
        keep_last: the tier's count (None: 1 for the abandoned ones' grace).

    Returns:
        ``(live, kept_abandoned_urls)``: ``live`` in ``committed``'s order; without a
        lineage file, every checkpoint and nothing else.

    Raises:
        StatekitError: the lineage file is unreadable.
    """
    state = read_state([root])
    live = [i for i in committed if is_live(state, i)]
    abandoned = {i.url for i in committed if not is_live(state, i)}
    return live, abandoned - abandoned_to_delete(state, committed, keep_last or 1)
