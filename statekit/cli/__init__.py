"""The ``statekit`` command: plugins, ls, inspect, diff, verify, convert, gc (docs/cli.md, with the
exit codes: 0 success, 1 a checkpoint problem, 2 usage, 3 ``verify`` of another format). Tables by
default (rich, imported only when drawn), ``--json`` for scripts. One module per command;
printing is :mod:`~statekit.cli.output`'s. Call sequences: docs/design-notes.md, "Call
sequences through each package" (cli)."""

from __future__ import annotations

from statekit.cli.group import main

__all__ = ["main"]
