"""``statekit diff``: two checkpoints of any readable formats, compared tensor by tensor."""

from __future__ import annotations

from typing import Any

import click

from statekit.cli.output import console, emit, fail, human, num, rich_table, shape, storage_option, storage_options_of
from statekit.errors import StatekitError
from statekit.foreign import diff as diff_checkpoints, open_checkpoint
from statekit.progress import progress


@click.command()
@click.argument("a")
@click.argument("b")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--allow-pickle", is_flag=True, help="Allow reading pickle files of either side (runs code from them).")
@click.option("--all", "show_all", is_flag=True, help="List equal tensors too (default: only those that differ).")
@storage_option
def diff(a: str, b: str, as_json: bool, allow_pickle: bool, show_all: bool, raw_storage: tuple[str, ...]) -> None:
    """Compare two checkpoints of any readable formats, tensor by tensor.

    Reports keys added and removed, shape/dtype changes, the max absolute difference of
    every tensor present in both with the same shape (read one pair at a time), files
    whose size or checksum changed, and the total size of each side. Keys are
    ``file:tensor`` for statekit and Accelerate directories, tensor names otherwise.
    Tensors are matched by what they are across formats: a plain Accelerate directory,
    one saved with statekit attached and a statekit checkpoint of the same run compare
    equal (``model.safetensors`` with ``model_0.safetensors``, ``optimizer.bin`` with
    ``optimizer_0.safetensors``; pickles need --allow-pickle).
    """
    try:
        options = storage_options_of(raw_storage)
        left = open_checkpoint(a, allow_pickle=allow_pickle, storage_options=options)
        right = open_checkpoint(b, allow_pickle=allow_pickle, storage_options=options)
        shared = [k for k, i in left.tensors().items() if k in right.tensors() and right.tensors()[k].shape == i.shape]
        total = sum(left.tensors()[k].size_bytes + right.tensors()[k].size_bytes for k in shared)
        with progress(total, "diff") as advance:
            report = diff_checkpoints(left, right, advance=advance)
    except StatekitError as exc:
        fail(exc, flags=("--allow-pickle",))
    if as_json:
        emit(True, report, "")
        return
    _show(report, show_all)


def _summary(report: dict[str, Any], differing: list[dict[str, Any]]) -> list[str]:
    """The lines above the tables: both sides, the size delta, the verdict."""
    sa, sb = report["a"], report["b"]
    delta = report["size_delta_bytes"]
    lines = [
        f"a  {sa['url']}  ({_what(sa)}, {sa['tensor_count']} tensors, {human(sa['size_bytes'])})",
        f"b  {sb['url']}  ({_what(sb)}, {sb['tensor_count']} tensors, {human(sb['size_bytes'])})",
        f"size delta {'+' if delta >= 0 else '-'}{human(abs(delta))} ({delta:+d} bytes)",
    ]
    for side, info in (("a", sa), ("b", sb)):
        if info["skipped"]:
            lines.append(f"not read in {side}: {', '.join(info['skipped'])} (pickle: use --allow-pickle)")
        if info.get("superseded"):
            lines.append(f"not read in {side}: {', '.join(info['superseded'])} (a load replaces their state with statekit's own files)")
    if report.get("not_compared"):
        lines.append(f"{len(report['not_compared'])} tensors not compared (their counterpart is in a file not read)")
    if report["identical"]:
        lines.append(f"identical: {len(report['tensors'])} tensors equal, no keys added or removed")
    else:
        lines.append(f"{len(differing)} tensors differ, {len(report['tensors']) - len(differing)} equal, "
                     f"{len(report['added'])} added, {len(report['removed'])} removed, {len(report['changed'])} changed shape/dtype")
    return lines


def _what(side: dict[str, Any]) -> str:
    """One side's format, in words where it is not statekit's (``trainer: a transformers Trainer checkpoint``)."""
    return side["format"] if side["format"] == "statekit" else f"{side['format']}: {side['description']}"


def _show(report: dict[str, Any], show_all: bool) -> None:
    """The report for people: summary lines, then one table per kind of difference."""
    out = console()
    differing = [t for t in report["tensors"] if not t["equal"]]
    out.print("\n".join(_summary(report, differing)), markup=False)
    if report["added"]:
        out.print(rich_table([[k] for k in report["added"]], ["added in b"]))
    if report["removed"]:
        out.print(rich_table([[k] for k in report["removed"]], ["removed in b"]))
    if report["changed"]:
        out.print(rich_table([[c["key"], f"{c['a']['dtype']} {shape(c['a']['shape'])}", f"{c['b']['dtype']} {shape(c['b']['shape'])}"]
                              for c in report["changed"]], ["changed", "a", "b"]))
    shown = report["tensors"] if show_all else differing
    if shown:
        out.print(rich_table([[t["key"], t["dtype"], shape(t["shape"]), num(t["max_abs_diff"])] for t in shown],
                             ["tensor", "dtype", "shape", "max abs diff"], right=(3,)))
    if report["files"]:
        out.print(rich_table([[f["file"], human(f["a_bytes"]), human(f["b_bytes"]),
                               {True: "same", False: "changed", None: "-"}[f["checksum_equal"]]] for f in report["files"]],
                             ["file", "a", "b", "checksum"], right=(1, 2)))
