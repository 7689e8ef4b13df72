"""The ``statekit`` command: plugins, ls, inspect, diff, verify, convert, gc.

Human-readable tables by default (rich, imported only when a table is drawn), ``--json``
for scripts; long operations draw a progress bar on a terminal (:mod:`statekit.progress`).
Exit codes: 0 success, 1 a checkpoint problem (verification failure, not found,
incomplete), 2 usage errors (click), 3 ``verify`` of a checkpoint of another format (no
checksums: not verified; what could be checked without unpickling passed).

The group is :func:`main` (:mod:`statekit.cli.group`, the console script
``statekit = statekit.cli:main``); each command lives in its own module:
:mod:`~statekit.cli.plugins`, :mod:`~statekit.cli.root` (``ls``, ``gc``),
:mod:`~statekit.cli.inspecting`, :mod:`~statekit.cli.diffing`,
:mod:`~statekit.cli.verifying`, :mod:`~statekit.cli.converting`; printing helpers are in
:mod:`~statekit.cli.output`. ``python -m statekit.cli`` runs it too.

Call sequence: :func:`main` (click) -> the command's module -> the API below it
(``ls``/``gc``: :mod:`statekit.manager.listing`; ``inspect``/``diff``: :mod:`statekit.foreign`;
``verify``: :func:`statekit.engine.read.verify`; ``convert``:
:func:`statekit.foreign.accelerate_convert.convert`) -> :mod:`~statekit.cli.output` prints a table
or JSON, and a :class:`statekit.errors.StatekitError` becomes exit code 1 with its message.
"""

from __future__ import annotations

from statekit.cli.group import main

__all__ = ["main"]
