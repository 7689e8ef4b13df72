"""Mode (d): statekit as a drop-in: ``Accelerator.save_state``/``load_state`` routed through
statekit, with no fallback to Accelerate's implementation.

The routing is the table of ``docs/migrating.md`` ("Replace the calls"), applied at every
call site of the test code:

* ``accelerator.save_state(dir)`` -> ``statekit.save_state(accelerator, dir)``;
* ``accelerator.load_state(dir)`` -> ``statekit.load_state(accelerator, dir)``;
* ``ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=N)`` +
  ``save_state()``/``load_state()`` -> ``manager = statekit.CheckpointManager(accelerator,
  f"{project_dir}/checkpoints", keep_last=N)``; ``manager.save()``/``manager.resume()``:
  one manager per accelerator, created at its first automatically named save or load.
  With automatic naming on, ``save_state(...)`` is ``manager.save()`` (the manager picks
  the step; like Accelerate, a directory passed to ``save_state`` is then ignored);
  ``load_state()`` without a directory is ``manager.resume()``, with a directory
  ``statekit.load_state(accelerator, dir)``. ``project_configuration.iteration`` is left
  to statekit (``statekit.save_state`` counts it up as ``Accelerator.save_state`` does).

Arguments statekit has no use for: ``safe_serialization`` (statekit never pickles) and
``load_kwargs``/``map_location`` (statekit loads into the prepared objects where they
are) are dropped; other keyword arguments of ``save_state``/``load_state`` are passed on
as statekit plugin options. Without a directory and without automatic naming,
``load_state`` raises Accelerate's ``ValueError`` and ``save_state`` a ``TypeError``
(Accelerate's ``os.makedirs(None)``).

Nothing calls Accelerate's own ``save_state``/``load_state``: the class attributes are
replaced by data descriptors, which also win over the instance attributes that
``statekit.attach`` installs (``CheckpointManager`` attaches), so a call can never reach
statekit's attach-mode wrapper and, through it, Accelerate.
"""

from __future__ import annotations

import functools
import os
import types
import weakref
from typing import Any

import pytest

import statekit
from conformance import common

pytest_plugins = ["conformance.common"]

MODE = "dropin"

_managers: weakref.WeakKeyDictionary[Any, statekit.CheckpointManager] = weakref.WeakKeyDictionary()


def pytest_report_header(config: pytest.Config) -> list[str]:
    return common.report_header(MODE, "Accelerator.save_state/load_state -> statekit.save_state/load_state/CheckpointManager")


def manager_of(accelerator: Any) -> statekit.CheckpointManager:
    """The accelerator's manager (created on first use) for automatic checkpoint naming."""
    manager = _managers.get(accelerator)
    if manager is None:
        config = accelerator.project_configuration
        root = os.path.join(accelerator.project_dir, "checkpoints")
        manager = statekit.CheckpointManager(accelerator, root, keep_last=config.total_limit)
        _managers[accelerator] = manager
        common.count("dropin_manager_created")
    return manager


def save_state(self: Any, output_dir: str | os.PathLike[str] | None = None, safe_serialization: bool = True, **options: Any) -> str:
    """``Accelerator.save_state`` replaced by statekit (see the module docstring)."""
    if "save_state" in self.__dict__:
        common.count("dropin_shadowed_instance_attribute")
    config = self.project_configuration
    if config.automatic_checkpoint_naming:
        manager = manager_of(self)
        common.count("dropin_manager_save")
        manifest = manager.save()
        return manager.url_for(manifest.step)
    if output_dir is None:
        raise TypeError("save_state() without output_dir needs automatic_checkpoint_naming (Accelerate: os.makedirs(None))")
    url = os.fspath(output_dir)
    common.count("dropin_save")
    statekit.save_state(self, url, **options)
    return url


def load_state(self: Any, input_dir: str | os.PathLike[str] | None = None, load_kwargs: dict[str, Any] | None = None, **options: Any) -> None:
    """``Accelerator.load_state`` replaced by statekit (see the module docstring)."""
    if "load_state" in self.__dict__:
        common.count("dropin_shadowed_instance_attribute")
    options.pop("map_location", None)
    if input_dir is not None:
        common.count("dropin_load")
        statekit.load_state(self, os.path.expanduser(os.fspath(input_dir)), **options)
        return
    if self.project_configuration.automatic_checkpoint_naming:
        common.count("dropin_manager_resume")
        if manager_of(self).resume() is None:
            raise ValueError(f"no committed checkpoint under {manager_of(self).root_url} to resume from")
        return
    raise ValueError("No input_dir provided and automatic checkpoint naming is disabled.")


class Routed:
    """A data descriptor for an ``Accelerator`` method: looked up before the instance
    ``__dict__``, so instance-level wrappers (``statekit.attach``) are bypassed."""

    def __init__(self, func: Any) -> None:
        self.func = func
        self.name = func.__name__
        functools.update_wrapper(self, func)

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self.func if obj is None else types.MethodType(self.func, obj)

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__[self.name] = value

    def __delete__(self, obj: Any) -> None:
        obj.__dict__.pop(self.name, None)


def pytest_configure(config: pytest.Config) -> None:
    from accelerate import Accelerator

    common.install_accelerate_counters()  # Accelerate's own save/load: must stay at 0
    common.patch(Accelerator, "save_state", Routed(save_state))
    common.patch(Accelerator, "load_state", Routed(load_state))
