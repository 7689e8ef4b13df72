"""How the ``statekit`` commands print: sizes, plain and rich tables, JSON, errors (exit 1).

``rich`` is imported only when a command draws a table (see :func:`console`), so that
``statekit --help`` and ``--json`` output do not pay for it.
"""

from __future__ import annotations

import json
import sys
from typing import Any, NoReturn

import click


def human(size_bytes: int | None) -> str:
    """A size in bytes for people (``"1.5 MiB"``; ``"-"`` for None)."""
    if size_bytes is None:
        return "-"
    value = float(size_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{size_bytes} B"


def shape(dims: Any) -> str:
    """A shape as ``"[3, 4]"``."""
    return "[" + ", ".join(str(d) for d in dims) + "]"


def num(value: float | None) -> str:
    """A number for a table cell (``"-"`` for None)."""
    return "-" if value is None else f"{value:.6g}"


def table(rows: list[list[str]], headers: list[str]) -> str:
    """A plain-text table, columns padded to their widest cell."""
    widths = [max(len(str(r[i])) for r in rows + [headers]) for i in range(len(headers))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def console() -> Any:
    """A rich console on stdout; off a terminal, wide enough that rows do not wrap."""
    # imported here: rich costs about 0.3 s to import, paid only by commands that draw tables
    from rich.console import Console

    out = Console(highlight=False)
    if not out.is_terminal:
        out = Console(highlight=False, width=max(out.width, 200), soft_wrap=True)
    return out


def rich_table(rows: list[list[str]], headers: list[str], title: str | None = None, right: tuple[int, ...] = ()) -> Any:
    """A rich table; columns numbered in ``right`` are right-aligned."""
    # imported here: rich costs about 0.3 s to import, paid only by commands that draw tables
    from rich import box
    from rich.table import Table

    out = Table(*headers, title=title, box=box.SIMPLE_HEAD, title_justify="left", title_style="bold", pad_edge=False)
    for i in right:
        out.columns[i].justify = "right"
    for row in rows:
        out.add_row(*[str(c) for c in row])
    return out


def emit(as_json: bool, payload: Any, text: str) -> None:
    """Print ``payload`` as JSON if ``as_json``, else ``text``."""
    click.echo(json.dumps(payload, indent=1, default=str) if as_json else text)


def fail(exc: Exception) -> NoReturn:
    """Print ``error: <exc>`` on standard error and exit with status 1 (a checkpoint problem)."""
    click.echo(f"error: {exc}", err=True)
    sys.exit(1)
