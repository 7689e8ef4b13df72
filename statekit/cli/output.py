"""How the ``statekit`` commands print: sizes, plain and rich tables, JSON, errors (exit 1).

``rich`` is imported only when a command draws a table (see :func:`console`), so that
``statekit --help`` and ``--json`` output do not pay for it.
"""

from __future__ import annotations

import json
import sys
from typing import Any, NoReturn

import click

from statekit.progress import human  # noqa: F401  (sizes for people: one owner, shared with the API's log lines)


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


CLI_FLAGS = {"--allow-pickle": "allow_pickle=True", "--overwrite": "overwrite=True"}
"""Each command-line flag and the Python argument that library messages name for it."""


def fail(exc: Exception, flags: tuple[str, ...] = ()) -> NoReturn:
    """Print ``error: <exc>`` on standard error and exit with status 1; ``flags``: the command's flags
    among :data:`CLI_FLAGS`, named in the message instead of their Python argument."""
    message = str(exc)
    for flag in flags:
        message = message.replace(CLI_FLAGS[flag], flag)
    click.echo(f"error: {message}", err=True)
    sys.exit(1)


STORAGE_ENV_HELP = (
    "s3fs also reads AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, "
    "AWS_PROFILE and AWS_DEFAULT_REGION from the environment."
)

storage_option = click.option(
    "--storage-option", "raw_storage", multiple=True, metavar="KEY=VALUE",
    help="fsspec storage option for the URLs (VALUE parsed as JSON, else a string; dotted keys nest: "
         "client_kwargs.endpoint_url=http://127.0.0.1:9000); repeatable. " + STORAGE_ENV_HELP,
)
"""The ``--storage-option`` of every command that reads or writes checkpoints."""


def parse_key_values(raw: tuple[str, ...], flag: str, nest: bool = False) -> dict[str, Any]:
    """``KEY=VALUE`` arguments of option ``flag`` as a dict (VALUE parsed as JSON where it parses,
    else a string); with ``nest``, dotted keys nest (``a.b=1`` -> ``{"a": {"b": 1}}``).

    Raises:
        click.UsageError: an item without ``=`` or with an empty key part, or a key that is both
            a value and a parent (``a=1`` and ``a.b=2``).
    """
    options: dict[str, Any] = {}
    for item in raw:
        key, sep, text = item.partition("=")
        parts = key.split(".") if nest else [key]
        if not sep or not all(parts):
            raise click.UsageError(f"{flag} expects KEY=VALUE, got {item!r}")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        node = options
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise click.UsageError(f"{flag} {item!r}: {part!r} already has a value")
        if isinstance(node.get(parts[-1]), dict):
            raise click.UsageError(f"{flag} {item!r}: {key!r} already has nested options")
        node[parts[-1]] = value
    return options


def storage_options_of(raw: tuple[str, ...]) -> dict[str, Any] | None:
    """The ``--storage-option`` values as fsspec ``storage_options`` (None when none given)."""
    return parse_key_values(raw, "--storage-option", nest=True) or None

