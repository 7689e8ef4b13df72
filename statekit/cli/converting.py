"""``statekit convert``: an Accelerate directory to statekit, a statekit checkpoint to a self-contained one
(``--materialize``), to a Hugging Face folder, or to a format a plugin provides."""

from __future__ import annotations

import click

from statekit.api.export import DEFAULT_MAX_SHARD_SIZE, export_pretrained
from statekit.api.materialize import materialize as materialize_checkpoint
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
              help="Output format: statekit (from an Accelerate directory), hf (a from_pretrained folder) or one a plugin provides.")
@click.option("--allow-pickle", is_flag=True, help="Allow reading pickle files of the source (runs code from it).")
@click.option("--overwrite", is_flag=True, help="Replace a committed checkpoint at OUT (statekit output), or write into a non-empty OUT (hf).")
@click.option("--option", "raw_options", multiple=True, metavar="KEY=VALUE",
              help="Option for a plugin's converter (VALUE parsed as JSON, else a string); repeatable.")
@click.option("--model", "model_key", default=None, help="--to hf: the model's key (needed when the checkpoint holds several).")
@click.option("--config", "configs", multiple=True, metavar="PATH",
              help="--to hf: a config file or folder (config.json, tokenizer, adapter_config.json) to write beside the weights; repeatable.")
@click.option("--merge-adapter", is_flag=True,
              help="--to hf: with an adapter config, write the base model with the LoRA adapter merged into it.")
@click.option("--materialize", is_flag=True,
              help="--to statekit: copy a statekit checkpoint with its referenced frozen base written into it (self-contained).")
@click.option("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE, show_default=True,
              help="--to hf: bytes per weight file (an integer, or 5GB / 500MiB).")
@storage_option
def convert(
    src: str, out: str, target: str, allow_pickle: bool, overwrite: bool, raw_options: tuple[str, ...],
    model_key: str | None, configs: tuple[str, ...], merge_adapter: bool, materialize: bool, max_shard_size: str,
    raw_storage: tuple[str, ...]
) -> None:
    """Convert a checkpoint: Accelerate directory -> statekit, statekit -> self-contained statekit (--materialize), -> a Hugging Face folder, or -> a plugin's format."""
    if merge_adapter and target != "hf":
        raise click.UsageError(f"--merge-adapter goes with --to hf, not --to {target}")
    if materialize and target != "statekit":
        raise click.UsageError(f"--materialize goes with --to statekit, not --to {target}")
    try:
        storage_options = storage_options_of(raw_storage)
        source = Storage(src, storage_options)
        if target == "hf":
            size: int | str = int(max_shard_size) if max_shard_size.isdigit() else max_shard_size
            total = _source_bytes(source)
            with progress(total, "convert to hf") as advance:
                result = export_pretrained(src, out, model_key=model_key, config=list(configs) or None, max_shard_size=size,
                                           merge_adapter=merge_adapter, storage_options=storage_options, overwrite=overwrite)
                advance(total or 0)
            click.echo(f"wrote {result.url}: model {result.key!r}, {result.tensors} tensors, {result.total_size} bytes in "
                       f"{', '.join(result.files)}; {result.digests_compared} tensors matched the checkpoint's state digest")
            return
        if target == "statekit" and materialize:
            manifest = materialize_checkpoint(src, out, storage_options=storage_options, overwrite=overwrite)
            click.echo(f"wrote {out}: {len(manifest.files)} files, self-contained ({manifest.size_bytes} bytes)")
            return
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
                f"unknown format {target!r}; available: {', '.join(['statekit', 'hf', *sorted(converters)])}"
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
