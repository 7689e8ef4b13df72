"""Async saves under a host-memory budget: the state streams through a ring of host buffers
(at most the budget) while the writer drains them, instead of one arena the size of the state.

What is copied when (docs/design-notes.md, "Async saves"): tensors only an optimizer step
writes (the parameters in an optimizer's ``param_groups``, the optimizer's state) are staged
after the save call returned, by a stager thread, under an open
:class:`~statekit.engine.step_barrier.Reading` (every ``optimizer.step()`` waits until they are
all staged); every other tensor (buffers such as BatchNorm statistics, gradients, a tensor not
in any optimizer) changes without a step, so it is copied during the call. Each tensor staged
late is compared, once copied, with its version counter at the call
(:mod:`statekit.checks.versions`): an in-place write in between fails the save, nothing is
committed. The file bytes are the same as a synchronous save's: the header first, then each
tensor's bytes in file order (a tensor larger than a piece in several pieces), hashed by the
writer as it writes them (:func:`statekit.format.tensors.write_tensors`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from statekit.checks.versions import changed_since, versions
from statekit.engine.step_barrier import Reading, begin_reading
from statekit.errors import InvalidOptionError, StatekitError
from statekit.format.tensors import is_accelerator, plan_file
from statekit.storage.streams import CHUNK_BYTES

logger = logging.getLogger(__name__)

MIN_BUDGET_BYTES = 64 * 1024
"""The smallest budget in bytes (a ring of four 8 KiB pieces); a fraction of a smaller state is raised to it."""

RESERVED_BYTES = 96 * 1024 * 1024
"""The part of a budget, bytes (at most half of it), left to the save's host memory outside
the ring: the writer's buffers (``(DIRECT_DEPTH + 1) x 4 MiB`` through ``O_DIRECT``) and its
transient allocations, measured at 40-90 MiB above the ring on the benchmark VM
(docs/benchmark.md, "Async saves under a host-memory budget"): so that the budget bounds
the save's peak extra RSS, not only its staging buffers."""

STALLED_AFTER_S = 300.0
"""Seconds the stager waits for the writer to give a piece back before it gives the save up
(an ``AsyncSaveError``), so that the optimizer steps waiting for it go on: storage that
stalls never stops training (docs/backpressure.md); half the NCCL watchdog's 600 s."""

PIECE_ALIGN = 4096
"""Pieces are multiples of this many bytes and start on such a boundary (``O_DIRECT`` pages)."""


def check_host_memory_budget(value: Any, what: str = "host_memory_budget") -> None:
    """Refuse a budget that is not None, an int of bytes >= :data:`MIN_BUDGET_BYTES`, or a
    float fraction of the state in (0, 1].

    Raises:
        InvalidOptionError: naming ``what`` and the value.
    """
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidOptionError(
            f"{what} must be a number of bytes (int), a fraction of the state in (0, 1] (float) or None, got {value!r}")
    if isinstance(value, float) and not 0.0 < value <= 1.0:
        raise InvalidOptionError(f"{what} as a fraction of the state must be in (0, 1], got {value!r}")
    if isinstance(value, int) and value < MIN_BUDGET_BYTES:
        raise InvalidOptionError(f"{what} must be at least {MIN_BUDGET_BYTES} bytes (64 KiB), got {value!r}")


def budget_bytes(value: int | float, state_bytes: int) -> int:
    """The budget in bytes: ``value`` itself (int), or that fraction of ``state_bytes`` (float),
    never below :data:`MIN_BUDGET_BYTES`."""
    if isinstance(value, float):
        return max(MIN_BUDGET_BYTES, int(value * state_bytes))
    return int(value)


def ring_bytes(budget: int) -> int:
    """The bytes the ring (pieces and copies made during the call) may hold under ``budget``:
    the budget less :data:`RESERVED_BYTES`, or half of it when it is smaller."""
    return budget - min(RESERVED_BYTES, budget // 2)


def piece_bytes(ring: int) -> int:
    """The size of one piece of a ring of ``ring`` bytes: a quarter of it (so the stager fills
    pieces while the writer drains others), in whole pages, at most ``CHUNK_BYTES`` (16 MiB)."""
    return max(PIECE_ALIGN, min(CHUNK_BYTES, ring // 4) // PIECE_ALIGN * PIECE_ALIGN)


def protected_storages(optimizers: Iterable[Any]) -> set[int]:
    """The storage addresses of what only ``optimizer.step()`` writes: every parameter of the
    optimizers' ``param_groups`` and every tensor of their ``state`` (an object without these
    attributes is skipped)."""
    found: set[int] = set()
    for opt in optimizers:
        for group in getattr(opt, "param_groups", None) or ():
            found.update(_storage(p) for p in group.get("params", ()) if isinstance(p, torch.Tensor))
        for per_param in (getattr(opt, "state", None) or {}).values():
            values = per_param.values() if isinstance(per_param, Mapping) else ()
            found.update(_storage(t) for t in values if isinstance(t, torch.Tensor))
    found.discard(0)
    return found


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr() if t.numel() else 0


@dataclass
class _Part:
    """One stored tensor of a streamed file: copied during the call (``held``), or by the
    stager (``version`` recorded at the call)."""

    name: str
    tensor: torch.Tensor
    nbytes: int
    held: torch.Tensor | None = None
    version: int | None = None


@dataclass
class _File:
    rel: str
    parts: list[_Part]
    data_bytes: int


class BudgetStream:
    """One async save's staging under a budget (made by :meth:`StagingPool.begin_budget`).

    Thread-safety: :meth:`stage` and :meth:`start` run on the caller's thread; the stager
    thread fills pieces; the writer thread takes them through each file's chunks in the
    order the files were staged; :meth:`stop` (the pool's ``release``) may run on either.

    Args:
        ring: the pool's :class:`PieceRing` (its pieces outlive the save).
        budget: None-free budget value (int bytes or float fraction), checked already.
        protected: :func:`protected_storages` of the save's optimizers.
        label: what reads, for the step barrier's log (``"async save to <url>"``).
    """

    def __init__(self, ring: PieceRing, budget: int | float, protected: set[int], label: str) -> None:
        self.ring = ring
        self.budget = budget
        self.protected = protected
        self.label = label
        self.files: list[_File] = []
        self.reading: Reading = begin_reading(label)
        self.error: BaseException | None = None
        """The stager's error (a tensor changed before it was staged), once it failed."""
        self._thread: threading.Thread | None = None

    def stage(self, rel: str, tensors: Mapping[str, torch.Tensor]) -> StreamedTensors:
        """Plan file ``rel``: copy its tensors that change without an optimizer step now
        (host memory counted by the ring), record the others' versions for the stager.

        Returns:
            ``name -> tensor`` (the live tensors) whose ``stream()`` yields the file's data
            section in order, for :func:`statekit.format.tensors.write_tensors`.
        """
        _, planned = plan_file(tensors, None)  # names, order and tied views, as the writer plans them
        parts = []
        with torch.no_grad():
            for p in planned:
                part = _Part(p.name, p.tensor, p.nbytes)
                if p.nbytes and _late(p.tensor, self.protected):
                    part.version = versions({p.name: p.tensor})[p.name]
                elif p.nbytes:
                    part.held = self.ring.hold_copy(p.tensor)
                parts.append(part)
        file = _File(rel, parts, sum(p.nbytes for p in parts))
        self.files.append(file)
        streamed = StreamedTensors(tensors)
        streamed.stream = lambda: self.ring.chunks(file.data_bytes)
        return streamed

    def start(self) -> None:
        """Size the ring for the budget and start the stager thread (the call returns next)."""
        state = sum(f.data_bytes for f in self.files)
        self.ring.size_for(ring_bytes(budget_bytes(self.budget, state)))
        self._thread = threading.Thread(target=self._stage_all, name=f"statekit-stage {self.label}", daemon=True)
        self._thread.start()

    def staged(self) -> None:
        """Wait for the stager (the writer has taken every byte) and raise its error: the
        last version check ends before anything is committed.

        Raises:
            StatekitError: a tensor was modified in place before it was staged (names the
                file and the tensor).
        """
        if self._thread is not None:
            self._thread.join()
        if self.error is not None:
            raise self.error

    def stop(self) -> None:
        """End the stager (the save is written, or failed) and the step barrier's reading."""
        self.ring.cancel()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self.reading.done()
        self.ring.reset()

    def _stage_all(self) -> None:
        try:
            late: dict[str, torch.Tensor] = {}
            before: dict[str, int] = {}
            for file in self.files:
                for part in file.parts:
                    if part.held is not None:
                        self.ring.put_held(part.held)
                        part.held = None  # the queue's views keep it until written, no longer
                    elif part.nbytes:
                        self.ring.copy_late(part.tensor, part.nbytes)
                        self._check(file, {part.name: part.tensor}, {part.name: part.version})
                        late[f"{file.rel}\0{part.name}"], before[f"{file.rel}\0{part.name}"] = part.tensor, part.version
            # once more, all together: a write that was running while a tensor was copied has ended by now
            changed = changed_since(late, before)
            if changed:
                rel, name = changed[0].split("\0", 1)
                raise _changed(rel, name, self.label)
        except _Cancelled:
            pass
        except BaseException as exc:  # noqa: BLE001 - the writer raises it (PendingSave.wait)
            self.error = exc
            self.ring.fail(exc)
        finally:
            self.reading.done()  # the optimizer steps go on

    def _check(self, file: _File, tensors: dict[str, torch.Tensor], before: dict[str, Any]) -> None:
        changed = changed_since(tensors, before)
        if changed:
            raise _changed(file.rel, changed[0], self.label)


def _changed(rel: str, name: str, label: str) -> StatekitError:
    return StatekitError(
        f"{rel}: tensor {name!r} was modified in place after the {label} was called and before it was "
        "staged (an in-place write that is not an optimizer step); nothing is committed. Save blocking, "
        "without host_memory_budget, or make the write after wait()")


def _late(t: torch.Tensor, protected: set[int]) -> bool:
    """Whether ``t`` is staged after the call: only an optimizer step writes it, and its
    bytes can be read in place (dense, contiguous, no lazy conjugate or negative bit)."""
    return t.is_contiguous() and not t.is_conj() and not t.is_neg() and _storage(t) in protected


class StreamedTensors(dict):
    """``name -> tensor`` of one file staged by a :class:`BudgetStream`; ``stream()`` yields
    its data section's bytes in order (memoryviews valid until the next one is asked for)."""

    stream: Any = None


class _Cancelled(Exception):
    pass


class PieceRing:
    """The host buffers of budgeted saves, owned by a :class:`StagingPool`: pieces of
    :func:`piece_bytes` reused from save to save, and the copies made during a call (held
    until written). Its accounting is the proof of the budget: :attr:`host_bytes` now,
    :attr:`high_water_bytes` at most since :meth:`reset_high_water`.

    Args:
        allocate: ``(nbytes, pin) -> uint8 CPU tensor`` (the pool's allocator).
    """

    def __init__(self, allocate: Any) -> None:
        self._allocate = allocate
        self._cond = threading.Condition()
        self._free: list[torch.Tensor] = []
        self._pieces = 0
        self._piece_bytes = 0
        self._limit = 0
        self._queue: deque[tuple[memoryview, torch.Tensor | None, int]] = deque()
        self._error: BaseException | None = None
        self._cancelled = False
        self._held = 0  # bytes of the copies made during calls, not yet written
        self.host_bytes = 0
        """Bytes of host buffers this ring holds now (pieces and held copies)."""
        self.high_water_bytes = 0
        """The most :attr:`host_bytes` ever held at once since :meth:`reset_high_water`."""
        self.pin = False

    def reset_high_water(self) -> None:
        """Start a new high-water mark from :attr:`host_bytes`."""
        with self._cond:
            self.high_water_bytes = self.host_bytes

    def _count(self, nbytes: int) -> None:
        self.host_bytes += nbytes
        self.high_water_bytes = max(self.high_water_bytes, self.host_bytes)

    def hold_copy(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of ``t``'s bytes, made now (counted until written)."""
        source = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)
        with self._cond:
            while self._free and self._limit and self.host_bytes + source.numel() > self._limit:
                self._free.pop()  # the last save's pieces make room for this call's copies
                self._pieces -= 1
                self.host_bytes -= self._piece_bytes
            self._count(source.numel())
            self._held += source.numel()
        copy = self._allocate(source.numel(), is_accelerator(t.device))
        copy.copy_(source)
        return copy

    def size_for(self, budget: int) -> None:
        """Set the pieces' size and the bytes the ring may hold to ``budget`` (its share of
        the save's budget: :func:`ring_bytes`; the copies held now count toward it; one
        piece at least); pieces of another size are dropped."""
        size = piece_bytes(budget)
        with self._cond:
            if size != self._piece_bytes:
                self.host_bytes -= self._pieces * self._piece_bytes
                self._free, self._pieces, self._piece_bytes = [], 0, size
            self._limit = budget
            while self._free and self.host_bytes > budget:  # a smaller budget than the last save's
                self._free.pop()
                self._pieces -= 1
                self.host_bytes -= size
            self._error, self._cancelled = None, False

    def _piece(self) -> torch.Tensor:
        """A free piece (a new one while the budget allows, at least one), waiting for the
        writer to give one back.

        Raises:
            StatekitError: no piece came back within :data:`STALLED_AFTER_S` (stalled storage).
        """
        deadline = time.monotonic() + STALLED_AFTER_S
        with self._cond:
            while True:
                if self._cancelled:
                    raise _Cancelled()
                if self._free:
                    return self._free.pop()
                if self._pieces == 0 or self.host_bytes + self._piece_bytes <= self._limit:
                    self._pieces += 1
                    self._count(self._piece_bytes)
                    break
                if not self._cond.wait(max(0.0, deadline - time.monotonic())) and time.monotonic() >= deadline:
                    raise StatekitError(
                        f"the writer wrote nothing back to the staging budget for {STALLED_AFTER_S:g} s (stalled "
                        "storage?): the save is given up, nothing is committed, so that optimizer steps go on")
        return self._allocate(self._piece_bytes, self.pin)

    def copy_late(self, t: torch.Tensor, nbytes: int) -> None:
        """Copy the live ``t`` (contiguous) into pieces, in order, queued for the writer."""
        source = t.detach().reshape(-1).view(torch.uint8)
        if is_accelerator(t.device):
            self.pin = True
        for start in range(0, nbytes, self._piece_bytes):
            n = min(self._piece_bytes, nbytes - start)
            piece = self._piece()
            with torch.no_grad():
                piece[:n].copy_(source[start : start + n])  # blocking: on the host when queued
            self._put(memoryview(piece.numpy())[:n], piece, 0)

    def put_held(self, copy: torch.Tensor) -> None:
        """Queue a copy made during the call (freed once written)."""
        view = memoryview(copy.numpy())
        for start in range(0, len(view), CHUNK_BYTES):
            end = min(len(view), start + CHUNK_BYTES)
            self._put(view[start:end], None, copy.numel() if end == len(view) else 0)

    def _put(self, view: memoryview, piece: torch.Tensor | None, frees: int) -> None:
        with self._cond:
            self._queue.append((view, piece, frees))
            self._cond.notify_all()

    def fail(self, exc: BaseException) -> None:
        """The stager failed: the writer raises ``exc`` at its next chunk."""
        with self._cond:
            self._error = exc
            self._cond.notify_all()

    def cancel(self) -> None:
        """Stop the stager where it waits (the save ended or failed)."""
        with self._cond:
            self._cancelled = True
            self._cond.notify_all()

    def reset(self) -> None:
        """After a save: queued pieces go back to the free list, held copies are dropped."""
        with self._cond:
            while self._queue:
                _, piece, _ = self._queue.popleft()
                if piece is not None:
                    self._free.append(piece)
            self.host_bytes -= self._held
            self._held = 0
            self._cancelled = False

    def chunks(self, nbytes: int) -> Iterator[memoryview]:
        """The next ``nbytes`` of the stream, as the stager queues them (a piece goes back to
        the ring when the next chunk is asked for, i.e. once the writer wrote it).

        Raises:
            StatekitError: the stager's error (a tensor changed before it was staged).
        """
        left = nbytes
        while left > 0:
            with self._cond:
                while not self._queue and self._error is None:
                    self._cond.wait()
                if self._error is not None:
                    raise self._error
                view, piece, frees = self._queue.popleft()
            try:
                yield view
            finally:
                with self._cond:
                    if piece is not None:
                        self._free.append(piece)
                    self.host_bytes -= frees
                    self._held -= frees
                    self._cond.notify_all()
            left -= len(view)
