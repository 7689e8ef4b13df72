"""A training loop that skips the consumed batches itself, after statekit positioned the loader.

Scripts written for Accelerate's own resume, which restarts the interrupted epoch, skip the
batches the checkpoint had consumed themselves. diffusers'
``examples/unconditional_image_generation/train_unconditional.py`` (huggingface/diffusers
58eb52c) does::

    for step, batch in enumerate(train_dataloader):
        if args.resume_from_checkpoint and epoch == first_epoch and step < resume_step:
            continue

With statekit attached the loader already continues after those batches, so that loop would
skip ``resume_step`` batches *more* (the rest of the epoch, often: a resumed run that trains
zero steps and exits 0). After an attached ``accelerator.load_state`` of a training run (a
model and an optimizer prepared), the first pass of each restored loader therefore watches
what the loop does with what it yields. A batch is *skipped* when the loop asks for the next
one after executing a ``continue`` statement and without training: no ``torch.nn.Module``
ran a forward and no optimizer stepped. While the loop skips, the first resumed batch is
yielded again (the same object: nothing is fetched, no random number drawn), at most as many
times as the checkpoint had consumed batches; so the loop's own skip lands on exactly the
batch the uninterrupted run trained next, at the same ``enumerate`` index. A loop that only
collects batches (``list(loader)``) executes no ``continue`` and is never held.

The ``continue`` is seen through line events of the frames iterating the loader (Python's
``frame.f_trace``, as ``pdb`` sets it), installed at the first yield and removed at the first
module forward or optimizer step (before a compiled model runs) or when the pass ends; a
tracer already installed (a debugger, coverage) is chained, not replaced.

Outcomes, by ``held`` (how many times the loop skipped) against ``consumed``:

- ``held == 0``: the loop does not skip (statekit's own resume idiom): nothing happens;
- ``held == consumed``: the loop's skip and statekit's position agree: exact, logged at INFO;
- ``0 < held < consumed``: it skipped fewer batches than were consumed (its own count of the
  position differs, or a wrapper reads ahead and asked before training): a
  :class:`statekit.StatekitWarning`, since the second case would train the batch twice;
- the loop still skips after ``consumed`` holds (it skips more than the checkpoint consumed):
  a :class:`statekit.StatekitWarning` naming the batches it skips; they are not trained.

The watch (a global module forward pre-hook and an optimizer step pre-hook) is put on at each
yield of the first pass after the load, until the loop trains, and taken off by the first
forward it sees, so the training step itself runs without it.
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
    """Watch the next pass of ``loader`` (a tracked loader with a restored position, as
    attach mode's ``load_state`` leaves it): see the module docstring. Does nothing for a loader
    without a restored position, or whose position was saved between two passes (an
    evaluation loader: a loop skipping its batches is none of the resume's business)."""
    position = getattr(loader, "__dict__", {}).get("_statekit_position")
    pending = position.pending if position is not None else None
    if pending is not None and (pending.get("batches") or pending.get("epoch_rng") is not None):
        pending[PENDING_KEY] = True


class _Activity:
    """Counts module forwards and optimizer steps between a held pass's yield and the first
    forward or step after it: the global hooks are put on at a yield (:meth:`arm`) and taken off
    by the first call they see, so the training step runs without them (a compiled model's
    graph is the uninterrupted run's)."""

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
        """The pass is about to yield a batch: mark the activity counter and trace the frames
        iterating the loader.

        Args:
            generator_frame: the pass's own frame (its ``f_back`` is the frame asking for batches).
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
