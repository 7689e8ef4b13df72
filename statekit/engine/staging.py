"""Host-memory staging for async saves: one arena per file, the tensors back to back in the
file's order, reused while names, shapes and dtypes match (fresh memory costs 0.4-4.8 s/GiB
to touch); accelerator tensors go to pinned buffers with non-blocking copies, waited for
once per save, as DCP's ``DefaultStager`` does
(https://github.com/pytorch/pytorch/blob/main/torch/distributed/checkpoint/staging.py).
Measured and explained: docs/design-notes.md, "Async saves".
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping
from typing import Any

import torch

from statekit.engine.budget import BudgetStream, PieceRing
from statekit.format.header import view_identity
from statekit.format.tensors import is_accelerator
from statekit.storage.hugepages import HUGE_PAGE_BYTES, advise_huge


ARENA_ALIGN = 4096
"""Alignment of a file's staging arena, bytes (``O_DIRECT`` needs page-aligned memory)."""


class StagingPool:
    """CPU staging buffers of each file (by relative path), one arena per file.

    Thread-safety: one save uses the pool at a time, from :meth:`hold` (before it stages)
    to :meth:`release` (once its background write is done): a second save that holds it
    waits there, so a buffer is never written while the save before still writes it out.
    """

    def __init__(self) -> None:
        self._arenas: dict[str, tuple[Any, torch.Tensor, dict[str, torch.Tensor]]] = {}  # rel -> (layout, arena, views)
        self._lock = threading.Lock()
        self._free = threading.Condition()
        self._held = False
        self._copying: list[Any] = []  # events after the copies staged since the last settle()
        self.allocated_bytes = 0
        """Bytes allocated so far (grows only when shapes or dtypes change)."""
        self.ring = PieceRing(_aligned_host)
        """The host buffers of budgeted saves (:class:`~statekit.engine.budget.PieceRing`: its
        ``high_water_bytes`` is the most they held at once)."""
        self._stream: BudgetStream | None = None

    def hold(self) -> None:
        """Take the pool for one save: waits while another save holds it (its background
        write still reads the buffers this save would overwrite)."""
        with self._free:
            while self._held:
                self._free.wait()
            self._held = True

    def begin_budget(self, budget: int | float, protected: set[int], label: str) -> None:
        """Stage this save (the pool held) under a host-memory ``budget`` (bytes, or a fraction
        of the state: :func:`statekit.engine.budget.check_host_memory_budget`): from here,
        :meth:`stage` copies only what changes without an optimizer step and
        :meth:`stream_rest` starts the stager of the rest, during which every optimizer step
        waits (``protected``: :func:`statekit.engine.budget.protected_storages`)."""
        self._stream = BudgetStream(self.ring, budget, protected, label)

    def stream_rest(self) -> None:
        """Start staging what a budgeted save left for after its call (nothing otherwise)."""
        if self._stream is not None:
            self._stream.start()

    def staged(self) -> None:
        """After the writes of a budgeted save: raise the stager's error (see
        :meth:`statekit.engine.budget.BudgetStream.staged`); nothing otherwise."""
        if self._stream is not None:
            self._stream.staged()

    def release(self) -> None:
        """Give the pool back (the save's writes are done, or it failed), once no copy
        into its buffers is still running (a failed save may not have settled)."""
        if self._stream is not None:
            self._stream.stop()
            self._stream = None
        with contextlib.suppress(Exception):  # a device error: the save that failed reports its own
            self.settle()
        with self._free:
            self._held = False
            self._free.notify_all()

    def stage(self, rel: str, tensors: Mapping[str, torch.Tensor]) -> StagedTensors:
        """Copy ``tensors`` (``name -> tensor``, any device; tied views to one buffer) into
        this pool's arena for file ``rel``.

        Returns:
            ``name -> staged CPU tensor``, views of the file's arena (``.arena``): complete
            on return for CPU tensors, once :meth:`settle` returns for accelerator tensors.
            Under a budget (:meth:`begin_budget`): the file's
            :class:`~statekit.engine.budget.StreamedTensors`.
        """
        if self._stream is not None:
            return self._stream.stage(rel, tensors)  # type: ignore[return-value]
        refused: dict[str, Any] = {}  # the writer raises the proper error for these
        tied: dict[str, str] = {}  # name -> the name whose buffer it shares
        seen: dict[tuple[Any, ...], str] = {}
        unique: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor) or t.device.type == "meta" or type(t).__name__ == "DTensor":
                refused[name] = t
                continue
            identity = view_identity(t)  # tied views: one buffer, as the writer stores them once
            if identity is not None:
                if identity in seen:
                    tied[name] = seen[identity]
                    continue
                seen[identity] = name
            unique[name] = t
        devices: set[torch.device] = set()
        with self._lock, torch.no_grad():
            arena, buffers = self._buffers_for(rel, unique)
            for name, t in unique.items():
                accelerated = pin_memory_for(t.device)
                buffer, source = buffers[name], t.detach()
                if buffer.numel() and buffer.data_ptr() % buffer.element_size():
                    # an arena offset the dtype's kernels do not expect (torch.frombuffer view):
                    # copy bytes (a complex128 copy_ to an 8-byte-aligned address faults)
                    buffer = buffer.reshape(-1).view(torch.uint8)
                    source = source.resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)
                buffer.copy_(source, non_blocking=accelerated)
                if accelerated:
                    devices.add(t.device)
            self._copying.extend(record_copies(devices))  # on the streams current here (a caller's side stream too)
        staged = StagedTensors(
            (name, buffers[name] if name in unique else buffers[tied[name]] if name in tied else refused[name])
            for name in tensors
        )
        staged.arena = arena
        return staged

    def settle(self) -> None:
        """Wait until every device-to-host copy queued by :meth:`stage` since the last call
        is done (the events of :func:`record_copies`).

        Raises:
            RuntimeError: the accelerator runtime reports an error (torch's own).
        """
        with self._lock:
            events, self._copying = self._copying, []
            for event in events:
                event.synchronize()

    def _buffers_for(self, rel: str, tensors: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The file's arena and a view of it per tensor (reused when names, shapes, dtypes
        and pinning match the last save's)."""
        pin = any(pin_memory_for(t.device) for t in tensors.values())
        layout = tuple((name, tuple(t.shape), t.dtype) for name, t in tensors.items())
        cached = self._arenas.get(rel)
        if cached is not None and cached[0] == (layout, pin):
            return cached[1], cached[2]
        arena, buffers = _arena_views(tensors, pin)
        self._arenas[rel] = ((layout, pin), arena, buffers)
        self.allocated_bytes += arena.numel()
        return arena, buffers


class StagedTensors(dict):
    """``name -> staged tensor`` of one file, plus ``arena``: the page-aligned uint8 CPU
    tensor in which they lie back to back in this order (tied views once).
    :func:`statekit.format.tensors.write_tensors` writes the arena as it is."""

    arena: torch.Tensor | None = None


def _arena_views(tensors: Mapping[str, torch.Tensor], pin: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One page-aligned host arena holding ``tensors`` back to back (unpinned: on huge pages,
    :mod:`statekit.storage.hugepages`), and a view of each in its shape and dtype (an offset
    need not suit the dtype's alignment: the file's layout decides it)."""
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    align = ARENA_ALIGN if pin else HUGE_PAGE_BYTES  # pinned memory is the runtime's; ours asks for huge pages
    raw = allocate_host(torch.Size([total + align]), torch.uint8, pin)
    shift = -raw.data_ptr() % align
    arena = raw[shift : shift + total]
    if not pin and total:
        advise_huge(arena.data_ptr(), total)
    memory = memoryview(arena.numpy()) if total else None
    views, start = {}, 0
    for name, t in tensors.items():
        if t.numel() == 0:
            views[name] = torch.empty(t.shape, dtype=t.dtype)
            continue
        nbytes = t.numel() * t.element_size()
        if start % t.element_size() == 0:  # a view of the arena's own storage (keeps its pinned allocation)
            views[name] = arena[start : start + nbytes].view(t.dtype).view(t.shape)
        else:  # torch's dtype views need aligned offsets; the file's layout does not
            views[name] = torch.frombuffer(memory, dtype=t.dtype, count=t.numel(), offset=start).view(t.shape)
        start += nbytes
    return arena, views


def pin_memory_for(device: torch.device) -> bool:
    """True when tensors on ``device`` are staged through pinned host memory: on an
    accelerator (:func:`statekit.format.tensors.is_accelerator`)."""
    return is_accelerator(device)


def allocate_host(shape: torch.Size, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A host (CPU) buffer of ``shape`` and ``dtype``, page-locked when ``pin`` (the seam the
    tests use to see which allocations ask for pinned memory).

    Raises:
        RuntimeError: ``pin`` without an accelerator runtime (torch's own error).
    """
    return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pin)


def _aligned_host(nbytes: int, pin: bool) -> torch.Tensor:
    """A uint8 host buffer of ``nbytes`` starting on an :data:`ARENA_ALIGN` boundary
    (pinned when ``pin``), through :func:`allocate_host`."""
    raw = allocate_host(torch.Size([nbytes + ARENA_ALIGN]), torch.uint8, pin)
    shift = -raw.data_ptr() % ARENA_ALIGN
    return raw[shift : shift + nbytes]


def record_copies(devices: set[torch.device]) -> list[Any]:
    """One ``torch.Event`` per device, recorded on its current stream (a caller's side
    stream too) after the copies queued there, for :meth:`StagingPool.settle`."""
    events = []
    for device in devices:
        event = torch.Event(device=device)
        event.record(torch.accelerator.current_stream(device))
        events.append(event)
    return events
