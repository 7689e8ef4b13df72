"""The pytest fixtures of ``statekit.testing`` (registered through the package, which
re-exports them: see ``statekit/testing/__init__.py``). Each one is a thin wrapper around
a helper of its own module: :mod:`statekit.testing.s3`, :mod:`statekit.testing.compare`,
:mod:`statekit.testing.training`."""

from __future__ import annotations

import contextlib
import importlib.util
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import fsspec
import pytest

from statekit.hooks.registry import PluginManager, build_plugin_manager, use_plugin_manager
from statekit.testing.compare import assert_state_equal
from statekit.testing.s3 import S3Server, start_moto_server
from statekit.testing.training import TinyAccelerate, build_tiny_accelerate, reset_accelerate_state

__all__ = [
    "assert_state_equal_fixture",
    "installed_plugin_manager",
    "plugin_manager",
    "s3_bucket",
    "s3_server",
    "storage_url",
    "tiny_accelerate",
]


# --------------------------------------------------------------------------- plugin managers


@pytest.fixture
def plugin_manager() -> Iterator[PluginManager]:
    """A fresh :class:`statekit.hooks.registry.PluginManager` with no entry points, installed as
    the process-wide manager for the test (``plugin_manager.register(Plugin(), name="x")``); the
    ``STATEKIT_DISABLE_PLUGINS``/``STATEKIT_TRACE_PLUGINS`` switches are read when it is built."""
    pm = build_plugin_manager(autoload=False)
    with use_plugin_manager(pm):
        yield pm


@pytest.fixture
def installed_plugin_manager() -> Iterator[PluginManager]:
    """A fresh plugin manager with every installed entry point of group ``statekit``
    loaded (``autoload=True``), installed as the process-wide manager for the test."""
    pm = build_plugin_manager(autoload=True)
    with use_plugin_manager(pm):
        yield pm


# --------------------------------------------------------------------------- S3 (moto)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """A moto S3 server on a free local port for the session (:func:`statekit.testing.start_moto_server`,
    with the ``AWS_*`` environment pointed at it and restored at the end); creates no bucket.

    Yields:
        An :class:`S3Server` with ``.endpoint_url``.

    Skips:
        When moto is not installed (``pip install "moto[server]"``).

    Raises:
        RuntimeError: the server did not start (its output is in the message).
    """
    if importlib.util.find_spec("moto") is None:
        pytest.skip('moto is not installed (pip install "moto[server]"): S3 tests need its server')
    with start_moto_server() as server:
        yield server


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> Iterator[str]:
    """A fresh, empty bucket on the moto server, as ``"s3://<bucket>"``, deleted afterwards; s3fs's
    instance cache is cleared before and after (no stale listings).

    Skips:
        When s3fs is not installed (``pip install "statekit[s3]"``)."""
    s3fs = pytest.importorskip("s3fs", reason='s3fs is not installed (pip install "statekit[s3]")')
    s3fs.S3FileSystem.clear_instance_cache()
    bucket = f"statekit-test-{uuid.uuid4().hex[:16]}"
    fs = s3_server.filesystem()
    fs.mkdir(bucket)
    fs.invalidate_cache()
    try:
        yield f"s3://{bucket}"
    finally:
        with contextlib.suppress(Exception):
            fs.rm(bucket, recursive=True)
        s3fs.S3FileSystem.clear_instance_cache()


# --------------------------------------------------------------------------- storage URLs


@pytest.fixture(
    params=["memory", "file", pytest.param("s3", marks=pytest.mark.s3)],
)
def storage_url(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[str]:
    """A fresh checkpoint URL that does not exist yet, once per backend:

    * ``memory``: ``memory://statekit-tests/<uuid>`` (removed afterwards);
    * ``file``: a plain local path under ``tmp_path``;
    * ``s3``: ``s3://<fresh bucket>/<uuid>`` on the moto server (see ``s3_bucket``).
    """
    kind = request.param
    name = uuid.uuid4().hex
    if kind == "memory":
        url = f"memory://statekit-tests/{name}"
        try:
            yield url
        finally:
            fs = fsspec.filesystem("memory")
            with contextlib.suppress(FileNotFoundError):
                fs.rm(f"/statekit-tests/{name}", recursive=True)
    elif kind == "file":
        yield str(tmp_path / f"ckpt-{name}")
    else:
        bucket = request.getfixturevalue("s3_bucket")
        yield f"{bucket}/{name}"


# --------------------------------------------------------------------------- state comparison


@pytest.fixture(name="assert_state_equal")
def assert_state_equal_fixture() -> Callable[..., None]:
    """:func:`statekit.testing.assert_state_equal` as a fixture (no import needed in the
    test module)."""
    return assert_state_equal


# --------------------------------------------------------------------------- a tiny Accelerate run


@pytest.fixture
def tiny_accelerate() -> Iterator[TinyAccelerate]:
    """A prepared, seeded CPU Accelerate run (:func:`statekit.testing.training.build_tiny_accelerate`),
    Accelerate's process-wide state reset before and after.

    Yields:
        A :class:`TinyAccelerate`.

    Skips:
        When accelerate is not installed (``pip install "statekit[accelerate]"``).
    """
    pytest.importorskip("accelerate", reason='accelerate is not installed (pip install "statekit[accelerate]")')
    reset_accelerate_state()
    try:
        yield build_tiny_accelerate()
    finally:
        reset_accelerate_state()
