"""The keyed-sum digest: one primitive for "are these the same tensors?", in two uses.

Every element's bits (widened to 64-bit words) are keyed by position, passed through the
splitmix64 finaliser (Steele, Lea and Flood, OOPSLA 2014; https://prng.di.unimi.it/splitmix64.c)
and summed modulo 2**64 (:func:`_keyed_sum`), on the tensor's own device: a checksum against
accidental change, not a cryptographic hash. The state digest (:func:`tensor_digest`,
:func:`digests`) is keyed by global position, so shards' sums (:func:`partial_sum`,
:func:`box_sum`, :func:`shard_sum`) add up to the whole tensor's; the file digest
(:func:`file_digest`) covers one safetensors file's stored bytes. What sampling can miss:
docs/concepts.md, "State check".
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
import xxhash

_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB


def _signed(x: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return x - (1 << 64) if x >= 1 << 63 else x


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 words (PyTorch's ``>>`` is arithmetic)."""
    return torch.bitwise_right_shift(x, bits).bitwise_and_((1 << (64 - bits)) - 1)


def _mix_(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser, in place on int64 words (wrapping multiplication)."""
    x.bitwise_xor_(_shift_right(x, 30)).mul_(_signed(_M1))
    x.bitwise_xor_(_shift_right(x, 27)).mul_(_signed(_M2))
    return x.bitwise_xor_(_shift_right(x, 31))


ALGORITHM = "emix64"
"""Name of the algorithm, recorded in the manifest's ``state_digest``."""

_SEED = _signed(0x6A09E667F3BCC908)  # the first 64 bits of sqrt(2)'s fraction (SHA-512's IV)

_WORD_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class Sampling:
    """Which elements a digest sums (module docstring).

    Attributes:
        block: consecutive elements per sampled block.
        stride: a block starts at every multiple of ``stride`` (``stride == block``: every
            element).
        full_below: tensors with fewer elements are summed whole.
    """

    block: int = 16
    stride: int = 4096
    full_below: int = 65536

    FULL: ClassVar[Sampling]

    @property
    def is_full(self) -> bool:
        """True when every element is summed."""
        return self.stride <= self.block

    @property
    def missable_run(self) -> int:
        """The longest contiguous run of changed elements a sampled digest may miss
        (0 for a full one)."""
        return 0 if self.is_full else self.stride - self.block

    def to_json(self) -> dict[str, int]:
        """The JSON form recorded in the manifest."""
        return {"block": self.block, "stride": self.stride, "full_below": self.full_below}

    @classmethod
    def from_json(cls, value: Mapping[str, int]) -> Sampling:
        """Parse :meth:`to_json`'s form (raises ``KeyError``/``TypeError`` on another)."""
        return cls(int(value["block"]), int(value["stride"]), int(value["full_below"]))


Sampling.FULL = Sampling(block=1, stride=1, full_below=0)


def _words(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The elements' bits as signed integers of their own width (flat, on the tensor's
    device; no copy for a contiguous tensor) and int64 words per element."""
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    flat = t.reshape(-1)
    size = flat.element_size()
    if size > 8:  # complex128: two int64 words per element (a strided view, one element per row: copied first)
        return (flat if flat.stride(0) == 1 else flat.contiguous()).view(torch.int64), size // 8
    return flat.view(_WORD_VIEW[size]), 1


def _positions(offset: int, length: int, numel: int, sampling: Sampling, device: torch.device) -> torch.Tensor | None:
    """The sampled global element positions in ``[offset, offset + length)`` (None: all)."""
    if sampling.is_full or numel < sampling.full_below:
        return None
    first, last = offset // sampling.stride, (offset + length - 1) // sampling.stride
    starts = torch.arange(first, last + 1, dtype=torch.int64, device=device) * sampling.stride
    pos = (starts[:, None] + torch.arange(sampling.block, dtype=torch.int64, device=device)[None, :]).reshape(-1)
    # ascending: the positions inside the piece are one slice (a boolean mask takes a slow path)
    first_in, end = (int(i) for i in torch.searchsorted(pos, torch.tensor([offset, offset + length], device=device)))
    return pos[first_in:end]


def partial_sum(piece: torch.Tensor, offset: int = 0, numel: int | None = None, sampling: Sampling = Sampling.FULL) -> int:
    """The digest sum of a piece of a tensor: ``piece``'s elements (flattened, row-major) are the
    whole tensor's elements ``offset`` to ``offset + piece.numel() - 1``; the pieces' sums,
    added modulo 2**64, are the tensor's digest. One integer crosses to the host.

    Args:
        piece: any tensor (any dtype; a shard, or the whole tensor with ``offset=0``).
        offset: the global position (in elements) of its first element.
        numel: elements of the whole tensor (what :class:`Sampling` judges by); None:
            ``piece.numel()``.
        sampling: which elements are summed.

    Returns:
        The sum modulo 2**64, as an unsigned int.
    """
    length = piece.numel()
    if length == 0:
        return 0
    words, per = _words(piece)
    pos = _positions(offset, length, length if numel is None else numel, sampling, words.device)
    if pos is None:
        return _keyed_sum(words, per, None, torch.arange(offset, offset + length, dtype=torch.int64, device=words.device))
    return _keyed_sum(words, per, pos - offset, pos)  # gather the sampled elements first: only they are mixed


def _keyed_sum(words: torch.Tensor, per: int, local: torch.Tensor | None, positions: torch.Tensor,
               seed: int = _SEED) -> int:
    """The one mixing of every digest: the elements ``local`` of ``words`` (None: all, in
    order), whose positions are ``positions`` (consumed), keyed by position and ``seed``,
    mixed and summed modulo 2**64."""
    if per > 1:  # an element of several words: word j of element i is keyed i * per + j
        word = torch.arange(per, dtype=torch.int64, device=words.device)[None, :]
        positions = (positions[:, None] * per + word).reshape(-1)
        if local is not None:
            local = (local[:, None] * per + word).reshape(-1)
    # (index_select: advanced indexing takes a slow path here, 400x slower)
    values = words if local is None else torch.index_select(words, 0, local)
    positions.mul_(_signed(_GOLDEN)).add_(seed).bitwise_xor_(values.to(torch.int64))
    return int(_mix_(positions).sum().item()) % (1 << 64)


def box_sum(
    piece: torch.Tensor, offsets: Sequence[int], shape: Sequence[int], sampling: Sampling = Sampling.FULL
) -> int:
    """The digest sum of a block of a tensor of shape ``shape``: ``piece`` holds the elements
    ``offsets[d] <= i_d < offsets[d] + piece.shape[d]``, keyed by global row-major position, so
    the blocks' sums add up modulo 2**64 to the tensor's digest however it is split.

    Args:
        piece: the block (any dtype and device).
        offsets: the global index of its first element, per dimension.
        shape: the whole tensor's shape.
        sampling: which elements are summed (by global position).

    Returns:
        The sum modulo 2**64, as an unsigned int.

    Raises:
        ValueError: ``offsets``, ``shape`` and the piece's shape do not describe a block.
    """
    shape, offsets, sizes = tuple(int(s) for s in shape), tuple(int(o) for o in offsets), tuple(piece.shape)
    if not len(shape) == len(offsets) == len(sizes) or any(
            o < 0 or o + n > s for o, n, s in zip(offsets, sizes, shape)):
        raise ValueError(f"a block of shape {list(sizes)} at {list(offsets)} is not inside a tensor of shape {list(shape)}")
    if piece.numel() == 0:
        return 0
    numel = math.prod(shape)
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    first = sum(o * st for o, st in zip(offsets, strides))
    outer = next((d for d in range(len(shape)) if sizes[d] != 1), len(shape))  # the dims before it: one index each
    inner = next((d for d in range(len(shape) - 1, -1, -1) if sizes[d] != shape[d]), -1)  # the dims after it: whole
    if inner <= outer:  # one contiguous run of the tensor
        return partial_sum(piece, first, numel, sampling)
    words, per = _words(piece)
    device = words.device
    local_strides = [math.prod(sizes[d + 1:]) for d in range(len(sizes))]
    last = first + sum((n - 1) * st for n, st in zip(sizes, strides))
    positions = _positions(first, last - first + 1, numel, sampling, device)
    if positions is None:  # every element: the global position of each local one
        rest = torch.arange(piece.numel(), dtype=torch.int64, device=device)
        positions = torch.full_like(rest, first)
        for d in range(len(sizes) - 1, -1, -1):
            positions.add_(rest.remainder(sizes[d]).mul_(strides[d]))
            rest = rest.div(sizes[d], rounding_mode="floor")
        return _keyed_sum(words, per, None, positions)
    local, positions = _inside_block(positions, offsets, sizes, shape, strides, local_strides)
    return _keyed_sum(words, per, local, positions)


def _inside_block(positions: torch.Tensor, offsets: Sequence[int], sizes: Sequence[int], shape: Sequence[int],
                  strides: Sequence[int], local_strides: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Of the sampled global ``positions`` of the span a block covers, those inside the
    block: ``(their local positions, their global positions)``."""
    inside = torch.ones_like(positions, dtype=torch.bool)
    local = torch.zeros_like(positions)
    for d in range(len(shape)):
        index = positions.div(strides[d], rounding_mode="floor").remainder_(shape[d]) - offsets[d]
        inside.logical_and_(index >= 0).logical_and_(index < sizes[d])
        local.add_(index.mul_(local_strides[d]))
    keep = inside.nonzero().reshape(-1)
    return torch.index_select(local, 0, keep), torch.index_select(positions, 0, keep)


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (without importing it)."""
    return type(t).__name__ == "DTensor" and isinstance(t, torch.Tensor)


def shard_sum(t: torch.Tensor, sampling: Sampling = Sampling.FULL) -> int:
    """This rank's share of a ``DTensor``'s digest sum: :func:`box_sum` of its local shard, counted
    by one rank only where the mesh replicates it. The shares of all ranks, added modulo 2**64,
    are :func:`tensor_digest` of ``t.full_tensor()``; nothing crosses ranks here.

    Args:
        t: a DTensor whose placements are ``Shard`` or ``Replicate`` (uneven and empty shards too).
        sampling: which elements are summed (judged by the global shape).

    Returns:
        The share modulo 2**64, as an unsigned int (0 on a replica or outside the mesh).

    Raises:
        ValueError: a placement whose local elements are not one block (``Partial``,
            ``_StridedShard``), or a local shard of another shape than its placements give.
    """
    try:
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:  # pragma: no cover - torch 2.4: the same, still private
        from torch.distributed._tensor import Replicate, Shard
        from torch.distributed._tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = t.device_mesh, tuple(t.placements)
    other = [p for p in placements if type(p) not in (Shard, Replicate)]  # (a subclass: _StridedShard)
    if other:
        raise ValueError(f"placements {list(placements)}: the local values of {', '.join(map(str, other))} are not a "
                         "block of the tensor's elements")
    coordinate = mesh.get_coordinate()
    if coordinate is None or any(type(p) is Replicate and c != 0 for p, c in zip(placements, coordinate)):
        return 0  # outside the mesh, or a replica: another rank counts these elements
    local = t.to_local()
    shape, offsets = compute_local_shape_and_global_offset(t.shape, mesh, placements)
    if tuple(local.shape) != tuple(shape):
        raise ValueError(f"placements {list(placements)}: a local shard of shape {list(local.shape)}, not "
                         f"{list(shape)} as they give (padded?)")
    return box_sum(local, offsets, t.shape, sampling)


def tensor_digest(t: torch.Tensor, sampling: Sampling = Sampling.FULL) -> str:
    """The digest of a whole tensor, as 16 hex digits.

    Args:
        t: the tensor (any dtype and device).
        sampling: which elements are summed.

    Returns:
        ``"<16 hex digits>"``.
    """
    return format_sum(partial_sum(t, 0, t.numel(), sampling))


def digests(tensors: Mapping[str, torch.Tensor], sampling: Sampling = Sampling.FULL) -> dict[str, str]:
    """:func:`tensor_digest` of many whole tensors in fewer kernels (small tensors are mixed
    together, one batch per device).

    Args:
        tensors: ``name -> tensor`` (any dtypes and devices).
        sampling: which elements are summed.

    Returns:
        ``name -> 16 hex digits``, for every name.
    """
    out: dict[str, str] = {}
    batches: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for name, t in tensors.items():
        if t.numel() == 0:
            out[name] = format_sum(0)
        elif t.numel() < _BATCH_BELOW and (sampling.is_full or t.numel() < sampling.full_below):
            batches.setdefault(t.device, []).append((name, t))
        else:
            out[name] = tensor_digest(t, sampling)
    for batch in batches.values():
        out.update(_batched(batch))
    return {name: out[name] for name in tensors}


_BATCH_BELOW = 1 << 20
"""Tensors with fewer elements are digested in a batch (:func:`digests`)."""


def _batched(batch: list[tuple[str, torch.Tensor]]) -> dict[str, str]:
    pieces = [_words(t) for _, t in batch]
    words = torch.cat([w.to(torch.int64) for w, _ in pieces])
    counts = torch.tensor([w.numel() for w, _ in pieces], dtype=torch.int64, device=words.device)
    ends = counts.cumsum(0)
    keys = torch.arange(words.numel(), dtype=torch.int64, device=words.device)
    # each tensor's words keyed from 0: subtract its start, spread by a cumulative sum of the
    # starts' steps (torch.repeat_interleave does the same at ~35 ms a call on the CPU)
    steps = torch.zeros_like(keys)
    steps[ends[:-1]] = counts[:-1]
    keys -= steps.cumsum(0)
    keys.mul_(_signed(_GOLDEN)).add_(_SEED).bitwise_xor_(words)
    running = _mix_(keys).cumsum(0)  # wrapping int64: the differences are the sums modulo 2**64
    totals = running[ends - 1].tolist()
    starts = [0, *totals[:-1]]
    return {name: format_sum(end - start) for (name, _), start, end in zip(batch, starts, totals)}


def format_sum(total: int) -> str:
    """A digest sum (modulo 2**64) as the 16 hex digits recorded."""
    return f"{total % (1 << 64):016x}"


FILE_ALGORITHM = "mix64"
"""Name recorded before the hex digits of a file's digest (``"mix64:<16 hex digits>"``)."""

DIGEST_CHUNK_WORDS = 8 * 1024 * 1024
"""Words (8 bytes each) of a file's tensor mixed per step: bounds the temporaries on the
device to a few times 64 MiB."""


def _file_words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as written to the file (row-major, conj/neg bits resolved), as
    int64 words on its own device, the last padded with zero bytes."""
    t = t.detach().resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    raw = t.reshape(-1).view(torch.uint8)
    tail = raw.numel() % 8
    if tail or raw.storage_offset() % 8:  # (a padded or misaligned tensor: one copy on its device)
        padded = torch.zeros(raw.numel() + (8 - tail) % 8, dtype=torch.uint8, device=raw.device)
        padded[: raw.numel()] = raw
        raw = padded
    return raw.view(torch.int64)


def tensor_sum(t: torch.Tensor, index: int) -> int:
    """The keyed sum of one stored tensor's bytes, as 64-bit words keyed by their position
    in the tensor and by ``index`` (its position among the file's stored tensors).

    Args:
        t: any tensor (any dtype and device).
        index: its position among the file's stored tensors.

    Returns:
        The sum modulo 2**64, as an unsigned int.
    """
    if t.numel() == 0:
        return 0
    words = _file_words(t)
    seed = _signed((_GOLDEN * (index + 1)) % (1 << 64))
    total = 0
    for start in range(0, words.numel(), DIGEST_CHUNK_WORDS):
        chunk = words[start : start + DIGEST_CHUNK_WORDS]
        keys = torch.arange(start, start + chunk.numel(), dtype=torch.int64, device=words.device)
        total += _keyed_sum(chunk, 1, None, keys, seed)
    return total % (1 << 64)


def file_digest(header: bytes, tensors: Iterable[torch.Tensor]) -> str:
    """Digest of a safetensors file: XXH3-64 of the header, then each stored tensor's
    :func:`tensor_sum` and byte count, in file order.

    Args:
        header: the file's header bytes (length prefix and JSON, padding included), as
            :func:`statekit.format.header.build_header` builds it.
        tensors: the tensors of the data section in file order (tied views once).

    Returns:
        ``"mix64:<16 hex digits>"``.
    """
    h = xxhash.xxh3_64(header)
    for index, t in enumerate(tensors):
        h.update(tensor_sum(t, index).to_bytes(8, "little"))
        h.update((t.numel() * t.element_size()).to_bytes(8, "little"))
    return f"{FILE_ALGORITHM}:{h.hexdigest()}"


def on_accelerator(tensors: Mapping[str, torch.Tensor]) -> bool:
    """Whether any tensor of a file lives on an accelerator (then its digest is worth
    computing: it spares that tensor's copy to the host when the file did not change)."""
    return any(isinstance(t, torch.Tensor) and t.device.type not in ("cpu", "meta") for t in tensors.values())


__all__ = [
    "ALGORITHM", "DIGEST_CHUNK_WORDS", "FILE_ALGORITHM", "Sampling", "box_sum", "digests", "file_digest", "format_sum",
    "is_dtensor", "on_accelerator", "partial_sum", "shard_sum", "tensor_digest", "tensor_sum",
]
