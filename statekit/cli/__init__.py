"""The ``statekit`` command: plugins, ls, inspect, diff, verify, convert, gc.

Human-readable tables by default (rich, imported only when a table is drawn), ``--json``
for scripts; long operations draw a progress bar on a terminal (:mod:`statekit.progress`).
Exit codes: 0 success, 1 a checkpoint problem (verification failure, not found,
incomplete), 2 usage errors (click), 3 ``verify`` of a checkpoint of another format (no
checksums: not verified; what could be checked without unpickling passed).

Modules:

- :mod:`~statekit.cli.group`: the click group :func:`main` (console script ``statekit``).
- :mod:`~statekit.cli.root`: ``ls`` and ``gc``, the checkpoints under a manager root.
- :mod:`~statekit.cli.inspecting`: ``inspect``, one checkpoint of any readable format.
- :mod:`~statekit.cli.diffing`: ``diff``, two checkpoints tensor by tensor.
- :mod:`~statekit.cli.verifying`: ``verify``, sizes and checksums against the manifest.
- :mod:`~statekit.cli.converting`: ``convert``, Accelerate to statekit, or to a plugin's format.
- :mod:`~statekit.cli.plugins`: ``plugins``, the installed plugins, their hooks and converters.
- :mod:`~statekit.cli.output`: printing: sizes, tables, JSON, errors (exit 1).
- :mod:`~statekit.cli.__main__`: ``python -m statekit.cli``.

Call sequences: docs/design-notes.md, "Call sequences through each package" (cli).
"""

from __future__ import annotations

from statekit.cli.group import main

__all__ = ["main"]
