"""``statekit inspect``: one checkpoint of any readable format, from its metadata only."""

from __future__ import annotations

import json
from typing import Any

import click

from statekit import format as fmt
from statekit.api.fingerprint import describe as describe_fingerprint
from statekit.cli.output import console, emit, fail, human, rich_table, shape, storage_option, storage_options_of
from statekit.engine.context import ACCELERATE_WRITER
from statekit.engine.entries import strip_wrapper_prefixes
from statekit.errors import StatekitError
from statekit.foreign import CheckpointReader, TensorInfo, open_checkpoint
from statekit.foreign.accelerate import is_model_file
from statekit.format.manifest_types import Manifest, ResumeAudit


@click.command()
@click.argument("url")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (the manifest for a statekit checkpoint).")
@click.option("--tensors", is_flag=True, help="Also list every tensor: name, dtype, shape, size (metadata only).")
@click.option("--allow-pickle", is_flag=True,
              help="Allow reading pickle files (DCP .metadata, torch files, Accelerate .bin/.pkl): runs code from them.")
@storage_option
def inspect(url: str, as_json: bool, tensors: bool, allow_pickle: bool, raw_storage: tuple[str, ...]) -> None:
    """Show a checkpoint: statekit, Accelerate, Trainer or DCP directory, safetensors or torch file.

    For a statekit checkpoint: step, world size, plugins, the resume fingerprint, objects
    and files from the manifest.
    For the other formats (a Trainer checkpoint folder too): what it is, files and tensor
    totals. Only metadata is read.
    """
    try:
        reader = open_checkpoint(url, allow_pickle=allow_pickle, storage_options=storage_options_of(raw_storage))
        if reader.format == "statekit":
            manifest = reader.manifest  # type: ignore[attr-defined]
            headers = _tensor_headers(reader) if tensors else {}
        else:
            summary = reader.summary()
            infos = list(reader.tensors().items()) if tensors else []
    except StatekitError as exc:
        fail(exc, flags=("--allow-pickle",))
    if reader.format == "statekit":
        _show_statekit(reader.url, manifest, headers, as_json, tensors)
    else:
        _show_foreign(reader, summary, infos, as_json, tensors)


def _show_foreign(reader: CheckpointReader, summary: dict[str, Any], infos: list[tuple[str, TensorInfo]], as_json: bool,
                  tensors: bool) -> None:
    """A checkpoint of another format: format, files, tensor totals (and tensors)."""
    if as_json:
        payload = {**summary, **({"tensors": [{"key": k, **i.to_json()} for k, i in infos]} if tensors else {})}
        emit(True, payload, "")
        return
    out = console()
    lines = [
        f"checkpoint  {reader.url}",
        f"format      {reader.format}: {summary['description']}, not a statekit checkpoint (no manifest, no checksums)",
        f"files       {len(summary['files'])} files, {human(summary['size_bytes'])}",
        f"tensors     {summary['tensor_count']} tensors, {human(summary['tensor_bytes'])}",
    ]
    if summary["metadata"]:
        lines.append(f"metadata    {json.dumps(summary['metadata'], default=str)}")
    if summary["skipped"]:
        lines.append(f"not read    {', '.join(summary['skipped'])} (pickle: use --allow-pickle)")
    out.print("\n".join(lines), markup=False)
    out.print(rich_table([[rel, human(size)] for rel, size in summary["files"].items()], ["file", "size"], right=(1,)))
    if tensors:
        out.print(rich_table([[k, i.dtype, shape(i.shape), human(i.size_bytes)] for k, i in infos],
                             ["tensor", "dtype", "shape", "size"], right=(3,)))


def _show_statekit(url: str, manifest: Manifest, headers: dict[str, list[dict[str, Any]]], as_json: bool,
                   tensors: bool) -> None:
    """A statekit checkpoint: the manifest's step, plugins, objects and files (and tensors)."""
    if as_json:
        emit(True, {**manifest.to_json(), "tensors": headers} if tensors else manifest.to_json(), "")
        return
    out = console()
    out.print("\n".join(_statekit_lines(url, manifest)), markup=False)
    if manifest.objects:
        out.print(rich_table([[k, o.kind, o.owner, "per rank" if o.per_rank else "replicated"]
                              for k, o in manifest.objects.items()], ["object", "kind", "owner", "scope"]))
    out.print(rich_table([[p, human(f.size_bytes), str(f.rank), f.writer or "-", f.reused_from or "-", f.checksum]
                          for p, f in sorted(manifest.files.items())],
                         ["file", "size", "rank", "writer", "reused from", "checksum"], right=(1, 2)))
    for rel, entries in headers.items():
        out.print(rich_table([[e["name"], e["dtype"], shape(e["shape"]) if e["dtype"] != "alias" else f"-> {e['shape']}"]
                              for e in entries], ["tensor", "dtype", "shape"], title=f"{rel}:"))


def _statekit_lines(url: str, manifest: Manifest) -> list[str]:
    """The summary above the tables: format, step, sizes, plugins, metadata, fingerprint,
    state digest and resume audit."""
    lines = [
        f"checkpoint  {url}",
        f"format      {manifest.format} (statekit {manifest.statekit_version}), created {manifest.created}",
        f"step        {manifest.step}    world size {manifest.world_size}    "
        f"{len(manifest.files)} files, {human(manifest.size_bytes)}"
        + (f" ({human(manifest.written_bytes)} written, {human(manifest.reused_bytes)} reused)" if manifest.reused_bytes else ""),
        f"plugins     {', '.join(f'{k} {v}' for k, v in manifest.plugins.items()) or 'none'}",
    ]
    if manifest.metadata:
        lines.append(f"metadata    {json.dumps(manifest.metadata)}")
    for key, ref in sorted((manifest.references or {}).items()):  # a frozen base kept in its folder, not here
        lines.append(f"references  model {key!r}: {len(ref.tensors)} frozen tensors in {ref.source} "
                     f"({', '.join(sorted(ref.files))}), not in this checkpoint")
    for i, line in enumerate(describe_fingerprint(manifest.fingerprint) if manifest.fingerprint is not None else []):
        lines.append(f"{'fingerprint' if i == 0 else '':<12}{line}")
    return lines + _state_digest_line(manifest) + _resume_audit_lines(manifest.resume_audit)


def _resume_audit_lines(resume_audit: ResumeAudit | None) -> list[str]:
    """The manifest's ``resume_audit``: the verdict of the resume the saving run continued
    from, and each restored loader's (``docs/concepts.md``, Resume audit)."""
    if resume_audit is None:
        return []
    origin = resume_audit.resumed_from
    head = f"resume audit {resume_audit.verdict}: the run resumed from step {origin.get('step')} ({origin.get('url')})"
    lines = [head + (f": {resume_audit.detail}" if resume_audit.detail else "")]
    for key, loader in resume_audit.loaders.items():
        lines.append(f"{'':<12}{key}: {loader.get('verdict')}" + (f" ({loader['detail']})" if loader.get("detail") else ""))
    if resume_audit.state is not None:
        lines.append(f"{'':<12}state check: {resume_audit.state.get('verdict')} ({resume_audit.state.get('detail')})")
    return lines


def _state_digest_line(manifest: Manifest) -> list[str]:
    """The manifest's ``state_digest``: how many tensors of how many objects, sampled or not."""
    digest = manifest.state_digest
    if digest is None:
        return []
    tensors = sum(len(o) for o in digest.objects.values())
    stride = digest.sampling.get("stride", 1)
    how = "every element" if stride <= digest.sampling.get("block", 1) else (
        f"sampled: {digest.sampling.get('block')} elements every {stride}, whole below {digest.sampling.get('full_below')}")
    return [f"{'state':<12}{digest.algorithm} digests of {tensors} tensors in {len(digest.objects)} objects ({how})"]


def _tensor_headers(reader: Any) -> dict[str, list[dict[str, Any]]]:
    """``file -> [{name, dtype, shape}]`` for every safetensors file (aliases: dtype "alias"),
    from the headers as :func:`statekit.format.read_header` parses them."""
    out = {}
    files = reader.manifest.files
    for rel in sorted(files):
        if not rel.endswith(".safetensors"):
            continue
        header = reader.header(rel)
        rows = [{"name": e.name, "dtype": fmt.dtype_name(e.dtype), "shape": list(e.shape)} for e in header.entries]
        rows += [{"name": a, "dtype": "alias", "shape": t} for a, t in header.aliases.items()]
        if files[rel].writer == ACCELERATE_WRITER and is_model_file(rel):
            # attach mode: Accelerate keeps the _orig_mod./module. prefixes of a compiled or
            # wrapped model; listed without them, as every reader names them (issue 11)
            names = list(strip_wrapper_prefixes(dict.fromkeys(r["name"] for r in rows)))
            rows = [{**r, "name": n} for r, n in zip(rows, names)]
        out[rel] = rows
    return out
