"""``statekit ls`` and ``statekit gc``: the checkpoints under a manager root URL."""

from __future__ import annotations

from typing import Any

import click

from statekit.manager import lineage
from statekit.manager.bases import carried_bases
from statekit.manager.listing import delete_checkpoint, list_checkpoints
from statekit.cli.output import console, emit, fail, human, rich_table, storage_option, storage_options_of
from statekit.engine.locking import live_save_lock, remove_owned
from statekit.errors import CheckpointInUseError, CheckpointNotFoundError, StatekitError
from statekit.foreign.detect import describe_folder
from statekit.format import MANIFEST_NAME
from statekit.storage import Storage
from statekit.hooks.registry import CopyListing, get_plugin_manager
from statekit.storage.inuse import in_use_markers, refuse_if_in_use


@click.command()
@click.argument("url")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--replica", default=None, metavar="URL",
              help="The other root a tier plugin copies this root's checkpoints to: show each checkpoint's tiers.")
@click.option("--replica-option", "raw_replica", multiple=True, metavar="KEY=VALUE",
              help="fsspec storage option for --replica (as --storage-option); repeatable.")
@click.option("--tree", is_flag=True,
              help="Show the branches (lineage): each branch, the checkpoint it forked from, its checkpoints; the live one marked.")
@storage_option
def ls(url: str, as_json: bool, replica: str | None, raw_replica: tuple[str, ...], raw_storage: tuple[str, ...],
       tree: bool) -> None:
    """List the checkpoints under a manager root URL: step, time, size, the bytes its save
    wrote (less than its size when an incremental save reused unchanged files), committed
    (and with --replica, on which tiers each one is committed). A folder statekit did not
    write (a Trainer, Accelerate or DCP checkpoint) is listed as what it is. With --tree:
    the branches a rollback (``resume(step=K)``) made, parent links, the live branch marked."""
    infos, remote = _read_roots(url, storage_options_of(raw_storage), replica, storage_options_of(raw_replica))
    if tree:
        try:
            state = lineage.read_state([Storage(url, storage_options_of(raw_storage))])
        except StatekitError as exc:
            fail(exc)
        text = _tree_text([i for i in infos if i.committed and i.kind == "statekit"], state)
        emit(as_json, {"live": state.live if state else None, "lines": text.splitlines()}, text)
        return
    payload = [_entry(i) for i in infos] if remote is None else _with_tiers(infos, remote)
    if as_json:
        emit(True, payload, "")
    elif not payload:
        click.echo(f"no checkpoints under {url}" + (f" or {replica}" if replica else ""))
    else:
        _print_table(payload, url, tiers=remote is not None)


def _read_roots(url: str, options: dict[str, Any] | None, replica: str | None,
                replica_options: dict[str, Any] | None) -> tuple[list[Any], list[Any] | None]:
    """The checkpoints of the root (and of the replica root, None without one); exits 1 on
    an error or on an empty listing of something that is not a root."""
    try:
        infos = list_checkpoints(url, options)
        remote = list_checkpoints(replica, replica_options) if replica else None
        if not infos and not remote:
            _refuse_if_not_a_root(Storage(url, options))
    except StatekitError as exc:
        fail(exc)
    return infos, remote


def _print_table(payload: list[dict[str, Any]], url: str, tiers: bool) -> None:
    """``ls``'s table: one row per listed checkpoint (and its tiers column with --replica)."""
    words = get_plugin_manager().copy_listing()
    rows = [[str(p["step"]), p["created"] or "-", human(p["size_bytes"]), human(p.get("written_bytes")),
             _committed_text(p), _metrics_text(p["metrics"]),
             *([_tier_text(p, words)] if tiers else []), _audit_text(p.get("resume_audit")), p["url"]] for p in payload]
    columns = ["step", "created", "size", "written", "committed", "metrics", *(["tiers"] if tiers else []), "resume", "url"]
    console().print(rich_table(rows, columns, title=f"{len(payload)} checkpoints under {url}", right=(0, 2, 3)))


def _metrics_text(metrics: dict[str, Any] | None) -> str:
    """The ``metrics`` column: ``key=value`` pairs (floats to 6 significant digits), or ``-``."""
    return ", ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in (metrics or {}).items()) or "-"


def _entry(info: Any) -> dict[str, Any]:
    """A listed :class:`~statekit.CheckpointDir` as JSON: its fields and ``description`` (its kind in words)."""
    return {**info.__dict__, "lineage": info.lineage.to_json() if info.lineage is not None else None,
            "description": info.description}


def _tree_text(committed: list[Any], state: Any) -> str:
    """``ls --tree``: one block per branch (oldest first), the checkpoint it forked from,
    its checkpoints indented under it; ``*`` marks a live checkpoint, ``(live)`` the live
    branch, ``abandoned`` a checkpoint no resume takes (``docs/cli.md``)."""
    by_name = {i.name: i for i in committed}
    lines = []
    for branch, own in _by_branch(committed, state):
        lines.append(_branch_head(branch, own, state, by_name))
        for info in own:
            live = lineage.is_live(state, info)
            lines.append(f"  {'*' if live and state is not None else ' '} {info.name}  step {info.step}"
                         + ("" if live else "  abandoned"))
        if not own:
            lines.append("    (no checkpoint yet)")
    if state is None:
        lines.append("(no rollback under this root: every checkpoint is on the live history)")
    return "\n".join(lines)


def _by_branch(committed: list[Any], state: Any) -> list[tuple[str, list[Any]]]:
    """The branches, each with its checkpoints by step, in the lineage file's order (unknown first)."""
    by_branch: dict[str, list[Any]] = {}
    for info in committed:
        by_branch.setdefault(lineage.branch_of(info), []).append(info)
    if state is not None:
        for branch in lineage.LineageState.segments(state):
            by_branch.setdefault(branch, [])
    for own in by_branch.values():
        own.sort(key=lambda i: i.step)
    created = {branch: n for n, branch in enumerate(state.branches)} if state is not None else {}  # file order: creation
    return sorted(by_branch.items(),
                  key=lambda kv: (created.get(kv[0], -1), min((i.step for i in kv[1]), default=1 << 62)))


def _branch_head(branch: str, own: list[Any], state: Any, by_name: dict[str, Any]) -> str:
    """``branch <id> (run <id>), forked from <checkpoint> (live)``: the run and the fork from
    the lineage file, else from the branch's first checkpoint."""
    known = state.branches.get(branch) if state is not None else None
    first = own[0] if own else None
    parent = known.parent if known is not None else (first.lineage.parent if first is not None and first.lineage else None)
    run = known.run_id if known is not None and known.run_id else (lineage.run_of(first) if first is not None else None)
    head = f"branch {lineage.short(branch)}" + (f" (run {run})" if run else "")
    if parent and not (parent in by_name and lineage.branch_of(by_name[parent]) == branch):
        head += f", forked from {parent}"
    if state is not None and branch == state.live:
        head += " (live)"
    return head


def _committed_text(entry: dict[str, Any]) -> str:
    """The ``committed`` column: ``yes``, ``NO (incomplete)`` for statekit's uncommitted save,
    or what a folder statekit did not write is (``no: a transformers Trainer checkpoint ...``)."""
    if entry["committed"]:
        return "yes"
    if entry["kind"] == "incomplete":
        return "NO (incomplete)"
    return f"no: {entry['description']} (not written by statekit)"


def _audit_text(resume_audit: dict[str, Any] | None) -> str:
    """The ``resume`` column: ``-`` (the run did not resume before this checkpoint), else the
    resume audit's verdict and the step resumed from (``verified (from 140)``), and the state
    check's when it was not verified (``verified (from 140), state mismatch``)."""
    if not resume_audit:
        return "-"
    step = (resume_audit.get("resumed_from") or {}).get("step")
    text = f"{resume_audit.get('verdict')} (from {step if step is not None else '?'})"
    state = (resume_audit.get("state") or {}).get("verdict")
    return text if state in (None, "verified") else f"{text}, state {state}"


def _refuse_if_not_a_root(root: Storage) -> None:
    """An empty listing is an answer only for a root that exists: a typo in the path or the
    bucket, or a checkpoint given instead of its root, is an error (exit 1), not "no checkpoints"."""
    if not root.exists():
        raise CheckpointNotFoundError(f"no such checkpoint root: {root.url} does not exist")
    if MANIFEST_NAME in root.listdir():
        raise StatekitError(f"{root.url} is a checkpoint, not a checkpoint root: show it with `statekit inspect`")


def _with_tiers(local: list[Any], remote: list[Any]) -> list[dict[str, Any]]:
    """One entry per checkpoint name on either root, with ``tiers``, ``urls`` and its copy state."""
    words = get_plugin_manager().copy_listing()
    by_name: dict[str, dict[str, Any]] = {}
    for tier, infos in (("local", local), ("remote", remote)):
        for info in infos:
            entry = by_name.setdefault(info.name, {**_entry(info), "tiers": [], "urls": {}})
            entry["urls"][tier] = info.url
            if info.committed:
                entry["tiers"].append(tier)
                entry["committed"] = True
    for entry in by_name.values():
        local_url = entry["urls"].get("local")
        entry[words.copied] = "remote" in entry["tiers"]
        if entry[words.copied]:
            entry[words.state_field] = words.copied
        elif local_url and any(m.by in words.markers for m in in_use_markers(local_url)):
            entry[words.state_field] = "copying"
        else:
            entry[words.state_field] = "incomplete" if "remote" in entry["urls"] else f"not {words.copied}"
    return sorted(by_name.values(), key=lambda e: e["step"])


def _tier_text(entry: dict[str, Any], words: CopyListing) -> str:
    """The ``tiers`` column: ``local + remote``, ``remote``, or ``local (<its copy state>)``."""
    if entry["tiers"] != ["local"]:
        return " + ".join(entry["tiers"]) or "-"
    state = entry[words.state_field]
    return {"copying": "local (copying to remote)", "incomplete": "local (remote copy incomplete)"}.get(
        state, f"local ({state})")


@click.command()
@click.argument("url")
@click.option("--dry-run", is_flag=True, help="Only list what would be removed.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@storage_option
def gc(url: str, dry_run: bool, as_json: bool, raw_storage: tuple[str, ...]) -> None:
    """Remove incomplete statekit saves (statekit's save lock, no manifest) under a manager
    root, and the copies of pretrained folders a replica tier carried there
    (``.statekit-bases/<base_id>``) that no committed checkpoint references any more;
    folders statekit did not write (a Trainer, Accelerate or DCP checkpoint, other
    contents) are kept and named (a root that does not exist, or a checkpoint given instead
    of its root, is an error, exit 1)."""
    removed, kept = [], []
    try:
        storage_options = storage_options_of(raw_storage)
        infos = list_checkpoints(url, storage_options, details=False)
        if not infos:  # as ls: a root that does not exist (a typo) or a checkpoint is an error
            _refuse_if_not_a_root(Storage(url, storage_options))
        for info in infos:
            if info.committed:
                continue
            if info.kind != "incomplete":  # nothing proves statekit wrote it: never deleted
                what = describe_folder(Storage(info.url, storage_options), info.kind)
                kept.append({"url": info.url, "reason": f"{what}, not written by statekit", "kind": info.kind})
                continue
            holder = live_save_lock(Storage(info.url, storage_options))
            if holder is not None:  # a save in progress, not an abandoned one: deleting it would break it
                kept.append({"url": info.url, "reason": f"being saved by {holder.get('host')} pid {holder.get('pid')}",
                             "kind": info.kind})
                continue
            try:
                if not dry_run:
                    delete_checkpoint(info.url, storage_options)
                else:
                    refuse_if_in_use(info.url, "delete")
                removed.append(info.url)
            except CheckpointInUseError as exc:
                kept.append({"url": info.url, "reason": str(exc), "kind": info.kind})
        for base in carried_bases(Storage(url, storage_options), infos):
            if not base.removable:
                kept.append({"url": base.url, "reason": base.reason, "kind": "carried base"})
                continue
            if not dry_run:
                remove_owned(Storage(base.url, storage_options))
            removed.append(base.url)
    except StatekitError as exc:
        fail(exc)
    verb = "would remove" if dry_run else "removed"
    lines = [f"{verb} {u}" for u in removed] + [f"kept {k['url']} ({k['reason']})" for k in kept]
    emit(as_json, {"dry_run": dry_run, "removed": removed, "kept": kept}, "\n".join(lines) or "nothing to remove")
