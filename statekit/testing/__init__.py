"""pytest fixtures for statekit and its plugins: plugin managers, storage URLs, S3 (moto), state comparison.

Registered as a pytest plugin through the ``pytest11`` entry point, or explicitly with
``pytest_plugins = ["statekit.testing"]`` in a ``conftest.py``. pytest registers the
fixtures it finds in this module's namespace, so every fixture of
:mod:`statekit.testing.fixtures` is re-exported here. Importing this package is cheap:
accelerate, moto, boto and s3fs are imported inside the functions that need them, never at
import time (every pytest run in an environment with statekit loads it).

Fixtures:

* ``plugin_manager``: a fresh manager without entry points, installed as statekit's
  process-wide manager for the test (register throwaway plugins on it).
* ``installed_plugin_manager``: the same, with the installed entry points loaded.
* ``s3_server`` (session): a ``moto`` S3 server on a free local port, with the
  ``AWS_*`` environment pointing at it; skipped if moto is not installed.
* ``s3_bucket``: a fresh, empty bucket on that server, as ``"s3://<bucket>"``.
* ``storage_url``: a fresh checkpoint URL, parametrized over ``memory``, ``file`` and
  ``s3`` (the ``s3`` case carries the ``s3`` marker: deselect it with ``-m "not s3"``).
* ``assert_state_equal``: :func:`assert_state_equal`, as a fixture.
* ``tiny_accelerate``: a prepared CPU ``Accelerator`` with a tiny model, AdamW, a shuffled
  data loader and a ``LambdaLR`` scheduler (:class:`TinyAccelerate`); skipped if
  accelerate is not installed.

Helpers, usable outside pytest too: :func:`assert_state_equal`,
:func:`start_moto_server`, the one S3 test-server starter (the ``s3_server`` fixture, the
fault-injection tests and the demos' ``--moto`` use it), and :func:`rewrite_manifest`
(edit a committed manifest and keep its self-checksum valid).

Modules:

- :mod:`~statekit.testing.fixtures`: the fixtures above.
- :mod:`~statekit.testing.s3`: the moto S3 server (:func:`start_moto_server`).
- :mod:`~statekit.testing.manifests`: editing a committed manifest (:func:`rewrite_manifest`).
- :mod:`~statekit.testing.compare`: state comparison (:func:`assert_state_equal`).
- :mod:`~statekit.testing.training`: the tiny Accelerate setup (:class:`TinyAccelerate`).

S3 access: s3fs (2024.6 and later, with botocore >= 1.31) reads ``AWS_ENDPOINT_URL``
from the environment, so ``fsspec``/``statekit`` calls on ``s3://`` URLs reach the moto
server with no ``storage_options``. With an older s3fs pass
``storage_options=s3_server.storage_options``.
"""

from __future__ import annotations

import pytest

from statekit.testing.compare import assert_state_equal
from statekit.testing.fixtures import (
    assert_state_equal_fixture,  # noqa: F401  (not in __all__: pytest must find the fixture here)
    installed_plugin_manager,
    plugin_manager,
    s3_bucket,
    s3_server,
    storage_url,
    tiny_accelerate,
)
from statekit.testing.manifests import rewrite_manifest
from statekit.testing.s3 import S3_ACCESS_KEY, S3_STARTUP_SECONDS, S3Server, start_moto_server  # noqa: F401
from statekit.testing.training import TinyAccelerate

__all__ = [
    "S3Server",
    "TinyAccelerate",
    "assert_state_equal",
    "installed_plugin_manager",
    "plugin_manager",
    "rewrite_manifest",
    "s3_bucket",
    "s3_server",
    "start_moto_server",
    "storage_url",
    "tiny_accelerate",
]


def pytest_configure(config: pytest.Config) -> None:
    """Register the ``s3`` marker carried by the S3 case of ``storage_url``."""
    config.addinivalue_line("markers", "s3: needs the moto S3 server (statekit.testing)")
