"""The ``statekit`` command: plugins, ls, inspect, diff, verify, convert, gc.

Human-readable tables by default (rich, imported only inside commands), ``--json`` for
scripts; long operations draw a progress bar on a terminal (:mod:`statekit.progress`). Exit codes: 0 success, 1 a
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


def _console() -> Any:
    """A rich console on stdout; off a terminal, wide enough that rows do not wrap."""
    from rich.console import Console

    console = Console(highlight=False)
    if not console.is_terminal:
        console = Console(highlight=False, width=max(console.width, 200), soft_wrap=True)
    return console


def _rich_table(rows: list[list[str]], headers: list[str], title: str | None = None, right: tuple[int, ...] = ()) -> Any:
    """A rich table (imported lazily: importing statekit must stay cheap)."""
    from rich import box
    from rich.table import Table

    table = Table(*headers, title=title, box=box.SIMPLE_HEAD, title_justify="left", title_style="bold", pad_edge=False)
    for i in right:
        table.columns[i].justify = "right"
    for row in rows:
        table.add_row(*[str(c) for c in row])
    return table


def _emit(as_json: bool, payload: Any, text: str) -> None:
    click.echo(json.dumps(payload, indent=1, default=str) if as_json else text)


def _fail(exc: Exception) -> None:
    click.echo(f"error: {exc}", err=True)
    sys.exit(1)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="statekit")
def main() -> None:
    """statekit: inspect, compare, verify and convert PyTorch training checkpoints."""


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def plugins(as_json: bool) -> None:
    """List plugins: name, distribution, version, origin and hooks (blocked ones marked)."""
    from importlib import metadata

    from statekit.hooks.registry import ENTRY_POINT_GROUP, get_plugin_manager

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
    from statekit.api.manager import list_checkpoints

    try:
        infos = list_checkpoints(url)
    except StatekitError as exc:
        _fail(exc)
    payload = [i.__dict__ for i in infos]
    if as_json:
        _emit(True, payload, "")
        return
    if not infos:
        click.echo(f"no checkpoints under {url}")
        return
    rows = [[str(i.step), i.created or "-", _human(i.size_bytes), "yes" if i.committed else "NO (incomplete)",
             ", ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in (i.metrics or {}).items()) or "-",
             i.url] for i in infos]
    _console().print(_rich_table(rows, ["step", "created", "size", "committed", "metrics", "url"],
                                 title=f"{len(infos)} checkpoints under {url}", right=(0, 2)))


@main.command()
@click.argument("url")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (the manifest for a statekit checkpoint).")
@click.option("--tensors", is_flag=True, help="Also list every tensor: name, dtype, shape, size (metadata only).")
@click.option("--allow-pickle", is_flag=True,
              help="Allow reading pickle files (DCP .metadata, torch files, Accelerate .bin/.pkl): runs code from them.")
def inspect(url: str, as_json: bool, tensors: bool, allow_pickle: bool) -> None:
    """Show a checkpoint: statekit, Accelerate directory, DCP directory, safetensors or torch file.

    For a statekit checkpoint: step, world size, plugins, objects and files from the manifest.
    For the other formats: the format, files and tensor totals. Only metadata is read.
    """
    from statekit.foreign import open_checkpoint

    try:
        reader = open_checkpoint(url, allow_pickle=allow_pickle)
        if reader.format == "statekit":
            manifest = reader.manifest  # type: ignore[attr-defined]
            headers = _tensor_headers(reader) if tensors else {}
        else:
            summary = reader.summary()
            infos = list(reader.tensors().items()) if tensors else []
    except StatekitError as exc:
        _fail(exc)
    if reader.format == "statekit":
        _inspect_statekit(reader.url, manifest, headers, as_json, tensors)
        return
    if as_json:
        payload = {**summary, **({"tensors": [{"key": k, **i.to_json()} for k, i in infos]} if tensors else {})}
        _emit(True, payload, "")
        return
    console = _console()
    lines = [
        f"checkpoint  {reader.url}",
        f"format      {reader.format}",
        f"files       {len(summary['files'])} files, {_human(summary['size_bytes'])}",
        f"tensors     {summary['tensor_count']} tensors, {_human(summary['tensor_bytes'])}",
    ]
    if summary["metadata"]:
        lines.append(f"metadata    {json.dumps(summary['metadata'], default=str)}")
    if summary["skipped"]:
        lines.append(f"not read    {', '.join(summary['skipped'])} (pickle: use --allow-pickle)")
    console.print("\n".join(lines), markup=False)
    console.print(_rich_table([[rel, _human(size)] for rel, size in summary["files"].items()], ["file", "size"], right=(1,)))
    if tensors:
        console.print(_rich_table([[k, i.dtype, _shape(i.shape), _human(i.size_bytes)] for k, i in infos],
                                  ["tensor", "dtype", "shape", "size"], right=(3,)))


def _shape(shape: Any) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _inspect_statekit(url: str, manifest: dict[str, Any], headers: dict[str, list[dict[str, Any]]], as_json: bool,
                      tensors: bool) -> None:
    if as_json:
        _emit(True, {**manifest, "tensors": headers} if tensors else manifest, "")
        return
    console = _console()
    total = sum(f["size_bytes"] for f in manifest["files"].values())
    lines = [
        f"checkpoint  {url}",
        f"format      {manifest['format']} (statekit {manifest['statekit_version']}), created {manifest['created']}",
        f"step        {manifest.get('step')}    world size {manifest['world_size']}    "
        f"{len(manifest['files'])} files, {_human(total)}",
        f"plugins     {', '.join(f'{k} {v}' for k, v in manifest['plugins'].items()) or 'none'}",
    ]
    if manifest["metadata"]:
        lines.append(f"metadata    {json.dumps(manifest['metadata'])}")
    console.print("\n".join(lines), markup=False)
    if manifest["objects"]:
        console.print(_rich_table([[k, o["kind"], o["owner"], "per rank" if o.get("per_rank") else "replicated"]
                                   for k, o in manifest["objects"].items()], ["object", "kind", "owner", "scope"]))
    console.print(_rich_table([[p, _human(f["size_bytes"]), str(f["rank"]), f.get("writer", "-"), f["checksum"]]
                               for p, f in sorted(manifest["files"].items())],
                              ["file", "size", "rank", "writer", "checksum"], right=(1, 2)))
    for rel, entries in headers.items():
        console.print(_rich_table([[e["name"], e["dtype"], _shape(e["shape"]) if e["dtype"] != "alias" else f"-> {e['shape']}"]
                                   for e in entries], ["tensor", "dtype", "shape"], title=f"{rel}:"))


def _tensor_headers(reader: Any) -> dict[str, list[dict[str, Any]]]:
    """``file -> [{name, dtype, shape}]`` for every safetensors file (aliases: dtype "alias")."""
    from statekit.foreign import _read_header

    out = {}
    for rel in sorted(reader.manifest["files"]):
        if not rel.endswith(".safetensors"):
            continue
        header = _read_header(reader.storage, rel)
        out[rel] = [{"name": e.name, "dtype": str(e.dtype).removeprefix("torch."), "shape": list(e.shape)} for e in header.entries]
        out[rel] += [{"name": a, "dtype": "alias", "shape": t} for a, t in header.aliases.items()]
    return out


@main.command()
@click.argument("a")
@click.argument("b")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--allow-pickle", is_flag=True, help="Allow reading pickle files of either side (runs code from them).")
@click.option("--all", "show_all", is_flag=True, help="List equal tensors too (default: only those that differ).")
def diff(a: str, b: str, as_json: bool, allow_pickle: bool, show_all: bool) -> None:
    """Compare two checkpoints of any readable formats, tensor by tensor.

    Reports keys added and removed, shape/dtype changes, the max absolute difference of
    every tensor present in both with the same shape (read one pair at a time), files
    whose size or checksum changed, and the total size of each side. Keys are
    ``file:tensor`` for statekit and Accelerate directories, tensor names otherwise.
    """
    from statekit.foreign import diff as diff_checkpoints, open_checkpoint
    from statekit.progress import progress

    try:
        left = open_checkpoint(a, allow_pickle=allow_pickle)
        right = open_checkpoint(b, allow_pickle=allow_pickle)
        shared = [k for k, i in left.tensors().items() if k in right.tensors() and right.tensors()[k].shape == i.shape]
        total = sum(left.tensors()[k].size_bytes + right.tensors()[k].size_bytes for k in shared)
        with progress(total, "diff") as advance:
            report = diff_checkpoints(left, right, advance=advance)
    except StatekitError as exc:
        _fail(exc)
    if as_json:
        _emit(True, report, "")
        return
    console = _console()
    sa, sb = report["a"], report["b"]
    differing = [t for t in report["tensors"] if not t["equal"]]
    delta = report["size_delta_bytes"]
    lines = [
        f"a  {sa['url']}  ({sa['format']}, {sa['tensor_count']} tensors, {_human(sa['size_bytes'])})",
        f"b  {sb['url']}  ({sb['format']}, {sb['tensor_count']} tensors, {_human(sb['size_bytes'])})",
        f"size delta {'+' if delta >= 0 else '-'}{_human(abs(delta))} ({delta:+d} bytes)",
    ]
    for side, info in (("a", sa), ("b", sb)):
        if info["skipped"]:
            lines.append(f"not read in {side}: {', '.join(info['skipped'])} (pickle: use --allow-pickle)")
    if report["identical"]:
        lines.append(f"identical: {len(report['tensors'])} tensors equal, no keys added or removed")
    else:
        lines.append(f"{len(differing)} tensors differ, {len(report['tensors']) - len(differing)} equal, "
                     f"{len(report['added'])} added, {len(report['removed'])} removed, {len(report['changed'])} changed shape/dtype")
    console.print("\n".join(lines), markup=False)
    if report["added"]:
        console.print(_rich_table([[k] for k in report["added"]], ["added in b"]))
    if report["removed"]:
        console.print(_rich_table([[k] for k in report["removed"]], ["removed in b"]))
    if report["changed"]:
        console.print(_rich_table([[c["key"], f"{c['a']['dtype']} {_shape(c['a']['shape'])}", f"{c['b']['dtype']} {_shape(c['b']['shape'])}"]
                                   for c in report["changed"]], ["changed", "a", "b"]))
    shown = report["tensors"] if show_all else differing
    if shown:
        console.print(_rich_table([[t["key"], t["dtype"], _shape(t["shape"]), _num(t["max_abs_diff"])] for t in shown],
                                  ["tensor", "dtype", "shape", "max abs diff"], right=(3,)))
    if report["files"]:
        console.print(_rich_table([[f["file"], _human(f["a_bytes"]), _human(f["b_bytes"]),
                                    {True: "same", False: "changed", None: "-"}[f["checksum_equal"]]] for f in report["files"]],
                                  ["file", "a", "b", "checksum"], right=(1, 2)))


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.6g}"


@main.command()
@click.argument("url")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def verify(url: str, as_json: bool) -> None:
    """Check every file's size and checksum against the manifest; exit 1 naming the bad file."""
    from statekit.engine.read import verify as verify_checkpoint

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
    from statekit.hooks.registry import get_plugin_manager
    from statekit.progress import progress

    try:
        if target == "statekit":
            from statekit.foreign.accelerate import convert as convert_accelerate

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
        _fail(exc)


def _source_bytes(src: str) -> int | None:
    """Total bytes under ``src`` (the progress bar's total; None if it cannot be listed)."""
    from statekit.storage import Storage

    try:
        storage = Storage(src)
        return sum(storage.size(rel) for rel in storage.find()) or None
    except (StatekitError, OSError):
        return None


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
    from statekit.api.manager import delete_checkpoint, list_checkpoints

    removed, kept = [], []
    try:
        for info in list_checkpoints(url, details=False):
            if info.committed:
                continue
            try:
                if not dry_run:
                    delete_checkpoint(info.url)
                else:
                    from statekit.api.manager import _refuse_if_in_use

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
