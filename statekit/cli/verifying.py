"""``statekit verify``: every file's size and checksum against the manifest; for a
checkpoint of another format, what can be checked without a manifest (exit 3)."""

from __future__ import annotations

import json
import sys

import click

from statekit.cli.output import console, emit, fail, human, rich_table, storage_option, storage_options_of
from statekit.engine.read import verify as verify_checkpoint
from statekit.errors import IncompleteCheckpointError, StatekitError, StorageError
from statekit.storage import Storage
from statekit.foreign.detect import Survey, detect_format, survey

NOT_VERIFIED = 3
"""Exit code of ``verify`` for a checkpoint of another format whose checks passed: it has
no checksums, so nothing was verified (0 would tell a script it was); 1 stays a problem."""


@click.command()
@click.argument("url")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@storage_option
def verify(url: str, as_json: bool, raw_storage: tuple[str, ...]) -> None:
    """Check every file's size and checksum against the manifest; exit 1 naming the bad file.

    A checkpoint of another format (a Trainer, Accelerate or DCP folder, a safetensors or
    torch file) has no checksums: its files are listed with sizes and its model files'
    headers checked without unpickling, and the exit code is 3 (not verified), or 1 if a
    check failed.
    """
    options = storage_options_of(raw_storage)
    report = None
    try:
        try:
            manifest = verify_checkpoint(url, storage_options=options)
        except (IncompleteCheckpointError, StorageError) as exc:
            report = _not_statekit(Storage(url, options))
            if not isinstance(report, Survey):
                raise report or exc from None
    except StatekitError as exc:
        if as_json:
            click.echo(json.dumps({"ok": False, "url": url, "error": str(exc), "file": getattr(exc, "path", None)}))
            sys.exit(1)
        fail(exc)
    if report is not None:
        _show_survey(report, as_json)
        return
    total = manifest.size_bytes
    emit(as_json, {"ok": True, "url": url, "files": len(manifest.files), "size_bytes": total},
         f"ok: {len(manifest.files)} files, {human(total)} verified ({url})")


def _not_statekit(location: Storage) -> Survey | StatekitError | None:
    """What a location without a readable manifest is when it is not a statekit save: a
    checkpoint of another format (its :class:`Survey`), or an error saying what it is (a
    manager root, nothing known); None when it really is an uncommitted statekit save, whose
    error is already right."""
    try:
        found = detect_format(location)
        if found == "statekit":
            return None
        return survey(location)
    except IncompleteCheckpointError:
        return None
    except StatekitError as exc:  # a checkpoint root, or not a checkpoint at all
        return exc


def _show_survey(report: Survey, as_json: bool) -> None:
    """A checkpoint of another format: what it is, its files, the checks; exit 3 (not
    verified), or 1 naming the file whose check failed."""
    failed = [c for c in report.checks if c.ok is False]
    headline = (f"not verified: {report.url} is not a statekit checkpoint but {report.description} "
                f"({len(report.files)} files, {human(report.size_bytes)}); it has no checksums to verify")
    if as_json:
        error = f"{failed[0].file}: {failed[0].detail}" if failed else headline
        click.echo(json.dumps({**report.to_json(), "ok": False, "checks_ok": not failed, "error": error}, indent=1))
        sys.exit(1 if failed else NOT_VERIFIED)
    labels = {True: "checked", False: "FAILED", None: "not read"}
    lines = [headline] + [f"{labels[c.ok]:<10}  {c.file}: {c.detail}" for c in report.checks]
    out = console()
    out.print("\n".join(lines), markup=False)
    out.print(rich_table([[rel, human(size)] for rel, size in report.files.items()], ["file", "size"], right=(1,)))
    if failed:
        where = report.url if report.format in ("safetensors", "torch") else f"{report.url.rstrip('/')}/{failed[0].file}"
        fail(StatekitError(f"{where}: {failed[0].detail}"))
    sys.exit(NOT_VERIFIED)
