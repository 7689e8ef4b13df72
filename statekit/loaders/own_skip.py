"""A training loop that skips the consumed batches itself, after statekit positioned the loader.

Scripts written for Accelerate's resume skip in the loop (``continue`` while
``step < resume_step``: diffusers' ``train_unconditional.py``); statekit's loader already
continues after those batches. After an attached load of a training run, the first pass of a
restored loader yields the first resumed batch again while the loop executes ``continue``
without a module forward or an optimizer step (seen through ``frame.f_trace`` line events,
chained with a tracer already installed), at most ``consumed`` times. ``held == consumed`` is
logged at INFO; fewer or more is a :class:`statekit.StatekitWarning`.
Why: docs/design-notes.md, "Attach mode under the scripts users run".
"""

from __future__ import annotations

import linecache
import logging
import re
import sys
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from statekit.errors import StatekitWarning, warn_user

logger = logging.getLogger(__name__)

PENDING_KEY = "own_skip"
"""Key of a restored position (``Position.pending``) whose first pass is watched."""


def expect(loader: Any) -> None:
    """Watch the next pass of ``loader`` (a tracked loader with a restored position inside an
    epoch; a position saved between two passes is not watched).
    """
    position = getattr(loader, "__dict__", {}).get("_statekit_position")
    pending = position.pending if position is not None else None
    if pending is not None and (pending.get("batches") or pending.get("epoch_rng") is not None):
        pending[PENDING_KEY] = True


class _Activity:
    """Counts module forwards and optimizer steps after a held pass's yield (hooks on at
    :meth:`arm`, off at the first call they see).
    """

    def __init__(self) -> None:
        self.count = 0
        self._handles: list[Any] = []

    def arm(self) -> None:
        if not self._handles:
            self._handles = [
                torch.nn.modules.module.register_module_forward_pre_hook(self._seen_forward),
                register_optimizer_step_pre_hook(self._seen_step),
            ]

    def disarm(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _seen_forward(self, *_: Any) -> None:
        self._seen_step()
        self.disarm()  # Module._call_impl iterates a copy of the hook table: removing ours here is safe

    def _seen_step(self, *_: Any) -> None:
        # (Optimizer.step iterates the live table: the hooks come off at the next skipped()/close())
        self.count += 1
        for hold in list(_watching):  # training: stop tracing before the step runs on
            hold.untrace()


_activity = _Activity()
_watching: list[Hold] = []  # holds tracing their loop's frames now

_CONTINUE = re.compile(r"(?:^|:\s*)continue\s*(?:#.*)?$")
_continue_lines: dict[tuple[str, int], bool] = {}
_FRAMES_UP = 3  # the loop's frame may sit above a wrapper's generator (tqdm(loader), enumerate is C)


def _is_continue(frame: Any) -> bool:
    """The line ``frame`` is at is a ``continue`` statement (``continue``, ``if x: continue``)."""
    key = (frame.f_code.co_filename, frame.f_lineno)
    found = _continue_lines.get(key)
    if found is None:
        found = _continue_lines[key] = bool(_CONTINUE.search(linecache.getline(*key).strip()))
    return found


def _no_trace(frame: Any, event: str, arg: Any) -> None:
    """The global trace function while a hold traces and no other tracer is set: no frame
    but the loop's is traced (their ``f_trace`` is set directly)."""
    return None


class Hold:
    """The watch over one resumed pass (see the module docstring).

    Args:
        consumed: batches of the epoch the checkpoint had consumed (the most the loop may skip).
        name: the loader, for messages.
        epoch: the resumed epoch, for messages.
    """

    def __init__(self, consumed: int, name: str, epoch: int) -> None:
        self.consumed = consumed
        self.name = name
        self.epoch = epoch
        self.held = 0
        self.done = False
        self._mark = 0
        self._continued = False
        self._traced: dict[int, tuple[Any, Any]] = {}  # id(frame) -> (frame, its f_trace before)
        self._global_set = False

    def yielded(self, generator_frame: Any) -> None:
        """The pass is about to yield: mark the activity counter and trace the iterating frames.

        Args:
            generator_frame: the pass's own frame (its ``f_back`` asks for batches).
        """
        self._mark = _activity.count
        self._continued = False
        _activity.arm()
        frame, up = generator_frame.f_back, 0
        while frame is not None and up < _FRAMES_UP:
            self._trace(frame)
            frame, up = frame.f_back, up + 1

    def _trace(self, frame: Any) -> None:
        if id(frame) in self._traced:
            return
        if not self._traced and sys.gettrace() is None:
            sys.settrace(_no_trace)  # line events reach a frame's f_trace only while tracing is on
            self._global_set = True
        before = frame.f_trace

        def local(f: Any, event: str, arg: Any) -> Any:
            if event == "line" and _is_continue(f):
                self._continued = True
            if before is not None:
                before(f, event, arg)
            return local

        self._traced[id(frame)] = (frame, before)
        frame.f_trace = local
        if self not in _watching:
            _watching.append(self)

    def untrace(self) -> None:
        """Put back the frames' own trace functions (idempotent)."""
        for frame, before in self._traced.values():
            frame.f_trace = before
        self._traced.clear()
        if self._global_set:
            sys.settrace(None)
            self._global_set = False
        if self in _watching:
            _watching.remove(self)

    def skipped(self) -> bool:
        """Called when the loop asks for the next batch. True: the loop skipped the batch just
        yielded and the pass should yield it again; False: go on (and stop watching)."""
        if self.done:
            return False
        trained = _activity.count != self._mark
        _activity.disarm()  # armed again at the next yield
        if trained or not self._continued:
            self._finish()
            return False
        if self.held < self.consumed:
            self.held += 1
            self._mark = _activity.count
            self._continued = False
            return True
        warn_user(
            f"{self.name}: after the resume the training loop skipped {self.held + 1} batches of epoch {self.epoch} without "
            f"training (no module forward, no optimizer step), but the checkpoint had consumed {self.consumed}; statekit "
            f"already continues the epoch at batch {self.consumed}, so the loop now skips batches the uninterrupted run "
            f"trained (from batch {self.consumed} on). Its own skip of consumed batches (`continue` while step < "
            "resume_step) does not match the checkpoint: see docs/migrating.md, 'Scripts that skip consumed batches themselves'",
            StatekitWarning,
        )
        self._finish()
        return False

    def _finish(self) -> None:
        if self.held and self.held == self.consumed:
            logger.info("%s: the training loop skipped the %d batches consumed before the checkpoint itself; statekit "
                        "held batch %d of epoch %d until it trained on it (exact)", self.name, self.held, self.consumed, self.epoch)
        elif self.held:
            warn_user(
                f"{self.name}: after the resume the training loop skipped {self.held} batch{'es' if self.held > 1 else ''} "
                f"without training before it trained on batch {self.consumed} of epoch {self.epoch}, but the checkpoint had "
                f"consumed {self.consumed}: its own count of the consumed batches differs from the checkpoint's, or a "
                "wrapper around the loader reads ahead before the loop trains (then that batch was handed out twice); "
                "see docs/migrating.md, 'Scripts that skip consumed batches themselves'",
                StatekitWarning,
            )
        self.close()

    def close(self) -> None:
        """Stop watching (idempotent)."""
        self.untrace()
        self.done = True
        if not _watching:
            _activity.disarm()


def start(pending: dict[str, Any] | None, consumed: int, name: str, epoch: int) -> Hold | None:
    """The hold of a pass that resumes ``pending``, or None when the pass is not watched."""
    if not pending or not pending.get(PENDING_KEY):
        return None
    return Hold(consumed, name, epoch)
