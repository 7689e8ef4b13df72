"""Lineage of the checkpoints under a manager root (issue 38): which run and branch wrote
each checkpoint, which one is the live history, and what a rollback changes.

Every checkpoint a :class:`~statekit.CheckpointManager` saves records a typed
:class:`~statekit.format.Lineage` in its manifest: ``run_id``, ``branch`` (new at every
rollback and for a fresh run; a crash-resume continues the branch it resumed) and
``parent`` (the checkpoint it descends from).

A rollback (``resume(step=K)``) writes one small root file, ``lineage.json``
(:data:`STATE_NAME`), in one atomic write (:meth:`Storage.commit`) to the manager's root
and to every root a plugin offers to ``resume()`` (``statekit_resume_roots``):
the live branch and, for every branch it knows, the branch and step it forked from. The
live history is the live branch, then its parent branch up to the fork step, and so on:
a checkpoint is *live* when its branch is on that chain and its step is at most that
branch's fork step; every other one is *abandoned*. Without the file (no rollback ever
happened under the root) every checkpoint is live: the behaviour of a run without
rollbacks is unchanged. Of the copies of the file, the one with the highest ``seq`` wins.

Names: a save whose plain name (``checkpoint-<step>``) is held by an abandoned checkpoint
is named ``checkpoint-<step>.<branch>``; nothing is renamed or overwritten (object stores).

One manager's place in it (its run id, branch, parent, the fork its branch starts at, the
root file as it knows it) is a :class:`RunLineage`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from statekit import distributed, format as fmt
from statekit.engine import commit as commits
from statekit.errors import CheckpointNotFoundError, OtherRunWarning, StatekitError, warn_user
from statekit.format.manifest import read_manifest
from statekit.format.manifest_types import Lineage
from statekit.hooks.registry import call_each, get_plugin_manager
from statekit.manager.listing import CheckpointDir, checkpoint_name
from statekit.storage import Storage

if TYPE_CHECKING:
    from statekit.manager.resume_order import Candidate

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
    """What a tier's retention counts under branches (a tier plugin's count as the
    manager's ``keep_last``): the live history's checkpoints
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


def lineage_roots(manager: Any) -> list[Storage]:
    """Where the root file is written: the manager's root, then every root a plugin offers
    to ``resume()`` (``statekit_resume_roots``).

    Args:
        manager: the :class:`statekit.CheckpointManager` (its ``root``; the hook's argument).

    Returns:
        The roots, the manager's first.

    Raises:
        PluginError: a ``statekit_resume_roots`` implementation failed.
    """
    offered = call_each(get_plugin_manager(), "statekit_resume_roots", None, {"manager": manager})
    return [manager.root, *(root for _name, roots in offered for root in roots or [] if isinstance(root, Storage))]


@dataclasses.dataclass(frozen=True)
class Fork:
    """Where a branch starts: the checkpoint it forked from.

    Attributes:
        parent: that checkpoint's name.
        parent_branch: its branch.
        step: its step.
    """

    parent: str
    parent_branch: str
    step: int

    def branch(self, run_id: str | None) -> Branch:
        """The root file's record of the branch forked here, written by ``run_id``."""
        return Branch(run_id, self.parent, self.parent_branch, self.step)


class RunLineage:
    """One manager's run in the lineage: the run id and branch its saves record, the
    checkpoint the next save descends from, and the root file as the run knows it.

    A fresh run starts a new branch (and, without ``run_id``, a new run id); a resume
    (:meth:`continue_from`) takes them over from the checkpoint loaded, or starts a branch
    there on a rollback.

    Args:
        root: the manager's root (:class:`~statekit.storage.Storage`).
        step_digits: the manager's ``step_digits`` (how a step's folder is named).
        run_id: the ``run_id`` given to the manager (None: none).
        write_roots: returns every root the root file is written to, the manager's
            first (:func:`lineage_roots`); called only when the file is written.
    """

    def __init__(self, root: Storage, step_digits: int, run_id: str | None,
                 write_roots: Callable[[], list[Storage]]) -> None:
        self.root = root
        self.step_digits = step_digits
        self.given_run_id = run_id
        """The ``run_id`` given to the manager (None: none)."""
        self.run_id: str = run_id or new_id()
        """The run id the next save records."""
        self.branch: str = new_id()
        """The branch the next save records (a fresh run's; a resume replaces it)."""
        self.parent: str | None = None
        """The name of the checkpoint the next save descends from (None: none yet)."""
        self.fork: Fork | None = None
        """Where this run's branch forked, when it starts a branch of its own there."""
        self._write_roots = write_roots
        self._state: LineageState | None = None
        self._read = False  # whether _state is the root file as read (or written) by this run

    @property
    def state(self) -> LineageState | None:
        """The root file as this run last read or wrote it (None: no branches, or not read yet)."""
        return self._state

    def record(self) -> Lineage:
        """The :class:`~statekit.format.Lineage` the next save records."""
        return Lineage(run_id=self.run_id, branch=self.branch, parent=self.parent)

    def committed(self, url: str) -> None:
        """After a save of this run committed at ``url``: the next save descends from it."""
        self.parent = url.rstrip("/").rsplit("/", 1)[-1]

    def roots_of(self, candidates: list[Candidate]) -> list[Storage]:
        """The manager's root and the roots the resume candidates came from (the remote
        tier's), without asking the plugins again.

        Args:
            candidates: ``(CheckpointDir, storage_options)`` pairs (``resume_candidates``).

        Returns:
            The roots, the manager's first; one that cannot be opened is left out.
        """
        roots = [self.root]
        seen = {self.root.url}
        for info, options in candidates:
            parent = info.url.rstrip("/").rsplit("/", 1)[0]
            if parent not in seen:
                seen.add(parent)
                with contextlib.suppress(StatekitError):
                    roots.append(Storage(parent, options))
        return roots

    def read_root_file(self, candidates: list[Candidate]) -> LineageState | None:
        """The root file, as rank 0 reads it from the manager's root and the roots of
        ``candidates`` (:meth:`roots_of`), on every rank (a collective with several: a
        rank whose own root lacks the file, a node-local disk, follows rank 0's).

        Raises:
            StatekitError: the file is unreadable (on rank 0: naming it; elsewhere: naming rank 0).
        """
        rank, world = distributed.rank_and_world_size()
        if world == 1:
            return read_state(self.roots_of(candidates))
        return commits.agree(lambda: read_state(self.roots_of(candidates)) if rank == 0 else None,
                             self.root.url, broadcast=True)

    def url_on_branch(self, step: int) -> str:
        """The URL the next save of ``step`` writes: ``checkpoint-<step>``, or
        ``checkpoint-<step>.<branch>`` when an abandoned checkpoint holds the plain name.
        The first save of a run under a root with a lineage file makes the run's branch
        the live one (rank 0 writes the file).

        Args:
            step: the step saved.

        Returns:
            The checkpoint's URL under the manager's root.

        Raises:
            StatekitError: the root's lineage file is unreadable.
            StorageError: the lineage file could not be written.
        """
        rank, world = distributed.rank_and_world_size()
        if world == 1:
            return self.root.url_of(self._name_on_branch(step))
        # rank 0 decides (its root, its root file) and every rank follows: a rank with a
        # root of its own, or a fresh id of its own, would otherwise name another folder
        decided = commits.agree(
            lambda: (self._name_on_branch(step), self.run_id, self.branch, self.fork, self._state) if rank == 0 else None,
            self.root.url, broadcast=True)
        name, self.run_id, self.branch, self.fork, self._state = decided
        self._read = True
        return self.root.url_of(name)

    def _name_on_branch(self, step: int) -> str:
        """:meth:`url_on_branch`'s folder name, as this process sees the root."""
        if not self._read:
            self._state = read_state([self.root])
            self._read = True
        plain = checkpoint_name(step, self.step_digits)
        if self._state is None and self.given_run_id is None:
            return plain
        if self._state is not None and self._state.live != self.branch:  # a fresh run (or a resume before lineage)
            self._go_live(self._state)
        holder = self.root.child(checkpoint_name(step, self.step_digits))
        if not holder.exists(fmt.MANIFEST_NAME):
            return plain
        try:
            held = read_manifest(holder)
        except StatekitError:
            return plain  # damaged: the save reports it as today
        if self._state is None:  # no branches: only another named run's checkpoint makes way (other_runs="ignore")
            theirs = held.lineage.run_id if held.lineage is not None else None
            return plain if theirs == self.given_run_id else checkpoint_name(step, self.step_digits, short(self.branch))
        if is_live(self._state, CheckpointDir(step, holder.url, True, lineage=held.lineage)):
            return plain  # this branch's own step: saved again (CheckpointExistsError unless overwrite)
        return checkpoint_name(step, self.step_digits, short(self.branch))

    def _go_live(self, state: LineageState) -> None:
        """Make this run's branch the live one in the root file ``state`` (rank 0 writes it)."""
        branch = self.fork.branch(self.run_id) if self.fork is not None else Branch(self.run_id)
        state = LineageState(self.branch, {**state.branches, self.branch: branch}, state.seq + 1)
        if distributed.rank_and_world_size()[0] == 0:
            write_state(self._write_roots(), state)
        self._state = state  # only once written: a failed write is retried by the next save

    def live_candidates(self, candidates: list[Candidate], state: LineageState | None,
                        other_runs: str) -> list[Candidate]:
        """The candidates ``resume()`` tries: those of the live history and, with a given
        ``run_id``, as ``other_runs`` says.

        With ``run_id`` and ``other_runs="raise"``, a newest candidate of another run is
        refused only when this run has no live checkpoint of its own (resuming would
        continue the other run); when it has some, they are the candidates (a restart of a
        run that shares its root with another one) and an :class:`statekit.OtherRunWarning` names
        the newest checkpoint of the other run passed over.

        Args:
            candidates: every committed checkpoint, best first (``resume_candidates``).
            state: the root file (:func:`read_state` of :meth:`roots_of`), or None.
            other_runs: ``"raise"``, ``"ignore"`` or ``"resume"`` (``resume()``'s).

        Returns:
            The candidates, in ``candidates``' order.

        Raises:
            StatekitError: the live history holds no committed checkpoint while abandoned
                ones exist; or the newest live candidate is another run's, this run has
                no live checkpoint of its own and ``other_runs`` is ``"raise"``.
        """
        live = [c for c in candidates if is_live(state, c[0])]
        if state is not None and not live:
            self._refuse_empty_live_branch(state, [info for info, _ in candidates])
        if self.given_run_id is None or not live or other_runs == "resume":
            return live
        own = [c for c in live if run_of(c[0]) == self.given_run_id]
        if other_runs == "ignore" or run_of(live[0][0]) == self.given_run_id:
            return own if other_runs == "ignore" else live
        newest = live[0][0]
        theirs = run_of(newest)
        theirs_named = repr(theirs) if theirs is not None else "(unknown: written before lineage)"
        if not own:
            raise StatekitError(
                f"{self.root.url}: the newest checkpoint to resume, {newest.name}, belongs to run "
                f"{theirs_named}, not to this run {self.given_run_id!r}, which has no checkpoint of its own "
                f"here; resume(other_runs='resume') continues it, other_runs='ignore' starts run "
                f"{self.given_run_id!r} fresh beside it, or use another root")
        mine = own[0][0]
        newer = live[:live.index(own[0])]  # every one of them another run's
        more = f" ({len(newer)} newer checkpoints of other runs in all)" if len(newer) > 1 else ""
        warn_user(
            f"{self.root.url}: run {self.given_run_id!r} resumes its own newest checkpoint, {mine.name} (step "
            f"{mine.step}), not the newer {newest.name} (step {newest.step}) of run {theirs_named}{more}; "
            "resume(other_runs='resume') would continue that one, other_runs='ignore' resumes this run's "
            "own without this warning",
            OtherRunWarning,
        )
        return own

    def _refuse_empty_live_branch(self, state: LineageState, infos: list[CheckpointDir]) -> None:
        """Raise when statekit checkpoints exist but none is live (and the live branch is
        not a run's first branch, which starts fresh)."""
        if not any(i.kind == "statekit" for i in infos):
            return
        live = state.branches.get(state.live)
        if live is None or live.parent is not None:
            raise StatekitError(
                f"{self.root.url}: the live branch {short(state.live)} ({STATE_NAME}) has no "
                f"committed checkpoint left; abandoned: {', '.join(i.name for i in infos)}; roll back to one "
                "with resume(step=K)")

    def rollback_target(self, step: int, candidates: list[Candidate], state: LineageState | None) -> Candidate:
        """The checkpoint ``resume(step=K)`` loads: the live history's of that step, else
        the newest written of that step.

        Args:
            step: the step rolled back to.
            candidates: every committed checkpoint (``resume_candidates``).
            state: the root file, or None.

        Returns:
            The ``(CheckpointDir, storage_options)`` pair.

        Raises:
            CheckpointNotFoundError: no committed statekit checkpoint of ``step``.
        """
        same = [c for c in candidates if c[0].step == step and c[0].kind == "statekit"]
        if not same:
            steps = sorted({info.step for info, _ in candidates if info.committed})
            raise CheckpointNotFoundError(
                f"{self.root.url}: no committed checkpoint of step {step} to roll back to (committed steps: "
                f"{', '.join(map(str, steps)) or 'none'})")
        live = [c for c in same if is_live(state, c[0])]
        return (live or sorted(same, key=lambda c: c[0].created or "", reverse=True))[0]

    def continue_from(self, info: CheckpointDir, rollback: bool, infos: list[CheckpointDir],
                      state: LineageState | None) -> None:
        """After loading ``info``: the run's id, branch and parent; a rollback writes the
        lineage file (its new branch live) to every root first (rank 0).

        Args:
            info: the checkpoint loaded.
            rollback: whether it was loaded by ``resume(step=K)``.
            infos: every committed checkpoint listed (local and offered roots).
            state: the root file as read before the load, or None.

        Raises:
            StorageError: a rollback could not write the lineage file.
        """
        record = info.lineage
        self.run_id = self.given_run_id or (record.run_id if record is not None else None) or new_id()
        self.parent = info.name
        if rollback or record is None:
            self.branch = new_id()
            self.fork = Fork(info.name, branch_of(info), info.step)
        elif state is not None and branch_of(info) != state.live:
            self.branch, self.fork = state.live, None  # the live branch forked here and saved nothing yet
        else:
            self.branch = record.branch  # a crash-resume continues the branch
            self.fork = None
        if distributed.rank_and_world_size()[1] > 1:  # every rank takes rank 0's new ids
            self.run_id, self.branch = distributed.broadcast_from_rank0((self.run_id, self.branch))
        if rollback:
            branches = register(state, branch_of(info), infos)
            branches[self.branch] = self.fork.branch(self.run_id)
            state = LineageState(self.branch, branches, (state.seq if state is not None else 0) + 1)
            if distributed.rank_and_world_size()[0] == 0:
                write_state(self._write_roots(), state)
        self._state, self._read = state, True
