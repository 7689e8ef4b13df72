"""``statekit ls`` and ``statekit gc``: the checkpoints under a manager root URL."""

from __future__ import annotations

import click

from statekit.api.manager import delete_checkpoint, list_checkpoints
from statekit.cli.output import console, emit, fail, human, rich_table, storage_option, storage_options_of
from statekit.errors import CheckpointInUseError, StatekitError
from statekit.storage.inuse import refuse_if_in_use


@click.command()
@click.argument("url")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@storage_option
def ls(url: str, as_json: bool, raw_storage: tuple[str, ...]) -> None:
    """List the checkpoints under a manager root URL: step, time, size, committed."""
    try:
        infos = list_checkpoints(url, storage_options_of(raw_storage))
    except StatekitError as exc:
        fail(exc)
    payload = [i.__dict__ for i in infos]
    if as_json:
        emit(True, payload, "")
        return
    if not infos:
        click.echo(f"no checkpoints under {url}")
        return
    rows = [[str(i.step), i.created or "-", human(i.size_bytes), "yes" if i.committed else "NO (incomplete)",
             ", ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in (i.metrics or {}).items()) or "-",
             i.url] for i in infos]
    console().print(rich_table(rows, ["step", "created", "size", "committed", "metrics", "url"],
                               title=f"{len(infos)} checkpoints under {url}", right=(0, 2)))


@click.command()
@click.argument("url")
@click.option("--dry-run", is_flag=True, help="Only list what would be removed.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@storage_option
def gc(url: str, dry_run: bool, as_json: bool, raw_storage: tuple[str, ...]) -> None:
    """Remove incomplete checkpoints (directories without a manifest) under a manager root."""
    removed, kept = [], []
    try:
        storage_options = storage_options_of(raw_storage)
        for info in list_checkpoints(url, storage_options, details=False):
            if info.committed:
                continue
            try:
                if not dry_run:
                    delete_checkpoint(info.url, storage_options)
                else:
                    refuse_if_in_use(info.url, "delete")
                removed.append(info.url)
            except CheckpointInUseError as exc:
                kept.append({"url": info.url, "reason": str(exc)})
    except StatekitError as exc:
        fail(exc)
    verb = "would remove" if dry_run else "removed"
    lines = [f"{verb} {u}" for u in removed] + [f"kept {k['url']} (in use)" for k in kept]
    emit(as_json, {"dry_run": dry_run, "removed": removed, "kept": kept}, "\n".join(lines) or "nothing to remove")
