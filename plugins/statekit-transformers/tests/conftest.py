"""Fixtures of the statekit-transformers tests: the uninterrupted reference runs, shared per module."""

from __future__ import annotations

import logging
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import trainer_runs  # noqa: E402

logging.getLogger("transformers").setLevel(logging.ERROR)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted StatekitTrainer run of :func:`trainer_runs.run` (3 epochs, 15 steps)."""
    return trainer_runs.run(str(tmp_path_factory.mktemp("reference")))
