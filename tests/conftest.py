"""Core test configuration: the statekit.testing fixtures (plugin managers, storage URLs, S3).

statekit.testing is also a ``pytest11`` entry point named ``statekit.testing``; pytest
registers a plugin once per name, so asking for it here is harmless when the entry point
is loaded and needed when it is not (``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1``, or statekit
not installed with its entry points).
"""

pytest_plugins = ["statekit.testing"]


import contextlib
import signal
import sys

import pytest

from statekit.testing import start_moto_server


@pytest.fixture
def frozen_s3():
    """A dedicated moto server this test may freeze with SIGSTOP (the environment is left
    alone: the test reaches it through ``storage_options``, with short timeouts), with a
    bucket ``frozen``; yields ``(server process, storage_options)``."""
    pytest.importorskip("moto")
    s3fs = pytest.importorskip("s3fs")
    with start_moto_server(environment=False) as server:
        options = {**server.storage_options,
                   "config_kwargs": {"connect_timeout": 1, "read_timeout": 1, "retries": {"max_attempts": 1}},
                   "skip_instance_cache": True}
        s3fs.S3FileSystem(**options).mkdir("frozen")
        try:
            yield server.process, options
        finally:  # a stopped server ignores SIGTERM until continued
            with contextlib.suppress(ProcessLookupError):
                server.process.send_signal(signal.SIGCONT)


def pytest_configure(config):
    """Under pytest-xdist (``make test-fast``: ``-n 2``) each worker computes with one torch
    thread: two workers with a thread per core each oversubscribe the cores, and OpenMP
    threads waiting on each other turn a 3 s training test into a minute."""
    if hasattr(config, "workerinput"):
        import torch

        torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """Every test starts with Accelerate's process-wide state reset (``AcceleratorState`` and
    ``GradientState`` are shared singletons): an earlier test's ``gradient_accumulation_steps``
    would otherwise make a later ``Accelerator()`` skip optimizer steps, depending on which
    tests an xdist worker ran before."""
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(True)
        state.GradientState._reset_state()
    yield
