"""The state digest: one 64-bit number per tensor that does not depend on how the tensor
is split across ranks, to prove after a load that the live values equal the saved ones.

The file checksums prove that the bytes on disk are the bytes written; they cannot see a
load path that drops optimizer moments, zero-pads a reshard or leaves an adapter out. The
state digest is computed from the *live* tensors at save and again after the load
(:mod:`statekit.engine.state_check`), so a difference names the tensor that came back
wrong.

The algorithm (``emix64``) generalises the keyed, mixed word sum of
:mod:`statekit.format.device_digest` from words of a file to elements of a tensor: each
element's bits, as a signed integer of its own width widened to 64 bits (an element wider
than 8 bytes, ``complex128``, is two words), are combined with a key derived from the
element's *global* position in the whole tensor (row-major), passed through the splitmix64
finaliser (Steele, Lea and Flood, OOPSLA 2014; https://prng.di.unimi.it/splitmix64.c) and
summed modulo 2**64. Because the sum is over positions in the whole tensor, a rank holding
rows 100 to 199 sums its rows with their global positions and the ranks' partial sums add
up (one 8-byte all-reduce) to the digest of the whole tensor, whatever the split; because
each element is mixed with its position, zeroed, swapped or shifted elements change the
sum except by a 64-bit coincidence. It is a check against accidental change, like the
file checksums, not a cryptographic hash.

Sampling: a check of every element costs about a dozen element-wise passes, which on a
CPU is several times a load at the disk's speed. A sampled digest (:class:`Sampling`)
sums only the elements whose position ``i`` has ``i % stride < block`` (blocks of
``block`` consecutive elements, one every ``stride``), and every element of a tensor under
``full_below`` elements. The positions depend on the position alone, so sampling keeps
the shard invariance. What a sampled digest can miss: a change confined to positions
outside the blocks, so a contiguous run of changed elements is always seen once it is at
least ``stride - block + 1`` elements long (4,081 with the defaults, 16 KiB of float32),
and a whole tensor dropped, zeroed or swapped always is; a few scattered elements may not
be. ``Sampling.FULL`` (``stride=block``) checks every element.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from statekit.format.device_digest import _GOLDEN, _mix_, _signed

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
    if size > 8:  # complex128: two int64 words per element
        return flat.view(torch.int64), size // 8
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
    """The digest sum of a piece of a tensor: the elements of ``piece`` (flattened,
    row-major) are the whole tensor's elements ``offset`` to ``offset + piece.numel() - 1``.
    The pieces' sums of one tensor, added modulo 2**64, are the tensor's digest.

    Computed on the piece's device; one integer crosses to the host.

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
        keys = torch.arange(offset * per, (offset + length) * per, dtype=torch.int64, device=words.device)
        values = words
    else:  # gather the sampled elements first: only they are widened and mixed
        local = pos - offset
        if per > 1:
            local = (local[:, None] * per + torch.arange(per, device=words.device)[None, :]).reshape(-1)
        keys = local + offset * per
        values = torch.index_select(words, 0, local)  # (advanced indexing takes a slow path here: 400x slower)
    keys.mul_(_signed(_GOLDEN)).add_(_SEED).bitwise_xor_(values.to(torch.int64))
    return int(_mix_(keys).sum().item()) % (1 << 64)


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
    """:func:`tensor_digest` of many whole tensors, the same digests in fewer kernels: the
    tensors summed whole (under ``sampling.full_below`` elements, or every one with a
    full sampling, up to a bounded batch) are mixed together, one batch per device, and
    summed per tensor from one cumulative sum (a model's and optimizer's hundreds of small
    tensors would otherwise cost a dozen kernel launches each).

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


__all__ = ["ALGORITHM", "Sampling", "digests", "format_sum", "partial_sum", "tensor_digest"]
