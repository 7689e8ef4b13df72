"""Where things are, for tests at any depth under ``tests/``: the repository root, the
tests folder and its shared ``scripts/`` and ``data/``."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent
"""``tests/``: the shared helpers (``*_helpers.py``, ``data_stacks.py``), ``scripts/``, ``data/``."""

ROOT = TESTS.parent
"""The repository root (``README.md``, ``docs/``, ``examples/``, ``plugins/``)."""

SCRIPTS = TESTS / "scripts"
"""The scripts the integration tests run in their own processes (``torchrun``, ``python``)."""

DATA = TESTS / "data"
"""Files the tests read (manifests written by older code)."""
