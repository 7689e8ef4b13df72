"""``accelerate.skip_first_batches(loader, n)`` (the function) after a statekit resume.

Accelerate's resume idiom skips the consumed batches of the interrupted epoch by building a
new loader around the old one's batch sampler
(https://github.com/huggingface/accelerate/blob/main/src/accelerate/data_loader.py,
``skip_first_batches``); transformers' ``Trainer`` calls it too. After a statekit resume the
restored loader already continues at the saved batch, in the saved order: a new loader
built around its batch sampler would redraw the order and skip again, and the restored
position would wait for the next ``for`` over the old loader, which then replays the
interrupted epoch (10 batches instead of 13 in issue 27's case).

The method ``accelerator.skip_first_batches`` is wrapped per instance by
:func:`statekit.attach`. The function is imported by name into user code and into
transformers (``from accelerate import skip_first_batches``) before statekit is attached, so
rebinding module attributes would miss those names. :func:`install` therefore points the
function's code at :func:`_trampoline`, once per process: every existing name calls it.
It decides as the method does (:func:`statekit.loaders.data.skip_after_resume`): a tracked
loader whose restored position skips exactly ``n`` batches comes back itself (with a
warning); another ``n`` raises; any other call runs Accelerate's own function unchanged.
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
    """``accelerate.skip_first_batches``, except after a resume of a tracked loader.

    Args:
        dataloader: the loader (an Accelerate adapter or a torch ``DataLoader``).
        num_batches: batches to skip.

    Returns:
        ``dataloader`` itself when its restored position skips exactly ``num_batches``
        batches, else what Accelerate's function returns.

    Raises:
        StateMismatchError: the restored position skips another number of batches.
    """
    if data.skip_after_resume(dataloader, num_batches):
        return dataloader
    return _original(dataloader, num_batches)


def _trampoline(dataloader, num_batches=0):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN202
    # runs with accelerate.data_loader's globals: only builtins may be named here
    return __import__("statekit.api.skip_batches", fromlist=["skip_first_batches"]).skip_first_batches(dataloader, num_batches)
