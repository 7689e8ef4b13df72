"""Mode (c): ``statekit.attach(accelerator)`` once, after the first ``prepare()`` of each
``Accelerator`` (what ``docs/migrating.md`` shows: prepare, then attach).

``attach`` is idempotent per accelerator: a second call returns the first attachment and
changes nothing, so calling it again after later ``prepare()`` calls would add nothing;
it is called once. Whether objects prepared after ``attach`` join the attachment (their
loaders tracked, ``statekit_attach`` run for them) is statekit's business (``attach``
once took its object table only when called; it now also wraps the instance's
``prepare`` for that). Later ``prepare()`` calls of an attached accelerator are counted
(``prepare_after_attach``), so that a failure involving objects prepared after ``attach``
can be told apart.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import pytest

import statekit
from conformance import common

pytest_plugins = ["conformance.common"]

MODE = "attach_prepare"

_attached: weakref.WeakSet[Any] = weakref.WeakSet()


def pytest_report_header(config: pytest.Config) -> list[str]:
    return common.report_header(MODE, "statekit.attach(accelerator) once, after its first Accelerator.prepare")


def pytest_configure(config: pytest.Config) -> None:
    from accelerate import Accelerator

    common.install_accelerate_counters()
    original = Accelerator.__dict__["prepare"]

    @functools.wraps(original)
    def prepare(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        if self in _attached:
            common.count("prepare_after_attach")
        else:
            _attached.add(self)
            common.count("attach_calls")
            statekit.attach(self)
        return result

    common.patch(Accelerator, "prepare", prepare)
