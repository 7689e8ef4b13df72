"""pytest fixtures for statekit and its plugins: plugin managers, storage URLs, S3 (moto), state comparison.

Registered as a pytest plugin through the ``pytest11`` entry point, or explicitly with
``pytest_plugins = ["statekit.testing"]`` in a ``conftest.py``. Importing this module is
cheap: torch, statekit's engine, moto, boto and s3fs are imported inside the fixtures
that need them, never at import time (every pytest run in an environment with statekit
loads it).

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

S3 access: s3fs (2024.6 and later, with botocore >= 1.31) reads ``AWS_ENDPOINT_URL``
from the environment, so ``fsspec``/``statekit`` calls on ``s3://`` URLs reach the moto
server with no ``storage_options``. With an older s3fs pass
``storage_options=s3_server.storage_options``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest

__all__ = [
    "S3Server",
    "TinyAccelerate",
    "assert_state_equal",
    "installed_plugin_manager",
    "plugin_manager",
    "s3_bucket",
    "s3_server",
    "storage_url",
    "tiny_accelerate",
]

S3_ACCESS_KEY = "testing"
"""Access key id (and secret) the moto server accepts; moto accepts any."""

S3_STARTUP_SECONDS = 30.0
"""How long :func:`s3_server` waits for the moto server to answer HTTP, seconds."""


def pytest_configure(config: pytest.Config) -> None:
    """Register the ``s3`` marker carried by the S3 case of ``storage_url``."""
    config.addinivalue_line("markers", "s3: needs the moto S3 server (statekit.testing)")


# --------------------------------------------------------------------------- plugin managers


@pytest.fixture
def plugin_manager() -> Iterator[Any]:
    """A fresh :class:`statekit.hooks.registry.PluginManager` with no entry points loaded,
    installed as the process-wide manager for the duration of the test.

    Register throwaway plugins on it (``plugin_manager.register(Plugin(), name="x")``);
    ``statekit.save``/``load`` use it. The environment switches
    (``STATEKIT_DISABLE_PLUGINS``, ``STATEKIT_TRACE_PLUGINS``) are read when it is built.
    """
    from statekit.hooks.registry import build_plugin_manager, use_plugin_manager

    pm = build_plugin_manager(autoload=False)
    with use_plugin_manager(pm):
        yield pm


@pytest.fixture
def installed_plugin_manager() -> Iterator[Any]:
    """A fresh plugin manager with every installed entry point of group ``statekit``
    loaded (``autoload=True``), installed as the process-wide manager for the test."""
    from statekit.hooks.registry import build_plugin_manager, use_plugin_manager

    pm = build_plugin_manager(autoload=True)
    with use_plugin_manager(pm):
        yield pm


# --------------------------------------------------------------------------- S3 (moto)


@dataclass
class S3Server:
    """A running moto S3 server (yielded by the ``s3_server`` fixture).

    Attributes:
        endpoint_url: ``http://127.0.0.1:<port>``.
        port: the TCP port.
        process: the server's ``subprocess.Popen``.
    """

    endpoint_url: str
    port: int
    process: Any = field(repr=False, default=None)
    _fs: Any = field(repr=False, default=None)

    def filesystem(self) -> Any:
        """An ``s3fs.S3FileSystem`` on this server, created once and kept out of s3fs's
        instance cache (so clearing that cache does not cost a new client here).

        Raises:
            ImportError: s3fs is not installed.
        """
        if self._fs is None:
            import s3fs

            self._fs = s3fs.S3FileSystem(**self.storage_options, skip_instance_cache=True)
        return self._fs

    @property
    def storage_options(self) -> dict[str, Any]:
        """fsspec ``storage_options`` that reach this server without the environment
        (``client_kwargs.endpoint_url`` plus the test credentials; no ``region_name``,
        with which moto rejects bucket creation)."""
        return {"client_kwargs": {"endpoint_url": self.endpoint_url}, "key": S3_ACCESS_KEY, "secret": S3_ACCESS_KEY}


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


_S3_ENV = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")
_S3_ENV_CLEARED = ("AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL_S3")


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """Start ``python -m moto.server`` on a free local port for the test session.

    Sets ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID=testing``,
    ``AWS_SECRET_ACCESS_KEY=testing``, ``AWS_DEFAULT_REGION=us-east-1`` (and clears
    ``AWS_SESSION_TOKEN``/``AWS_PROFILE``/``AWS_ENDPOINT_URL_S3``), restoring the previous
    environment at the end. Creates no bucket (see ``s3_bucket``).

    Yields:
        An :class:`S3Server` with ``.endpoint_url``.

    Skips:
        When moto is not installed (``pip install "moto[server]"``).

    Raises:
        RuntimeError: the server did not start (its output is in the message).
    """
    if importlib.util.find_spec("moto") is None:
        pytest.skip('moto is not installed (pip install "moto[server]"): S3 tests need its server')
    port = _free_port()
    endpoint_url = f"http://127.0.0.1:{port}"
    log = tempfile.TemporaryFile()
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    saved = {name: os.environ.get(name) for name in (*_S3_ENV, *_S3_ENV_CLEARED, "NO_PROXY", "no_proxy")}
    try:
        problem = _wait_for_http(endpoint_url, process, S3_STARTUP_SECONDS)
        if problem is not None:
            log.seek(0)
            output = log.read().decode("utf-8", "replace")[-4000:]
            raise RuntimeError(f"moto S3 server on port {port} {problem}; its output:\n{output}")
        os.environ.update(
            AWS_ENDPOINT_URL=endpoint_url,
            AWS_ACCESS_KEY_ID=S3_ACCESS_KEY,
            AWS_SECRET_ACCESS_KEY=S3_ACCESS_KEY,
            AWS_DEFAULT_REGION="us-east-1",
        )
        for name in _S3_ENV_CLEARED:
            os.environ.pop(name, None)
        for name in ("NO_PROXY", "no_proxy"):  # a proxy must not intercept the local server
            os.environ[name] = ",".join(p for p in (saved[name], "127.0.0.1", "localhost") if p)
        _clear_s3fs_cache()
        yield S3Server(endpoint_url, port, process)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        _clear_s3fs_cache()
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def _clear_s3fs_cache() -> None:
    s3fs = sys.modules.get("s3fs")
    if s3fs is not None:
        s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> Iterator[str]:
    """A fresh, empty bucket on the moto server, as ``"s3://<bucket>"``.

    s3fs's instance cache is cleared before and after, so every test starts with a new
    filesystem object (no stale listings); the bucket is deleted afterwards.

    Skips:
        When s3fs is not installed (``pip install "statekit[s3]"``).
    """
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
            import fsspec

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
def assert_state_equal_fixture() -> Any:
    """:func:`assert_state_equal` as a fixture (no import needed in the test module)."""
    return assert_state_equal


def assert_state_equal(a: Any, b: Any, path: str = "state") -> None:
    """Assert that two nested states are exactly equal, naming the first difference.

    Rules (stricter than ``==``):

    * tensors: both ``torch.Tensor``, same dtype, same shape and identical bytes
      (so NaN equals NaN with the same bits, ``-0.0`` differs from ``0.0``; bool tensors
      compare by value; compared on the CPU, device and ``requires_grad`` are ignored);
    * NumPy arrays and scalars: same type, dtype, shape and bytes;
    * floats: equal, or both NaN; the sign of zero must match;
    * mappings: same keys in the same order with the same key types (``1`` vs ``"1"``
      vs ``True`` differ); any two mappings compare by items (a ``dict`` equals an
      ``OrderedDict`` or a lazy state dict with the same items in the same order);
    * lists, tuples, ``torch.Size``, sets, frozensets: the exact type must match;
    * everything else: the exact type must match and ``==`` must hold.

    Args:
        a: the expected state.
        b: the actual state.
        path: the name of the root in messages (``state['optim'][0]``).

    Raises:
        AssertionError: the states differ; the message gives the key path of the first
            difference and both values.
    """
    __tracebackhide__ = True
    problem = _first_difference(a, b, path)
    if problem is not None:
        raise AssertionError(problem)


def _short(v: Any, limit: int = 200) -> str:
    text = repr(v)
    return text if len(text) <= limit else text[:limit] + "..."


def _type_name(v: Any) -> str:
    t = type(v)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _first_difference(a: Any, b: Any, path: str) -> str | None:
    torch = sys.modules.get("torch")
    np = sys.modules.get("numpy")
    if torch is not None and (isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor)):
        return _tensor_difference(torch, a, b, path)
    if np is not None and (isinstance(a, (np.ndarray, np.generic)) or isinstance(b, (np.ndarray, np.generic))):
        return _numpy_difference(np, a, b, path)
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return _mapping_difference(a, b, path)
    if type(a) is not type(b):
        return f"{path}: type {_type_name(a)} != {_type_name(b)} ({_short(a)} vs {_short(b)})"
    if isinstance(a, float):
        if math.isnan(a) and math.isnan(b):
            return None
        if a != b or math.copysign(1.0, a) != math.copysign(1.0, b):
            return f"{path}: {a!r} != {b!r}"
        return None
    if isinstance(a, (list, tuple)):  # includes torch.Size (same type checked above)
        if len(a) != len(b):
            return f"{path}: length {len(a)} != {len(b)} ({_short(a)} vs {_short(b)})"
        for i, (x, y) in enumerate(zip(a, b)):
            problem = _first_difference(x, y, f"{path}[{i}]")
            if problem is not None:
                return problem
        return None
    if isinstance(a, (set, frozenset)):
        if a != b:
            return f"{path}: {_type_name(a)} differs: only in first {_short(a - b)}, only in second {_short(b - a)}"
        return None
    try:
        equal = bool(a == b)
    except Exception as exc:  # an object whose == raises
        return f"{path}: cannot compare {_short(a)} and {_short(b)}: {type(exc).__name__}: {exc}"
    return None if equal else f"{path}: {_short(a)} != {_short(b)}"


def _mapping_difference(a: Mapping[Any, Any], b: Mapping[Any, Any], path: str) -> str | None:
    keys_a, keys_b = list(a), list(b)
    typed_a = [(type(k), k) for k in keys_a]
    typed_b = [(type(k), k) for k in keys_b]
    if typed_a != typed_b:
        only_a = [k for k in keys_a if (type(k), k) not in typed_b]
        only_b = [k for k in keys_b if (type(k), k) not in typed_a]
        if only_a or only_b:
            return f"{path}: keys differ: only in first {_short(only_a)}, only in second {_short(only_b)}"
        for x, y in zip(keys_a, keys_b):
            if type(x) is not type(y) or x != y:
                break
        return f"{path}: key order differs: {_short(keys_a)} vs {_short(keys_b)}"
    for k in keys_a:
        problem = _first_difference(a[k], b[k], f"{path}[{k!r}]")
        if problem is not None:
            return problem
    return None


def _tensor_difference(torch: Any, a: Any, b: Any, path: str) -> str | None:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return f"{path}: type {_type_name(a)} != {_type_name(b)}"
    if a.dtype != b.dtype:
        return f"{path}: dtype {a.dtype} != {b.dtype}"
    if tuple(a.shape) != tuple(b.shape):
        return f"{path}: shape {list(a.shape)} != {list(b.shape)} ({a.dtype})"
    if a.device.type == "meta" or b.device.type == "meta":
        return None if a.device.type == b.device.type else f"{path}: device {a.device} != {b.device}"
    if a.dtype == torch.bool:  # compare values: a bool's byte may be any non-zero value
        if torch.equal(_flat(torch, a), _flat(torch, b)):
            return None
        ba, bb = _flat(torch, a), _flat(torch, b)
    else:
        ba, bb = _tensor_bytes(torch, a), _tensor_bytes(torch, b)
        if torch.equal(ba, bb):
            return None
    first = int(torch.nonzero(ba != bb)[0, 0]) // max(1, a.element_size())
    flat_a, flat_b = _flat(torch, a), _flat(torch, b)
    try:
        detail = f"first difference at flat index {first}: {flat_a[first].item()!r} vs {flat_b[first].item()!r}"
    except (RuntimeError, TypeError):  # dtypes without .item() (fp4, some fp8)
        detail = f"first difference at flat index {first}"
    return f"{path}: tensors differ ({a.dtype}, shape {list(a.shape)}); {detail}"


def _flat(torch: Any, t: Any) -> Any:
    return t.detach().to("cpu").resolve_conj().resolve_neg().contiguous().reshape(-1)


def _tensor_bytes(torch: Any, t: Any) -> Any:
    flat = _flat(torch, t)
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    return flat.view(torch.uint8)


def _numpy_difference(np: Any, a: Any, b: Any, path: str) -> str | None:
    if type(a) is not type(b):
        return f"{path}: type {_type_name(a)} != {_type_name(b)} ({_short(a)} vs {_short(b)})"
    if a.dtype != b.dtype:
        return f"{path}: NumPy dtype {a.dtype} != {b.dtype}"
    if a.shape != b.shape:
        return f"{path}: NumPy shape {list(a.shape)} != {list(b.shape)}"
    if a.dtype.hasobject:
        return None if np.array_equal(a, b) else f"{path}: object arrays differ"
    if np.ascontiguousarray(a).tobytes() != np.ascontiguousarray(b).tobytes():
        return f"{path}: NumPy values differ ({a.dtype}, shape {list(a.shape)}): {_short(a)} vs {_short(b)}"
    return None


# --------------------------------------------------------------------------- a tiny Accelerate run


@dataclass
class TinyAccelerate:
    """A small prepared Accelerate training setup (yielded by the ``tiny_accelerate`` fixture).

    Attributes:
        accelerator: a CPU ``accelerate.Accelerator`` (fresh state).
        model: a prepared ``Linear(4, 8) -> ReLU -> Dropout(0.1) -> Linear(8, 2)`` model.
        optimizer: a prepared ``torch.optim.AdamW`` (lr 1e-2) over the model's parameters.
        loader: a prepared, shuffled ``DataLoader`` of 32 samples (4 features, 2 classes) in
            batches of 4.
        scheduler: a prepared ``LambdaLR`` with a linear decay over 100 steps.
    """

    accelerator: Any
    model: Any
    optimizer: Any
    loader: Any
    scheduler: Any

    def train_step(self, batch: Any) -> float:
        """Run one optimisation step (cross-entropy loss) on a batch of the loader.

        Args:
            batch: a ``(inputs, targets)`` batch yielded by :attr:`loader`.

        Returns:
            The loss of the step, as a float.
        """
        import torch

        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.model(x), y)
        self.accelerator.backward(loss)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad()
        return float(loss.detach())


@pytest.fixture
def tiny_accelerate() -> Iterator[TinyAccelerate]:
    """A prepared CPU Accelerate run: tiny model, AdamW, shuffled loader, ``LambdaLR``.

    Seeded (``accelerate.utils.set_seed(0)``), so two uses in one test build identical
    runs. Accelerate's process-wide state is reset before and after, so each test gets a
    fresh ``Accelerator``. accelerate is imported here, not at module import.

    Yields:
        A :class:`TinyAccelerate`.

    Skips:
        When accelerate is not installed (``pip install "statekit[accelerate]"``).
    """
    pytest.importorskip("accelerate", reason='accelerate is not installed (pip install "statekit[accelerate]")')
    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import set_seed

    def reset() -> None:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()

    reset()
    set_seed(0)
    try:
        accelerator = Accelerator(cpu=True)
        g = torch.Generator().manual_seed(1234)
        x = torch.randn(32, 4, generator=g)
        y = torch.randint(0, 2, (32,), generator=g)
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4, shuffle=True)
        model = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(8, 2)
        )
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: max(0.0, 1.0 - step / 100))
        model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
        yield TinyAccelerate(accelerator, model, optimizer, loader, scheduler)
    finally:
        reset()
