"""One sequential pass over a safetensors file: each tensor's bytes go where they are needed.

A tensor can be read straight into a CPU tensor's memory (no intermediate copy), copied
in bounded chunks into any number of new files (``.dat`` files of an offload folder),
both, or skipped. With a hasher every byte of the file passes through it, so the
checksum recorded in the manifest is checked in the same pass; without one, skipped
tensors are ``seek``-ed over. Memory beyond the target tensors: one chunk buffer of
:data:`statekit.format.CHUNK_BYTES`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import torch

from statekit import format as fmt
from statekit.errors import CorruptCheckpointError


@dataclass
class Sink:
    """Where one stored tensor's bytes go.

    Attributes:
        memory: a writable byte view of a CPU tensor that receives the bytes, or None.
        paths: local files created (truncated) to each receive a copy of the bytes; they
            are open only while this tensor is read.
        done: called once the tensor's bytes are all in place (e.g. to move the tensor to
            its device and drop the CPU copy before the next one is read), or None.
    """

    memory: memoryview | None = None
    paths: list[str] = field(default_factory=list)
    done: Callable[[], None] | None = None


def read_header(f: BinaryIO, source: str, file_size: int | None, hasher: Any = None) -> fmt.TensorHeader:
    """Read and validate the header of a safetensors file open at offset 0.

    Args:
        f: the file.
        source: its URL, named in errors.
        file_size: its size in bytes if known.
        hasher: updated with the header bytes, or None.

    Raises:
        CorruptCheckpointError: malformed header (names ``source``).
    """
    prefix = f.read(8)
    if hasher is not None:
        hasher.update(prefix)

    def read_more(n: int) -> bytes:
        data = f.read(n)
        if hasher is not None:
            hasher.update(data)
        return data

    header, _ = fmt.parse_header(prefix, read_more, file_size, source)
    return header


def empty_for(entry: fmt.TensorEntry) -> tuple[torch.Tensor, memoryview]:
    """A fresh CPU tensor of ``entry``'s true dtype and shape, and a writable byte view of it.

    Byte-view dtypes (complex128, float8 fnuz...) are allocated as their stored ``uint8``
    layout and viewed as the true dtype, as :func:`statekit.format.read_tensors` does.
    """
    stored = torch.empty(entry.stored_shape, dtype=fmt._FROM_CODE[entry.code])
    tensor = stored.view(entry.dtype).reshape(entry.shape) if entry.dtype not in fmt._NATIVE else stored
    view = memoryview(stored.reshape(-1).view(torch.uint8).numpy()) if stored.numel() else memoryview(bytearray())
    return tensor, view


def _readinto(f: BinaryIO, view: memoryview, source: str, name: str) -> None:
    done, total = 0, len(view)
    readinto = getattr(f, "readinto", None)
    while done < total:
        want = min(fmt.CHUNK_BYTES, total - done)
        if readinto is not None:
            got = readinto(view[done : done + want])
        else:
            data = f.read(want)
            got = len(data)
            view[done : done + got] = data
        if not got:
            raise CorruptCheckpointError(f"{source}: truncated while reading tensor {name!r}", path=source)
        done += got


def stream(
    f: BinaryIO,
    header: fmt.TensorHeader,
    source: str,
    sinks: Mapping[str, Sink],
    hasher: Any = None,
) -> None:
    """Read the data section of a safetensors file once, in file order, into ``sinks``.

    Args:
        f: the file, positioned right after the header (as :func:`read_header` leaves it).
        header: its parsed header.
        source: its URL, named in errors.
        sinks: stored tensor name -> :class:`Sink`; other tensors are skipped.
        hasher: updated with every data byte (then nothing is skipped by seeking).

    Raises:
        CorruptCheckpointError: the file is truncated (names ``source`` and the tensor).
    """
    position = header.data_start
    buffer: list[memoryview] = []  # one chunk buffer, allocated when first needed
    for e in header.entries:
        sink = sinks.get(e.name)
        if sink is None and hasher is None:
            continue
        offset = header.data_start + e.begin
        if position != offset:
            f.seek(offset)
            position = offset
        nbytes = e.end - e.begin
        with contextlib.ExitStack() as stack:
            outs = [stack.enter_context(open(p, "wb")) for p in (sink.paths if sink is not None else ())]
            if nbytes == 0:
                for out in outs:  # np.memmap cannot map an empty file (offload_format.EMPTY_DAT_BYTES)
                    out.write(b"\x00")
            if sink is not None and sink.memory is not None:
                if len(sink.memory) != nbytes:
                    raise CorruptCheckpointError(f"{source}: tensor {e.name!r} size differs from its target", path=source)
                _readinto(f, sink.memory, source, e.name)
                if hasher is not None:
                    hasher.update(sink.memory)
                for start in range(0, nbytes, fmt.CHUNK_BYTES):
                    for out in outs:
                        out.write(sink.memory[start : start + fmt.CHUNK_BYTES])
            else:
                if not buffer:
                    buffer.append(memoryview(bytearray(fmt.CHUNK_BYTES)))
                for start in range(0, nbytes, fmt.CHUNK_BYTES):
                    piece = buffer[0][: min(fmt.CHUNK_BYTES, nbytes - start)]
                    _readinto(f, piece, source, e.name)
                    if hasher is not None:
                        hasher.update(piece)
                    for out in outs:
                        out.write(piece)
        position += nbytes
        if sink is not None and sink.done is not None:
            sink.done()


def check_against_manifest(
    url: str, expected: Mapping[str, Any] | None, header: fmt.TensorHeader, hasher: Any, consequence: str = ""
) -> None:
    """After :func:`stream` read every byte through ``hasher``: compare size and checksum
    with the file's manifest entry (nothing to do when ``expected`` is None).

    Args:
        url: the file's URL, named in errors.
        expected: its manifest entry (``size_bytes``, ``checksum``), or None.
        header: its parsed header.
        hasher: the hasher that saw every byte of the file.
        consequence: what the failure means for the caller, appended to the message.

    Raises:
        CorruptCheckpointError: size or checksum differs (names the file).
    """
    if expected is None:
        return
    note = f" ({consequence})" if consequence else ""
    size = header.data_start + header.data_bytes
    if size != expected["size_bytes"]:
        raise CorruptCheckpointError(f"{url}: size {size} bytes, manifest says {expected['size_bytes']}{note}", path=url)
    actual = fmt.checksum_string(hasher)
    if actual != expected["checksum"]:
        raise CorruptCheckpointError(f"{url}: checksum {actual}, manifest says {expected['checksum']}{note}", path=url)
