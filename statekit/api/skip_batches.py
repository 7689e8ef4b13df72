"""``accelerate.skip_first_batches(loader, n)`` (the function,
https://github.com/huggingface/accelerate/blob/main/src/accelerate/data_loader.py) after a
statekit resume, whose restored loader already continues at the saved batch: the function
is imported by name before statekit is attached, so :func:`install` points its code at
:func:`_trampoline`, which decides as the per-instance method wrapper does
(:func:`statekit.loaders.data.skip_after_resume`; docs/design-notes.md, "The resume audit").
"""

from __future__ import annotations

import sys
import types
from typing import Any

from statekit.loaders import data

_original: Any = None


def install() -> None:
    """Route ``accelerate.data_loader.skip_first_batches`` through statekit (idempotent; a
    no-op when Accelerate is not imported or the function is not the one expected)."""
    global _original
    module = sys.modules.get("accelerate.data_loader")
    function = getattr(module, "skip_first_batches", None)
    if _original is not None or not isinstance(function, types.FunctionType) or function.__code__.co_freevars:
        return
    _original = types.FunctionType(function.__code__, function.__globals__, function.__name__, function.__defaults__)
    function.__code__ = _trampoline.__code__


def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
    """``accelerate.skip_first_batches``, except that a tracked loader whose restored
    position skips exactly ``num_batches`` batches comes back itself.

    Raises:
        StateMismatchError: the restored position skips another number of batches.
    """
    if data.skip_after_resume(dataloader, num_batches):
        return dataloader
    return _original(dataloader, num_batches)


def _trampoline(dataloader, num_batches=0):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN202
    # runs with accelerate.data_loader's globals: only builtins may be named here
    return __import__("statekit.api.skip_batches", fromlist=["skip_first_batches"]).skip_first_batches(dataloader, num_batches)
