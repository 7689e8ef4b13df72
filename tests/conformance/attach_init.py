"""Mode (b): ``statekit.attach(accelerator)`` right after every ``Accelerator.__init__``.

The earliest moment a user can attach: nothing is prepared yet, so the attachment's
object table (data loaders to track, objects handed to the ``statekit_attach`` hooks) is
empty; only the hooks and the ``save_state``/``load_state`` wrappers are in place.
Accelerate's tests must behave exactly as without statekit.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest

import statekit
from conformance import common

pytest_plugins = ["conformance.common"]

MODE = "attach_init"


def pytest_report_header(config: pytest.Config) -> list[str]:
    return common.report_header(MODE, "statekit.attach(accelerator) after every Accelerator.__init__")


def pytest_configure(config: pytest.Config) -> None:
    from accelerate import Accelerator

    common.install_accelerate_counters()
    counted_init = Accelerator.__dict__["__init__"]

    @functools.wraps(counted_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        counted_init(self, *args, **kwargs)
        common.count("attach_calls")
        statekit.attach(self)

    common.patch(Accelerator, "__init__", __init__)
