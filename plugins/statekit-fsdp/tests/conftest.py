"""statekit-fsdp test configuration: the S3 fixtures (``statekit.testing``, or a minimal fallback)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from typing import Any

import pytest

try:  # the shared fixtures (moto server, fresh bucket), reused as they are
    from statekit.testing import s3_bucket, s3_server  # noqa: F401
except ImportError:  # an older statekit without statekit.testing: a minimal moto server of our own
    import contextlib
    import time
    import uuid

    @pytest.fixture(scope="session")
    def s3_server() -> Any:
        pytest.importorskip("moto", reason="moto is not installed")
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(300):
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
            time.sleep(0.1)
        saved = {k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
        os.environ.update(AWS_ENDPOINT_URL=url, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
        try:
            yield url
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            proc.terminate()
            proc.wait(timeout=10)

    @pytest.fixture
    def s3_bucket(s3_server: Any) -> Any:
        s3fs = pytest.importorskip("s3fs")
        s3fs.S3FileSystem.clear_instance_cache()
        bucket = f"statekit-fsdp-{uuid.uuid4().hex[:12]}"
        s3fs.S3FileSystem().mkdir(bucket)
        yield f"s3://{bucket}"
        s3fs.S3FileSystem.clear_instance_cache()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def fsdp_only() -> object:
    """In this process statekit runs with this plugin alone (the torchrun workers load
    every installed plugin, as a user's run does)."""
    import statekit_fsdp.plugin
    from statekit.hooks.registry import build_plugin_manager, use_plugin_manager

    pm = build_plugin_manager(autoload=False)
    pm.register(statekit_fsdp.plugin, name="fsdp")
    with use_plugin_manager(pm):
        yield pm
