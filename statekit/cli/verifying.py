"""``statekit verify``: every file's size and checksum against the manifest."""

from __future__ import annotations

import json
import sys

import click

from statekit.cli.output import emit, fail, human, storage_option, storage_options_of
from statekit.engine.read import verify as verify_checkpoint
from statekit.errors import IncompleteCheckpointError, StatekitError, StorageError
from statekit.foreign import detect_format


@click.command()
@click.argument("url")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@storage_option
def verify(url: str, as_json: bool, raw_storage: tuple[str, ...]) -> None:
    """Check every file's size and checksum against the manifest; exit 1 naming the bad file."""
    try:
        try:
            manifest = verify_checkpoint(url, storage_options=storage_options_of(raw_storage))
        except (IncompleteCheckpointError, StorageError) as exc:
            raise _explained(url, storage_options_of(raw_storage)) or exc from None
    except StatekitError as exc:
        if as_json:
            click.echo(json.dumps({"ok": False, "url": url, "error": str(exc), "file": getattr(exc, "path", None)}))
            sys.exit(1)
        fail(exc)
    total = manifest.size_bytes
    emit(as_json, {"ok": True, "url": url, "files": len(manifest.files), "size_bytes": total},
         f"ok: {len(manifest.files)} files, {human(total)} verified ({url})")


def _explained(url: str, storage_options: dict | None) -> StatekitError | None:
    """Why a location without a readable manifest is not a statekit checkpoint, when it is
    something else: a manager root, an Accelerate/DCP directory, a single file (None when
    it really is an uncommitted statekit save, whose error is already right)."""
    try:
        found = detect_format(url, storage_options)
    except IncompleteCheckpointError:
        return None
    except StatekitError as exc:  # a checkpoint root, or not a checkpoint at all
        return exc
    return StatekitError(
        f"{url} is not a statekit checkpoint (its format is {found!r}): verify checks a statekit checkpoint against its "
        "manifest (show this one with `statekit inspect`" + (", or convert it with `statekit convert`" if found == "accelerate" else "") + ")"
    )
