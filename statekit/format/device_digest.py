"""A digest of a tensor file's bytes computed where the tensors live, for incremental saves
of a state on an accelerator.

An incremental save decides whether a file changed from its bytes
(:func:`statekit.format.tensors.compare_file`). For tensors on the host that is XXH3-64
of the bytes; for tensors on a GPU, XXH3 would need every byte copied to the host first
(a 7 GB frozen base: seconds of PCIe traffic at every save, for bytes that did not
change). This digest runs as a few element-wise tensor operations on the tensors' own
device, so an unchanged file on a GPU is recognised without a device-to-host copy; only
files that changed cross to the host (to be written).

The algorithm (``mix64``): the file's data section is read as little-endian 64-bit words
(the last word of a tensor padded with zero bytes). Word ``i`` of the ``j``-th stored
tensor (in file order, tied views once) is combined with a key derived from ``(j, i)``,
passed through the splitmix64 finaliser (a bijective avalanche mixer: Steele, Lea and
Flood, "Fast splittable pseudorandom number generators", OOPSLA 2014; constants of
https://prng.di.unimi.it/splitmix64.c), and the mixed words are summed modulo 2**64. The
file's digest is XXH3-64 over the safetensors header (computed on the host: it is a few
kilobytes) followed by each tensor's sum and byte count. Because each word is mixed with
its position before the sum, a change to any one word always changes the digest (the
mixer is a bijection), and a change to several words (a sign flip of two weights, two
words swapped) leaves it equal only by a 64-bit coincidence, as for XXH3: it is a
checksum against accidental change, like every checksum in the manifest, not a
cryptographic hash.

The same arithmetic runs on any device (CPU tensors give the same digest as their copies
on a GPU: tested), wrapping int64 arithmetic being two's complement on every backend
PyTorch supports. Throughput is that of about a dozen memory-bound element-wise kernels
per chunk of :data:`DIGEST_CHUNK_WORDS` words; it is used only for files with a tensor on
an accelerator, where the alternative is the copy to the host.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import xxhash

ALGORITHM = "mix64"
"""Name recorded before the hex digits of a file's digest (``"mix64:<16 hex digits>"``)."""

DIGEST_CHUNK_WORDS = 8 * 1024 * 1024
"""Words (8 bytes each) mixed per step: bounds the temporaries on the device to a few
times 64 MiB."""

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


def _words(t: torch.Tensor) -> torch.Tensor:
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
    """The mixed-word sum of one tensor's bytes (see the module docstring), on its device.

    Args:
        t: any tensor (any dtype and device); its bytes in row-major order are digested.
        index: its position among the file's stored tensors (keys the words).

    Returns:
        The sum modulo 2**64, as an unsigned int.
    """
    if t.numel() == 0:
        return 0
    words = _words(t)
    total = torch.zeros((), dtype=torch.int64, device=words.device)
    seed = _signed((_GOLDEN * (index + 1)) % (1 << 64))
    for start in range(0, words.numel(), DIGEST_CHUNK_WORDS):
        chunk = words[start : start + DIGEST_CHUNK_WORDS]
        keyed = torch.arange(start, start + chunk.numel(), dtype=torch.int64, device=words.device)
        keyed.mul_(_signed(_GOLDEN)).add_(seed).bitwise_xor_(chunk)
        total += _mix_(keyed).sum()
    return int(total.item()) % (1 << 64)  # the one value that crosses to the host


def file_digest(header: bytes, tensors: Iterable[torch.Tensor]) -> str:
    """Digest of a safetensors file from its header and its stored tensors, in file order.

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
    return f"{ALGORITHM}:{h.hexdigest()}"


def on_accelerator(tensors: Mapping[str, torch.Tensor]) -> bool:
    """Whether any tensor of a file lives on an accelerator (then its digest is worth
    computing: it spares that tensor's copy to the host when the file did not change)."""
    return any(isinstance(t, torch.Tensor) and t.device.type not in ("cpu", "meta") for t in tensors.values())


__all__ = ["ALGORITHM", "DIGEST_CHUNK_WORDS", "file_digest", "on_accelerator", "tensor_sum"]
