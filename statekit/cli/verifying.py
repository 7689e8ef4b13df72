"""``statekit verify``: every file's size and checksum against the manifest."""

from __future__ import annotations

import json
import sys

import click

from statekit.cli.output import emit, fail, human, storage_option, storage_options_of
from statekit.engine.read import verify as verify_checkpoint
from statekit.errors import StatekitError


@click.command()
@click.argument("url")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@storage_option
def verify(url: str, as_json: bool, raw_storage: tuple[str, ...]) -> None:
    """Check every file's size and checksum against the manifest; exit 1 naming the bad file."""
    try:
        manifest = verify_checkpoint(url, storage_options=storage_options_of(raw_storage))
    except StatekitError as exc:
        if as_json:
            click.echo(json.dumps({"ok": False, "url": url, "error": str(exc), "file": getattr(exc, "path", None)}))
            sys.exit(1)
        fail(exc)
    total = sum(f["size_bytes"] for f in manifest["files"].values())
    emit(as_json, {"ok": True, "url": url, "files": len(manifest["files"]), "size_bytes": total},
         f"ok: {len(manifest['files'])} files, {human(total)} verified ({url})")
