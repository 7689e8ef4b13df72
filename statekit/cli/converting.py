"""``statekit convert``: an Accelerate directory to statekit, or statekit to a format a plugin provides."""

from __future__ import annotations

import click

from statekit.cli.output import fail, parse_key_values, storage_option, storage_options_of
from statekit.errors import StatekitError
from statekit.foreign.accelerate_convert import convert as convert_accelerate
from statekit.format.manifest import read_manifest
from statekit.hooks.registry import get_plugin_manager
from statekit.progress import progress
from statekit.storage import Storage


@click.command()
@click.argument("src")
@click.argument("out")
@click.option("--to", "target", default="statekit", show_default=True,
              help="Output format: statekit (from an Accelerate directory) or one a plugin provides.")
@click.option("--allow-pickle", is_flag=True, help="Allow reading pickle files of the source (runs code from it).")
@click.option("--overwrite", is_flag=True, help="Replace a committed checkpoint at OUT (statekit output only).")
@click.option("--option", "raw_options", multiple=True, metavar="KEY=VALUE",
              help="Option for a plugin's converter (VALUE parsed as JSON, else a string); repeatable.")
@storage_option
def convert(
    src: str, out: str, target: str, allow_pickle: bool, overwrite: bool, raw_options: tuple[str, ...], raw_storage: tuple[str, ...]
) -> None:
    """Convert a checkpoint: Accelerate directory -> statekit, or statekit -> a plugin's format."""
    try:
        storage_options = storage_options_of(raw_storage)
        source = Storage(src, storage_options)
        if target == "statekit":
            total = _source_bytes(source)
            with progress(total, "convert") as advance:
                manifest = convert_accelerate(
                    src, out, allow_pickle=allow_pickle, storage_options=storage_options, overwrite=overwrite
                )
                advance(total or 0)
            click.echo(f"wrote {out}: {len(manifest.files)} files")
            return
        converters = {}
        for plugin in get_plugin_manager().get_plugins():
            converters.update(getattr(plugin, "STATEKIT_CONVERTERS", {}) or {})
        if target not in converters:
            raise click.UsageError(
                f"unknown format {target!r}; available: {', '.join(['statekit', *sorted(converters)])}"
                + _missing_plugin_hint(source, target)
            )
        options = parse_key_values(raw_options, "--option")
        if storage_options is not None:
            options["storage_options"] = storage_options
        total = _source_bytes(source)
        with progress(total, f"convert to {target}") as advance:
            converters[target](src, out, **options)
            advance(total or 0)
        click.echo(f"wrote {out} ({target})")
    except StatekitError as exc:
        fail(exc, flags=("--allow-pickle", "--overwrite"))


def _missing_plugin_hint(source: Storage, target: str) -> str:
    """When the source checkpoint was saved with a plugin named like the target format that
    is not available now, what to install (``"; ... pip install statekit-<target>"``)."""
    pm = get_plugin_manager()
    if pm.get_plugin(target) is not None:
        return ""
    try:
        manifest = read_manifest(source)
    except (StatekitError, OSError):
        return ""
    if target not in manifest.plugins:
        return ""
    owned = [o for o in manifest.objects.values() if o.owner == target]
    dist_name = next((o.owner_distribution for o in owned if o.owner_distribution), f"statekit-{target}")
    why = "is blocked by STATEKIT_DISABLE_PLUGINS" if pm.is_blocked(target) else "is not installed"
    return f"; {source.url} was saved with plugin {target!r}, which provides this format and {why}: pip install {dist_name}"


def _source_bytes(source: Storage) -> int | None:
    """Total bytes under ``source`` (the progress bar's total; None if it cannot be listed)."""
    try:
        return sum(source.size(rel) for rel in source.find()) or None
    except (StatekitError, OSError):
        return None
