"""Tensor data to and from safetensors files, streamed in chunks with the checksum in the same
pass; reading fills existing tensors in place where it can. Layout: docs/format.md, "Tensor
files"; why statekit writes it itself: docs/design-notes.md, "Format".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, BinaryIO

import torch

from statekit.errors import CorruptCheckpointError
from statekit.format.dtypes import DTYPE_FROM_CODE, NATIVE_DTYPES
from statekit.format.header import TensorEntry, TensorHeader, build_header, read_header
from statekit.storage.hashing import PrefixHasher
from statekit.storage.prefault import Prefaulter
from statekit.storage.streams import CACHE_STEP_BYTES, CHUNK_BYTES, bulk_writer, fill

ALIGN_MIN_BYTES = 1024 * 1024
"""Files with at least this many tensor bytes start their data section at a multiple of
:data:`PAGE_BYTES` (format version 1 layout)."""

PAGE_BYTES = 4096
"""The data section of a file with :data:`ALIGN_MIN_BYTES` of tensor data or more starts at a
multiple of this many bytes, on every storage (``docs/format.md``, Tensor files)."""


# --------------------------------------------------------------------------- writing


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A read-only byte view of one tensor's data on the CPU (copies only if it must:
    another device, non-contiguous, conjugate or negative bit set)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.resolve_conj().resolve_neg().contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def plan_file(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None) -> tuple[bytes, list[Any]]:
    """The header bytes and the stored tensors (in file order, tied views once) of the file
    :func:`write_tensors` writes for ``tensors``.

    Args:
        tensors: ``name -> tensor``, as for :func:`write_tensors`.
        metadata: extra ``__metadata__`` entries (str -> str), or None.

    Returns:
        ``(header, planned)``: the header bytes (length prefix and JSON, padding included)
        and the stored tensors' plans (``.tensor``, ``.nbytes``), in file order.

    Raises:
        UnsupportedDtypeError: a tensor cannot be stored (names the key).
    """
    planned_bytes = sum(t.numel() * t.element_size() for t in tensors.values() if isinstance(t, torch.Tensor))
    return build_header(tensors, metadata, data_align=PAGE_BYTES if planned_bytes >= ALIGN_MIN_BYTES else 8)


def write_tensors(
    f: BinaryIO,
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str] | None = None,
    hasher: Any = None,
) -> int:
    """Stream ``tensors`` to ``f`` as a safetensors file, one tensor (chunk) at a time: peak extra
    memory is one chunk (one tensor when it must be made contiguous); accelerator tensors pass
    through one reused host buffer (:data:`BOUNCE_BYTES`).

    Args:
        f: a binary file open for writing (through :func:`statekit.storage.streams.bulk_writer`).
        tensors: ``name -> tensor``. Identical views of one storage (tied weights) are
            stored once and listed in ``__metadata__["statekit.aliases"]``. A mapping with a
            ``stream()`` (:class:`statekit.engine.budget.StreamedTensors`) supplies the data
            section's bytes in order from it (a budgeted async save's ring of pieces).
        metadata: extra ``__metadata__`` entries (str -> str).
        hasher: an :func:`new_hasher` updated with every byte written, or None; a
            :class:`~statekit.storage.hashing.PrefixHasher` also records prefix checksums.

    Returns:
        The file size in bytes.

    Raises:
        UnsupportedDtypeError: a tensor cannot be stored (names the key).
    """
    header, planned = plan_file(tensors, metadata)
    sink = bulk_writer(f)  # the storage's interface: how the bytes reach the disk is its business
    sink.preallocate(len(header) + sum(p.nbytes for p in planned))
    sink.write(header)
    if hasher is not None:
        hasher.update(header)
        if isinstance(hasher, PrefixHasher):
            hasher.mark()  # a later save with another header stops here (statekit.checks.files.compare_file)
    arena = _one_arena(tensors, planned)
    stream = getattr(tensors, "stream", None)
    if stream is not None:  # staged under a budget (statekit.engine.budget): each piece is reused once written
        chunks, write = stream(), sink.write
    elif arena is not None:  # a staged file: the arena as it is, kept until the file is closed (no second copy)
        chunks, write = _pieces(memoryview(arena.numpy()), CHUNK_BYTES), sink.write_stable
    else:  # each write copies: hash what was just copied while it is in cache
        chunks, write = host_chunks(planned, CACHE_STEP_BYTES if hasher is not None else CHUNK_BYTES), sink.write
    size = len(header)
    for chunk in chunks:
        write(chunk)
        if hasher is not None:
            hasher.update(chunk)
        size += len(chunk)
    return size


BOUNCE_BYTES = CHUNK_BYTES
"""Size of the one host buffer through which a synchronous write copies accelerator
tensors, bytes (pinned where the runtime allows it)."""


def _pieces(view: memoryview, step: int) -> Iterator[memoryview]:
    for start in range(0, len(view), step):
        yield view[start : start + step]


def host_chunks(planned: list[Any], step: int) -> Iterator[memoryview]:
    """The planned tensors' bytes in order, as CPU memoryviews of at most ``step`` bytes (accelerator
    tensors through one reused host buffer, blocking copies; why: docs/benchmark.md).
    """
    bounce: torch.Tensor | None = None
    for p in planned:
        t = p.tensor
        if not (p.nbytes and is_accelerator(t.device)) or not t.is_contiguous() or t.is_conj() or t.is_neg():
            # (a strided or conj/neg accelerator tensor would need a whole-tensor temporary on
            # the device to be read in order: copied to the host as it is, then laid out there)
            yield from _pieces(tensor_bytes(t), step)
            continue
        source = t.detach().reshape(-1).view(torch.uint8)
        if bounce is None:
            bounce = host_buffer(BOUNCE_BYTES)
            held = memoryview(bounce.numpy())
        for start in range(0, p.nbytes, len(bounce)):
            n = min(len(bounce), p.nbytes - start)
            bounce[:n].copy_(source[start : start + n])  # blocking: the bytes are on the host now
            yield from _pieces(held[:n], step)


def is_accelerator(device: torch.device) -> bool:
    """True for an accelerator (CUDA or any ``torch.accelerator`` device): any device but
    the CPU and ``meta`` (which holds no data)."""
    return device.type not in ("cpu", "meta")


def host_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 host buffer of ``nbytes``, page-locked when the accelerator runtime can pin
    (faster device-to-host copies), else ordinary memory."""
    try:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    except RuntimeError:  # no runtime that pins host memory
        return torch.empty(nbytes, dtype=torch.uint8)


def _one_arena(tensors: Mapping[str, Any], planned: list[Any]) -> torch.Tensor | None:
    """The planned tensors' bytes as one uint8 CPU tensor when they lie back to back in the
    ``arena`` of ``tensors`` (staged tensors); else None.
    """
    arena = getattr(tensors, "arena", None)
    if not isinstance(arena, torch.Tensor) or arena.device.type != "cpu" or arena.dtype != torch.uint8:
        return None
    position = arena.data_ptr()
    for p in planned:
        if p.nbytes and (p.tensor.device.type != "cpu" or not p.tensor.is_contiguous() or p.tensor.data_ptr() != position):
            return None
        position += p.nbytes
    return arena if position == arena.data_ptr() + arena.numel() else None


# --------------------------------------------------------------------------- reading


def read_tensors(
    f: BinaryIO,
    source: str,
    file_size: int | None = None,
    *,
    into: Mapping[str, torch.Tensor] | None = None,
    names: Iterable[str] | None = None,
    hasher: Any = None,
    fresh: Mapping[str, torch.Tensor] | None = None,
    ready: Callable[[torch.Tensor], None] | None = None,
    header: TensorHeader | None = None,
) -> tuple[dict[str, torch.Tensor], TensorHeader]:
    """Read a safetensors file sequentially, optionally straight into existing tensors.

    Args:
        f: a binary file open for reading at offset 0 (with ``header``: at its data section).
        source: its URL, named in errors.
        file_size: its size in bytes if known (validates the data section).
        into: ``name -> tensor`` to fill in place (a CPU, contiguous target of the same dtype
            and shape receives the bytes directly; others by ``copy_`` from a buffer).
        names: read only these names (others skipped with ``seek``); all if None. Ignored
            when ``hasher`` is given.
        hasher: updated with every byte of the file (for checksum verification).
        fresh: buffers made ahead by :func:`fresh_buffers`, used for the entries they fit.
        ready: called with each buffer of ``fresh`` before any byte is read into it; None
            only where no other thread writes into ``fresh``.
        header: the file's header, parsed already from ``f``; None: parsed here.

    Returns:
        ``(tensors, header)``: ``tensors`` maps every (selected) name, aliases included, to
        a CPU tensor, or to the ``into`` target that was filled.

    Raises:
        CorruptCheckpointError: malformed header or truncated data; names ``source``.
    """
    if header is None:
        header = read_header(f, source, file_size, hasher)
    wanted = _wanted_names(header, names, hasher)
    selected = [e for e in header.entries if wanted is None or e.name in wanted]
    out = _read_entries(f, header, selected, source, into, hasher, fresh, ready)
    _add_aliases(out, header, wanted, into)
    return out, header


def _wanted_names(header: TensorHeader, names: Iterable[str] | None, hasher: Any) -> set[str] | None:
    """The names to read, the tensors their aliases name included; None: every name (also
    with a ``hasher``, which needs every byte)."""
    wanted = None if names is None or hasher is not None else set(names)
    if wanted is not None:
        wanted |= {header.aliases[a] for a in wanted if a in header.aliases}
    return wanted


def _read_entries(
    f: BinaryIO,
    header: TensorHeader,
    selected: list[TensorEntry],
    source: str,
    into: Mapping[str, torch.Tensor] | None,
    hasher: Any,
    fresh: Mapping[str, torch.Tensor] | None,
    ready: Callable[[torch.Tensor], None] | None,
) -> dict[str, torch.Tensor]:
    """Read the ``selected`` entries in file order (seeking over the others), each into its
    ``into`` target, a buffer made ahead (``fresh``) or one made here; returns them by name."""
    out: dict[str, torch.Tensor] = {}
    position = 0
    ahead = {e.name: fresh[e.name] for e in selected if fresh and e.name in fresh and _fits(fresh[e.name], e)}
    made = fresh_buffers(header, [e for e in selected if e.name not in ahead], into)
    buffers = {**ahead, **made}
    with Prefaulter(list(made.values())) as prefaulter:
        for e in selected:
            if e.begin != position:
                f.seek(header.data_start + e.begin)
                position = e.begin
            target = into.get(e.name) if into is not None else None
            buffer = buffers.get(e.name)
            # the helper faulting a fresh buffer in hands it over before the read writes to it
            if e.name in made:
                prefaulter.ready(buffer)
            elif buffer is not None and ready is not None:
                ready(buffer)
            out[e.name] = _read_one(f, e, target, source, hasher, buffer)
            position = e.end
    return out


def _add_aliases(
    out: dict[str, torch.Tensor], header: TensorHeader, wanted: set[str] | None, into: Mapping[str, torch.Tensor] | None
) -> None:
    """Add the wanted aliases of the tensors read to ``out``: the tensor itself, or its
    alias's own ``into`` target filled with a copy."""
    for alias, name in header.aliases.items():
        if name in out and (wanted is None or alias in wanted or name in wanted):
            target = into.get(alias) if into is not None else None
            if target is not None and target is not out[name]:
                with torch.no_grad():
                    target.copy_(out[name])
                out[alias] = target
            else:
                out[alias] = out[name]


def _fills_in_place(e: TensorEntry, target: torch.Tensor | None) -> bool:
    """Whether ``e``'s bytes can land in ``target`` itself (CPU, contiguous, same dtype and
    shape, no lazy conjugate or negative bit: such a view's stored bytes are not its values)."""
    return (
        target is not None
        and e.dtype in NATIVE_DTYPES
        and target.device.type == "cpu"
        and target.dtype == e.dtype
        and tuple(target.shape) == e.shape
        and target.is_contiguous()
        and not target.is_conj()
        and not target.is_neg()
    )


def fresh_buffers(
    header: TensorHeader, entries: list[TensorEntry], into: Mapping[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """New, untouched tensors for the ``entries`` that cannot be read into their ``into`` target,
    so a helper thread (:class:`statekit.storage.prefault.Prefaulter`) can fault them in ahead.

    Args:
        header: the file's parsed header.
        entries: the entries to allocate for (a subset of ``header.entries``).
        into: the targets of an in-place read, or None.

    Returns:
        ``name -> tensor`` in each entry's stored shape and dtype.
    """
    fresh = {}
    for e in entries:
        if e.end > e.begin and not _fills_in_place(e, into.get(e.name) if into is not None else None):
            fresh[e.name] = torch.empty(e.stored_shape, dtype=DTYPE_FROM_CODE[e.code])
    return fresh


def _fits(buffer: torch.Tensor, e: TensorEntry) -> bool:
    """Whether a buffer made ahead can take entry ``e``: a contiguous CPU tensor of its
    stored dtype and shape."""
    return (
        buffer.device.type == "cpu"
        and buffer.dtype == DTYPE_FROM_CODE[e.code]
        and tuple(buffer.shape) == tuple(e.stored_shape)
        and buffer.is_contiguous()
    )


def _read_one(
    f: BinaryIO, e: TensorEntry, target: torch.Tensor | None, source: str, hasher: Any, fresh: torch.Tensor | None = None
) -> torch.Tensor:
    direct = _fills_in_place(e, target)
    if direct and target is not None:
        buffer = target.detach()
    else:
        buffer = fresh if fresh is not None else torch.empty(e.stored_shape, dtype=DTYPE_FROM_CODE[e.code])
    nbytes = e.end - e.begin
    if nbytes:
        view = memoryview(buffer.reshape(-1).view(torch.uint8).numpy())
        read_exactly_into(f, view, source, e.name, hasher)
    if direct:
        # bytes written through a NumPy view bump no version counter: bump it as copy_ would,
        # so a pending async save's version check (checks/versions.py) sees this load
        torch.autograd.graph.increment_version(buffer)
        return target  # type: ignore[return-value]
    result = buffer.view(e.dtype).reshape(e.shape) if e.dtype not in NATIVE_DTYPES else buffer
    if target is not None:
        with torch.no_grad():
            target.copy_(result)
        return target
    return result


def read_exactly_into(f: BinaryIO, view: memoryview, source: str, name: str, hasher: Any = None) -> None:
    """Fill ``view`` from ``f`` in place, through :func:`statekit.storage.streams.fill`.

    Args:
        f: a binary file positioned at the tensor's first byte.
        view: the destination, ``len(view)`` bytes (a tensor's storage as bytes).
        source: the file's URL, for the message.
        name: the tensor's name, for the message.
        hasher: updated with every byte read, in order (see :func:`new_hasher`), or None.

    Raises:
        CorruptCheckpointError: the file ends before ``view`` is full (names file and tensor).
    """
    if fill(f, view, hasher.update if hasher is not None else None) < len(view):
        raise CorruptCheckpointError(f"{source}: truncated while reading tensor {name!r}", path=source)
