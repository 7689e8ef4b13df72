"""A self-contained copy of a checkpoint that references a frozen base
(``statekit convert CKPT OUT --to statekit --materialize``): every file copied and
verified, every referenced tensor read from its pretrained folder, checked against its
checksum and written into the copy (docs/export.md, "A frozen base is referenced").
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from statekit import format as fmt
from statekit.engine.commit import commit
from statekit.engine.context import Checkpoint
from statekit.engine.file_reader import FileReader
from statekit.engine.incremental import FROZEN_FILE_BYTES, FROZEN_INFIX, is_frozen_file
from statekit.engine.references import resolve_all
from statekit.errors import CheckpointExistsError
from statekit.format.manifest import read_manifest
from statekit.format.manifest_types import Manifest
from statekit.storage import Storage

logger = logging.getLogger("statekit")


def materialize(
    src: str, out: str, *, storage_options: dict[str, Any] | None = None, overwrite: bool = False
) -> Manifest:
    """Copy the committed checkpoint ``src`` to ``out`` with every referenced frozen tensor
    written into it, so that ``out`` loads without its pretrained folder.

    The copy's files are the source's (each verified against its manifest entry while
    copied) plus ``<key>.frozen-<n>.safetensors`` files of at most 512 MiB holding the
    referenced tensors (format ``statekit/2``, as an incremental save's frozen files); its
    manifest is written last. A checkpoint without references is copied as it is.

    Args:
        src: the checkpoint (any fsspec URL).
        out: the copy's directory (any fsspec URL).
        storage_options: fsspec options for both URLs.
        overwrite: replace a committed checkpoint at ``out``.

    Returns:
        The copy's manifest.

    Raises:
        CheckpointExistsError: ``out`` holds a committed checkpoint and not ``overwrite``.
        MissingBaseError, ChangedBaseError: a referenced folder is gone or changed (names it).
        CorruptCheckpointError: a file of ``src`` does not match its manifest (names it).
        StorageError: the storage failed.
    """
    source, target = Storage.of(src, storage_options), Storage.of(out, storage_options)
    manifest = read_manifest(source)
    if target.exists(fmt.MANIFEST_NAME):
        if not overwrite:
            raise CheckpointExistsError(f"{target.url} holds a committed checkpoint; pass overwrite=True (--overwrite)")
        target.remove(fmt.MANIFEST_NAME)  # uncommitted first: a crash leaves no half-copied checkpoint that loads
    resolved = resolve_all(manifest.references, source)  # before any byte is copied: a missing base fails here
    reader = FileReader(source, manifest, verify=True)
    for rel in sorted(manifest.files):
        with reader.reading(rel) as f, target.open_write(rel) as w:
            while chunk := f.read(fmt.CHUNK_BYTES):
                w.write(chunk)
            f.read()  # end of file: the reader compares size and checksum here
    files = {rel: dataclasses.replace(e, reused_from=None) for rel, e in manifest.files.items()}
    objects = dict(manifest.objects)
    writing = Checkpoint(target, mode="save", world_size=manifest.world_size, step=manifest.step)
    for key, ref in resolved.items():
        written = _write_referenced(writing, key, ref, [*files, *writing.files])
        obj = objects[key]
        objects[key] = dataclasses.replace(obj, files=tuple(sorted({*(obj.files or ()), *written})))
        logger.info("materialize: model %r: %d referenced tensors from %s written to %s", key,
                    len(ref.reference.tensors), ref.url, ", ".join(written))
    files.update(writing.files)
    split = any(is_frozen_file(key, rel) for key, obj in objects.items() for rel in obj.files or ())
    copy = dataclasses.replace(manifest, files=files, objects=objects, references=None, manifest_checksum=None,
                               format=fmt.FORMAT_SPLIT if split else fmt.FORMAT)
    return commit(target, copy, exclusive=not overwrite)


def _write_referenced(writing: Checkpoint, key: str, ref: Any, taken: list[str]) -> list[str]:
    """Write model ``key``'s referenced tensors into new frozen files (numbered after the
    ones ``taken`` holds), tied names together; returns their paths."""
    number = 1 + max((int(rel[len(key) + len(FROZEN_INFIX):-len(".safetensors")]) for rel in taken
                      if is_frozen_file(key, rel)), default=-1)
    groups: list[list[str]] = [[]]
    filled, seen = 0, set()
    for name, src in ref.reference.tensors.items():
        where = ref.folder.tensors[src.name].entry
        nbytes = (where.end - where.begin) if (src.file, src.name) not in seen else 0
        seen.add((src.file, src.name))
        if filled and nbytes and filled + nbytes > FROZEN_FILE_BYTES:
            groups.append([])
            filled = 0
        groups[-1].append(name)
        filled += nbytes
    written = []
    for i, names in enumerate(groups):
        rel = f"{key}{FROZEN_INFIX}{number + i:05d}.safetensors"
        writing.save_tensors(rel, ref.load(names=names))  # tied names share one tensor: stored once
        written.append(rel)
    return written


__all__ = ["materialize"]
