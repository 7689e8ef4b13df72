"""pytest fixtures for statekit and its plugins: plugin managers, storage URLs, S3 (moto), state
comparison, a tiny Accelerate run (the table: docs/writing-a-plugin.md, "Tests with
``statekit.testing``").

A pytest plugin through the ``pytest11`` entry point (or ``pytest_plugins = ["statekit.testing"]``);
pytest registers the fixtures in this namespace, so :mod:`statekit.testing.fixtures` is
re-exported here. Importing it is cheap: accelerate, moto, boto and s3fs are imported inside the
functions that need them. Helpers usable outside pytest: :func:`assert_state_equal`,
:func:`start_moto_server` (the one S3 test-server starter), :func:`rewrite_manifest`. s3fs 2024.6
and later reads ``AWS_ENDPOINT_URL``; with an older one pass ``storage_options=s3_server.storage_options``."""

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
