"""``statekit convert``: an Accelerate directory to statekit, or statekit to a format a plugin provides."""

from __future__ import annotations

import json
from typing import Any

import click

from statekit.cli.output import fail
from statekit.errors import StatekitError
from statekit.foreign.accelerate import convert as convert_accelerate
from statekit.hooks.registry import get_plugin_manager
from statekit.progress import progress
from statekit.storage import Storage


@click.command()
@click.argument("src")
@click.argument("out")
@click.option("--to", "target", default="statekit", show_default=True,
              help="Output format: statekit (from an Accelerate directory) or one a plugin provides.")
@click.option("--allow-pickle", is_flag=True, help="Allow reading pickle files of the source (runs code from it).")
@click.option("--option", "raw_options", multiple=True, metavar="KEY=VALUE",
              help="Option for a plugin's converter (VALUE parsed as JSON, else a string); repeatable.")
def convert(src: str, out: str, target: str, allow_pickle: bool, raw_options: tuple[str, ...]) -> None:
    """Convert a checkpoint: Accelerate directory -> statekit, or statekit -> a plugin's format."""
    try:
        if target == "statekit":
            total = _source_bytes(src)
            with progress(total, "convert") as advance:
                manifest = convert_accelerate(src, out, allow_pickle=allow_pickle)
                advance(total or 0)
            click.echo(f"wrote {out}: {len(manifest['files'])} files")
            return
        converters = {}
        for plugin in get_plugin_manager().get_plugins():
            converters.update(getattr(plugin, "STATEKIT_CONVERTERS", {}) or {})
        if target not in converters:
            raise click.UsageError(f"unknown format {target!r}; available: {', '.join(['statekit', *sorted(converters)])}")
        options = _parse_options(raw_options)
        total = _source_bytes(src)
        with progress(total, f"convert to {target}") as advance:
            converters[target](src, out, **options)
            advance(total or 0)
        click.echo(f"wrote {out} ({target})")
    except StatekitError as exc:
        fail(exc)


def _source_bytes(src: str) -> int | None:
    """Total bytes under ``src`` (the progress bar's total; None if it cannot be listed)."""
    try:
        storage = Storage(src)
        return sum(storage.size(rel) for rel in storage.find()) or None
    except (StatekitError, OSError):
        return None


def _parse_options(raw: tuple[str, ...]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs as keyword arguments (VALUE parsed as JSON, else kept a string)."""
    options: dict[str, Any] = {}
    for item in raw:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.UsageError(f"--option expects KEY=VALUE, got {item!r}")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options
