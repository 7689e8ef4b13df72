"""Byte progress bars for long operations (verify, convert, diff): bytes done, bytes/s and
time left (``rich.progress``) on standard error, drawn only for a terminal;
``STATEKIT_PROGRESS=0`` turns them off, ``=1`` forces them on. ``rich`` is imported only when
a bar is drawn. Use: ``with progress(total_bytes, "verify") as advance: advance(len(chunk))``.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any, TextIO


def human(size_bytes: int | None) -> str:
    """A size in bytes for people (the CLI's tables, the log lines of saves and loads).

    Args:
        size_bytes: a size in bytes, or None.

    Returns:
        ``"1.5 MiB"``; ``"-"`` for None.
    """
    if size_bytes is None:
        return "-"
    value = float(size_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{size_bytes} B"


ENV_VAR = "STATEKIT_PROGRESS"
"""Environment variable: ``0`` turns progress bars off, ``1`` forces them on."""


def progress_enabled(stream: TextIO | None = None) -> bool:
    """Whether a progress bar would be drawn now.

    Args:
        stream: the stream the bar would be drawn on (default ``sys.stderr``).

    Returns:
        False if ``STATEKIT_PROGRESS=0``; True if ``=1``; else ``stream.isatty()``.
    """
    setting = os.environ.get(ENV_VAR, "").strip().lower()
    if setting in ("0", "false", "no", "off"):
        return False
    if setting in ("1", "true", "yes", "on"):
        return True
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed or replaced streams
        return False


def _noop(_: int = 0) -> None:
    return None


@contextlib.contextmanager
def progress(total_bytes: int | None, description: str, *, stream: TextIO | None = None) -> Iterator[Callable[[int], None]]:
    """A byte progress bar, or a no-op when bars are off (see :func:`progress_enabled`).

    Args:
        total_bytes: bytes the operation will process (None: unknown, no ETA).
        description: a short label drawn left of the bar (``"verify"``).
        stream: where to draw (default ``sys.stderr``).

    Yields:
        ``advance(n_bytes)``: call it as bytes are processed; the bar is removed at exit.
    """
    stream = sys.stderr if stream is None else stream
    if not progress_enabled(stream):
        yield _noop
        return
    # rich is imported only when a bar is shown: it costs start-up time otherwise
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    console = Console(file=stream, force_terminal=True)
    bar: Any = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    )
    with bar:
        task = bar.add_task(description, total=total_bytes)

        def advance(n_bytes: int = 0) -> None:
            bar.advance(task, n_bytes)

        yield advance
