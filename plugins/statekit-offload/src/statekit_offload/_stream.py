"""One sequential pass over a safetensors file: each tensor's bytes go where they are needed.

A tensor is read straight into a CPU tensor's memory, copied in bounded chunks into new
files (``.dat`` files of an offload folder), both, or skipped. With ``read_all`` every
byte passes through statekit's verifying reader (``checkpoint.open``), which
:func:`verify_to_end` then checks. Extra memory: one :data:`statekit.plugin_api.CHUNK_BYTES` buffer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import BinaryIO

import torch

from statekit.plugin_api import CHUNK_BYTES, DTYPE_FROM_CODE, NATIVE_DTYPES, CorruptCheckpointError, TensorEntry, TensorHeader, read_exactly_into


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


def empty_for(entry: TensorEntry) -> tuple[torch.Tensor, memoryview]:
    """A fresh CPU tensor of ``entry``'s true dtype and shape, and a writable byte view of it.

    Byte-view dtypes (complex128, float8 fnuz...) are allocated as their stored ``uint8``
    layout and viewed as the true dtype, as :func:`statekit.plugin_api.read_tensors` does.
    """
    stored = torch.empty(entry.stored_shape, dtype=DTYPE_FROM_CODE[entry.code])
    tensor = stored.view(entry.dtype).reshape(entry.shape) if entry.dtype not in NATIVE_DTYPES else stored
    view = memoryview(stored.reshape(-1).view(torch.uint8).numpy()) if stored.numel() else memoryview(bytearray())
    return tensor, view


def stream(
    f: BinaryIO,
    header: TensorHeader,
    source: str,
    sinks: Mapping[str, Sink],
    read_all: bool = False,
) -> None:
    """Read the data section of a safetensors file once, in file order, into ``sinks``.

    Args:
        f: the file, positioned right after the header (as
            :func:`statekit.plugin_api.read_header` leaves it).
        header: its parsed header.
        source: its URL, named in errors.
        sinks: stored tensor name -> :class:`Sink`; other tensors are skipped.
        read_all: read every data byte, skipped tensors included (a verifying reader then
            sees the whole file); otherwise skipped tensors are seeked over.

    Raises:
        CorruptCheckpointError: the file is truncated (names ``source`` and the tensor).
    """
    position = header.data_start
    buffer: list[memoryview] = []  # one chunk buffer, allocated when first needed
    for e in header.entries:
        sink = sinks.get(e.name)
        if sink is None and not read_all:
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
                read_exactly_into(f, sink.memory, source, e.name)
                for start in range(0, nbytes, CHUNK_BYTES):
                    for out in outs:
                        out.write(sink.memory[start : start + CHUNK_BYTES])
            else:
                if not buffer:
                    buffer.append(memoryview(bytearray(CHUNK_BYTES)))
                for start in range(0, nbytes, CHUNK_BYTES):
                    piece = buffer[0][: min(CHUNK_BYTES, nbytes - start)]
                    read_exactly_into(f, piece, source, e.name)
                    for out in outs:
                        out.write(piece)
        position += nbytes
        if sink is not None and sink.done is not None:
            sink.done()


def verify_to_end(f: BinaryIO, consequence: str) -> None:
    """After :func:`stream` read every byte (``read_all``): read to the end of ``f`` (a
    verifying reader: ``checkpoint.verify`` on), so it checks size and checksum.

    Args:
        f: the file from ``checkpoint.open(rel, "rb")``.
        consequence: what the failure means for the caller, appended to the message.

    Raises:
        CorruptCheckpointError: size or checksum differs (names the file and the consequence).
    """
    try:
        f.read()
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(f"{exc} ({consequence})", path=exc.path) from None
