"""The ``statekit`` command: plugins, ls, inspect, verify, convert, gc.

Human-readable tables by default, ``--json`` for scripts. Exit codes: 0 success, 1 a
checkpoint problem (verification failure, not found, incomplete), 2 usage errors (click).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from statekit.errors import StatekitError


def _human(size_bytes: int | None) -> str:
    if size_bytes is None:
        return "-"
    value = float(size_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{size_bytes} B"


def _table(rows: list[list[str]], headers: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in rows + [headers]) for i in range(len(headers))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def _emit(as_json: bool, payload: Any, text: str) -> None:
    click.echo(json.dumps(payload, indent=1, default=str) if as_json else text)


def _fail(exc: Exception) -> None:
    click.echo(f"error: {exc}", err=True)
    sys.exit(1)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="statekit")
def main() -> None:
    """statekit: inspect, verify and convert PyTorch training checkpoints."""


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def plugins(as_json: bool) -> None:
    """List plugins: name, distribution, version, origin and hooks (blocked ones marked)."""
    from importlib import metadata

    from statekit.plugins import ENTRY_POINT_GROUP, get_plugin_manager

    try:
        pm = get_plugin_manager()
    except StatekitError as exc:
        _fail(exc)
    rows = []
    for name, plugin in sorted(pm.list_name_plugin(), key=lambda item: item[0] or ""):
        if plugin is None:
            continue
        source = pm.sources.get(name)
        hooks = sorted(h.name for h in pm.get_hookcallers(plugin) or [])
        rows.append({
            "name": name,
            "distribution": source.distribution if source else None,
            "version": source.version if source else None,
            "origin": source.origin if source else "code",
            "entry_point": source.entry_point if source else None,
            "hooks": hooks,
            "blocked": False,
            "converters": sorted(getattr(plugin, "STATEKIT_CONVERTERS", {}) or {}),
        })
    for dist in metadata.distributions():
        for ep in dist.entry_points:
            if ep.group == ENTRY_POINT_GROUP and pm.is_blocked(ep.name):
                rows.append({"name": ep.name, "distribution": dist.metadata["name"], "version": dist.version,
                             "origin": "entry point", "entry_point": ep.value, "hooks": [], "blocked": True, "converters": []})
    text = _table(
        [[r["name"] + (" (blocked)" if r["blocked"] else ""), r["distribution"] or "-", r["version"] or "-",
          r["origin"] + (f" {r['entry_point']}" if r["entry_point"] else ""), ", ".join(r["hooks"]) or "-"] for r in rows],
        ["plugin", "distribution", "version", "from", "hooks"],
    ) if rows else "no plugins installed"
    _emit(as_json, rows, text)


@main.command()
@click.argument("url")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def ls(url: str, as_json: bool) -> None:
    """List the checkpoints under a manager root URL: step, time, size, committed."""
    from statekit.manager import list_checkpoints

    try:
        infos = list_checkpoints(url)
    except StatekitError as exc:
        _fail(exc)
    payload = [i.__dict__ for i in infos]
    text = _table(
        [[str(i.step), i.created or "-", _human(i.size_bytes), "yes" if i.committed else "NO (incomplete)", i.url] for i in infos],
        ["step", "created", "size", "committed", "url"],
    ) if infos else f"no checkpoints under {url}"
    _emit(as_json, payload, text)


@main.command()
@click.argument("url")
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON.")
@click.option("--tensors", is_flag=True, help="Also list the tensors of every safetensors file (headers only).")
def inspect(url: str, as_json: bool, tensors: bool) -> None:
    """Show a checkpoint's manifest: step, world size, plugins, objects and files."""
    from statekit.engine import read_manifest
    from statekit.storage import Storage

    try:
        storage = Storage(url)
        manifest = read_manifest(storage)
        headers = _tensor_headers(storage, manifest) if tensors else {}
    except StatekitError as exc:
        _fail(exc)
    if as_json:
        _emit(True, {**manifest, "tensors": headers} if tensors else manifest, "")
        return
    total = sum(f["size_bytes"] for f in manifest["files"].values())
    lines = [
        f"checkpoint  {storage.url}",
        f"format      {manifest['format']} (statekit {manifest['statekit_version']}), created {manifest['created']}",
        f"step        {manifest.get('step')}    world size {manifest['world_size']}    "
        f"{len(manifest['files'])} files, {_human(total)}",
        f"plugins     {', '.join(f'{k} {v}' for k, v in manifest['plugins'].items()) or 'none'}",
    ]
    if manifest["metadata"]:
        lines.append(f"metadata    {json.dumps(manifest['metadata'])}")
    if manifest["objects"]:
        lines += ["", _table([[k, o["kind"], o["owner"], "per rank" if o.get("per_rank") else "replicated"]
                              for k, o in manifest["objects"].items()], ["object", "kind", "owner", "scope"])]
    lines += ["", _table([[p, _human(f["size_bytes"]), str(f["rank"]), f.get("writer", "-"), f["checksum"]]
                          for p, f in sorted(manifest["files"].items())], ["file", "size", "rank", "writer", "checksum"])]
    for rel, entries in headers.items():
        lines += ["", f"{rel}:", _table([[e["name"], e["dtype"], str(e["shape"])] for e in entries], ["tensor", "dtype", "shape"])]
    click.echo("\n".join(lines))


def _tensor_headers(storage: Any, manifest: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    from statekit import format as fmt

    out = {}
    for rel, entry in sorted(manifest["files"].items()):
        if not rel.endswith(".safetensors"):
            continue
        with storage.open_read(rel) as f:
            header, _ = fmt.parse_header(f.read(8), f.read, entry["size_bytes"], storage.url_of(rel))
        out[rel] = [{"name": e.name, "dtype": str(e.dtype).removeprefix("torch."), "shape": list(e.shape)} for e in header.entries]
        out[rel] += [{"name": a, "dtype": "alias", "shape": t} for a, t in header.aliases.items()]
    return out


@main.command()
@click.argument("url")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def verify(url: str, as_json: bool) -> None:
    """Check every file's size and checksum against the manifest; exit 1 naming the bad file."""
    from statekit.engine import verify as verify_checkpoint

    try:
        manifest = verify_checkpoint(url)
    except StatekitError as exc:
        if as_json:
            click.echo(json.dumps({"ok": False, "url": url, "error": str(exc), "file": getattr(exc, "path", None)}))
            sys.exit(1)
        _fail(exc)
    total = sum(f["size_bytes"] for f in manifest["files"].values())
    _emit(as_json, {"ok": True, "url": url, "files": len(manifest["files"]), "size_bytes": total},
          f"ok: {len(manifest['files'])} files, {_human(total)} verified ({url})")


@main.command()
@click.argument("src")
@click.argument("out")
@click.option("--to", "target", default="statekit", show_default=True,
              help="Output format: statekit (from an Accelerate directory) or one a plugin provides.")
@click.option("--allow-pickle", is_flag=True, help="Allow reading pickle files of the source (runs code from it).")
@click.option("--option", "raw_options", multiple=True, metavar="KEY=VALUE",
              help="Option for a plugin's converter (VALUE parsed as JSON, else a string); repeatable.")
def convert(src: str, out: str, target: str, allow_pickle: bool, raw_options: tuple[str, ...]) -> None:
    """Convert a checkpoint: Accelerate directory -> statekit, or statekit -> a plugin's format."""
    from statekit.plugins import get_plugin_manager

    try:
        if target == "statekit":
            from statekit.accelerate_format import convert as convert_accelerate

            manifest = convert_accelerate(src, out, allow_pickle=allow_pickle)
            click.echo(f"wrote {out}: {len(manifest['files'])} files")
            return
        converters = {}
        for plugin in get_plugin_manager().get_plugins():
            converters.update(getattr(plugin, "STATEKIT_CONVERTERS", {}) or {})
        if target not in converters:
            raise click.UsageError(f"unknown format {target!r}; available: {', '.join(['statekit', *sorted(converters)])}")
        converters[target](src, out, **_parse_options(raw_options))
        click.echo(f"wrote {out} ({target})")
    except StatekitError as exc:
        _fail(exc)


def _parse_options(raw: tuple[str, ...]) -> dict[str, Any]:
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


@main.command()
@click.argument("url")
@click.option("--dry-run", is_flag=True, help="Only list what would be removed.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def gc(url: str, dry_run: bool, as_json: bool) -> None:
    """Remove incomplete checkpoints (directories without a manifest) under a manager root."""
    from statekit.errors import CheckpointInUseError
    from statekit.manager import delete_checkpoint, list_checkpoints

    removed, kept = [], []
    try:
        for info in list_checkpoints(url, details=False):
            if info.committed:
                continue
            try:
                if not dry_run:
                    delete_checkpoint(info.url)
                else:
                    from statekit.manager import _refuse_if_in_use

                    _refuse_if_in_use(info.url, "delete")
                removed.append(info.url)
            except CheckpointInUseError as exc:
                kept.append({"url": info.url, "reason": str(exc)})
    except StatekitError as exc:
        _fail(exc)
    verb = "would remove" if dry_run else "removed"
    lines = [f"{verb} {u}" for u in removed] + [f"kept {k['url']} (in use)" for k in kept]
    _emit(as_json, {"dry_run": dry_run, "removed": removed, "kept": kept}, "\n".join(lines) or "nothing to remove")


if __name__ == "__main__":  # pragma: no cover
    main()
