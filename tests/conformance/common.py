"""What every conformance mode shares: class patching with undo, and per-test counters.

The counters go into the JUnit XML of the run as ``<property name="statekit.<name>"
value="<n>">`` of each test case (``item.user_properties``):

* ``accelerators``: ``Accelerator`` instances created by the test;
* ``accelerate_save_impl`` / ``accelerate_load_impl``: calls that reached Accelerate's own
  ``Accelerator.save_state``/``load_state`` implementation (in attach mode, through
  statekit's wrapper; in drop-in mode there must be none);
* ``statekit_attach_hook``, ``statekit_save_post``, ``statekit_load_post``: calls of the
  ``statekit_attach``, ``statekit_save_state_post`` and ``statekit_load_state_post``
  hooks, seen by :class:`Observer`, a statekit plugin that only counts (post-hooks run
  only after a committed save or a finished load, so they prove statekit was in the path);
* whatever the mode adds (``attach_calls``, ``dropin_save``...).

Mode modules list this module in ``pytest_plugins`` and call :func:`patch` and
:func:`count`; everything is undone in ``pytest_unconfigure``.
"""

from __future__ import annotations

import collections
import functools
from typing import Any

import pytest

import statekit

PROPERTY_PREFIX = "statekit."
"""Prefix of the JUnit properties written for each test."""

COUNTS: collections.Counter[str] = collections.Counter()
"""Counters of the running test (cleared before each test)."""

_undo: list[tuple[type, str, Any]] = []


def count(name: str, n: int = 1) -> None:
    """Add ``n`` to counter ``name`` of the running test."""
    COUNTS[name] += n


def patch(cls: type, name: str, value: Any) -> Any:
    """Set ``cls.<name>`` to ``value`` until ``pytest_unconfigure``; returns the attribute
    it replaces, as found in the class ``__dict__`` (the plain function)."""
    original = cls.__dict__[name]
    _undo.append((cls, name, original))
    setattr(cls, name, value)
    return original


def install_accelerate_counters() -> None:
    """Count ``Accelerator`` constructions and calls into Accelerate's own
    ``save_state``/``load_state`` (pass-through wrappers on the class)."""
    from accelerate import Accelerator

    def counting(name: str, counter: str) -> None:
        original = Accelerator.__dict__[name]

        @functools.wraps(original)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            count(counter)
            return original(self, *args, **kwargs)

        patch(Accelerator, name, wrapper)

    counting("__init__", "accelerators")
    counting("save_state", "accelerate_save_impl")
    counting("load_state", "accelerate_load_impl")


class Observer:
    """A statekit plugin that counts hook calls and does nothing else."""

    @statekit.hookimpl
    def statekit_attach(self, accelerator: Any) -> None:
        count("statekit_attach_hook")

    @statekit.hookimpl
    def statekit_save_state_post(self, output_dir: str) -> None:
        count("statekit_save_post")

    @statekit.hookimpl
    def statekit_load_state_post(self, input_dir: str) -> None:
        count("statekit_load_post")


OBSERVER_NAME = "statekit-conformance-observer"


def pytest_configure(config: pytest.Config) -> None:
    pm = statekit.get_plugin_manager()
    if pm.get_plugin(OBSERVER_NAME) is None:
        pm.register(Observer(), name=OBSERVER_NAME)


def pytest_unconfigure(config: pytest.Config) -> None:
    while _undo:
        cls, name, original = _undo.pop()
        setattr(cls, name, original)
    pm = statekit.get_plugin_manager()
    if pm.get_plugin(OBSERVER_NAME) is not None:
        pm.unregister(name=OBSERVER_NAME)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    COUNTS.clear()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    for name, value in sorted(COUNTS.items()):
        item.user_properties.append((PROPERTY_PREFIX + name, value))
    COUNTS.clear()


def report_header(mode: str, how: str) -> list[str]:
    """The ``pytest_report_header`` lines of a mode: which statekit copy it runs."""
    import accelerate

    return [
        f"statekit conformance mode: {mode}: {how}",
        f"statekit {statekit.__version__} from {statekit.__file__}; accelerate {accelerate.__version__}",
    ]
