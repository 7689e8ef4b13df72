"""The one S3 test-server starter: ``python -m moto.server`` on a free local port.

Used by the ``s3_server`` fixture, the fault-injection tests (a server of their own they
freeze with SIGSTOP) and the demos' ``--moto`` option. Importing this module is cheap:
s3fs is imported only by :meth:`S3Server.filesystem`, and moto runs in its own process.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import IO, Any

__all__ = ["S3_ACCESS_KEY", "S3_STARTUP_SECONDS", "S3Server", "start_moto_server"]

S3_ACCESS_KEY = "testing"
"""Access key id (and secret) the moto server accepts; moto accepts any."""

S3_STARTUP_SECONDS = 30.0
"""How long :func:`start_moto_server` waits for the moto server to answer HTTP, seconds."""

_S3_ENV = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")
_S3_ENV_CLEARED = ("AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL_S3")
_NO_PROXY = ("NO_PROXY", "no_proxy")


@dataclass
class S3Server:
    """A running moto S3 server (returned by :func:`start_moto_server`, yielded by the
    ``s3_server`` fixture). A context manager: leaving the ``with`` block calls :meth:`stop`.

    Attributes:
        endpoint_url: ``http://127.0.0.1:<port>``.
        port: the TCP port.
        process: the server's ``subprocess.Popen``.
    """

    endpoint_url: str
    port: int
    process: Any = field(repr=False, default=None)
    _fs: Any = field(repr=False, default=None)
    _log: IO[bytes] | None = field(repr=False, default=None)
    _saved_env: dict[str, str | None] | None = field(repr=False, default=None)

    def filesystem(self) -> Any:
        """An ``s3fs.S3FileSystem`` on this server, made once and kept out of s3fs's instance cache.

        Raises:
            ImportError: s3fs is not installed.
        """
        if self._fs is None:
            import s3fs  # here, not at module level: `import statekit.testing` stays light

            self._fs = s3fs.S3FileSystem(**self.storage_options, skip_instance_cache=True)
        return self._fs

    @property
    def storage_options(self) -> dict[str, Any]:
        """fsspec ``storage_options`` that reach this server without the environment
        (``client_kwargs.endpoint_url`` plus the test credentials; no ``region_name``,
        with which moto rejects bucket creation)."""
        return {"client_kwargs": {"endpoint_url": self.endpoint_url}, "key": S3_ACCESS_KEY, "secret": S3_ACCESS_KEY}

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 10 s) and restore the ``AWS_*``
        environment :func:`start_moto_server` changed. Calling it twice is harmless.

        A server stopped with SIGSTOP must be continued (SIGCONT) first, or the SIGTERM
        waits the 10 s out.
        """
        if self._saved_env is not None:
            _restore_environment(self._saved_env)
            self._saved_env = None
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> S3Server:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def start_moto_server(*, environment: bool = True, startup_seconds: float = S3_STARTUP_SECONDS) -> S3Server:
    """Start ``python -m moto.server -H 127.0.0.1 -p <free port>`` and wait up to
    ``startup_seconds`` until it answers; creates no bucket, clears s3fs's instance cache on start
    and stop. A context manager, or call :meth:`S3Server.stop`.

    With ``environment`` the process (and its children) reach the server with no
    ``storage_options``: ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY=testing``,
    ``AWS_DEFAULT_REGION=us-east-1`` set, ``AWS_SESSION_TOKEN``, ``AWS_SECURITY_TOKEN``,
    ``AWS_PROFILE``, ``AWS_ENDPOINT_URL_S3`` cleared, ``127.0.0.1,localhost`` added to ``NO_PROXY``,
    all restored by :meth:`S3Server.stop`; without it use :attr:`S3Server.storage_options`.

    Raises:
        ModuleNotFoundError: moto is not installed (``pip install "moto[server]"``).
        RuntimeError: the server exited or did not answer in time (its output is in the
            message); it is stopped.
    """
    if importlib.util.find_spec("moto") is None:
        raise ModuleNotFoundError('moto is not installed (pip install "moto[server]"): the S3 test server needs it')
    port = _free_port()
    log = tempfile.TemporaryFile()
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    server = S3Server(f"http://127.0.0.1:{port}", port, process, _log=log)
    problem = _wait_for_http(server.endpoint_url, process, startup_seconds)
    if problem is not None:
        log.seek(0)
        output = log.read().decode("utf-8", "replace")[-4000:]
        server.stop()
        raise RuntimeError(f"moto S3 server on port {port} {problem}; its output:\n{output}")
    if environment:
        server._saved_env = _point_environment_at(server.endpoint_url)
    _clear_s3fs_cache()
    return server


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_for_http(url: str, process: subprocess.Popen, timeout_s: float) -> str | None:
    """Poll ``url`` until it answers; returns None when up, else why not."""
    deadline = time.monotonic() + timeout_s
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through a proxy
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return f"exited with status {process.returncode}"
        try:
            with opener.open(url, timeout=1):
                return None
        except urllib.error.HTTPError:
            return None  # it answered, with an error status: it is up
        except (urllib.error.URLError, OSError):
            time.sleep(0.1)
    return f"did not answer within {timeout_s:.0f} s"


def _point_environment_at(endpoint_url: str) -> dict[str, str | None]:
    """Set the ``AWS_*`` environment for ``endpoint_url``; returns the previous values."""
    saved = {name: os.environ.get(name) for name in (*_S3_ENV, *_S3_ENV_CLEARED, *_NO_PROXY)}
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint_url,
        AWS_ACCESS_KEY_ID=S3_ACCESS_KEY,
        AWS_SECRET_ACCESS_KEY=S3_ACCESS_KEY,
        AWS_DEFAULT_REGION="us-east-1",
    )
    for name in _S3_ENV_CLEARED:
        os.environ.pop(name, None)
    for name in _NO_PROXY:  # a proxy must not intercept the local server
        os.environ[name] = ",".join(p for p in (saved[name], "127.0.0.1", "localhost") if p)
    return saved


def _restore_environment(saved: dict[str, str | None]) -> None:
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    _clear_s3fs_cache()


def _clear_s3fs_cache() -> None:
    s3fs = sys.modules.get("s3fs")  # only if already imported: never import it here
    if s3fs is not None:
        s3fs.S3FileSystem.clear_instance_cache()
