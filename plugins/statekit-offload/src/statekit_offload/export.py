"""``statekit convert CKPT OUT --to offload``: a checkpoint's models as Accelerate offload folders.

The folder (:mod:`statekit_offload.offload_format`) is what ``accelerate.dispatch_model(...,
offload_dir=OUT)`` and ``OffloadedWeightsLoader(save_folder=OUT)`` read; one model is ``OUT``
itself, several are ``OUT/<key>/``. See docs/plugins/offload.md (Export).
"""

from __future__ import annotations

import os
from typing import Any

from statekit.plugin_api import Checkpoint, StatekitError, Storage, StorageError, UnsupportedDtypeError, read_header, read_manifest
from statekit_offload import _stream, offload_format
from statekit_offload.options import check_offload_folder


def export(src_url: str, out_url: str, *, storage_options: dict[str, Any] | None = None) -> dict[str, str]:
    """Write every model of checkpoint ``src_url`` as an Accelerate offload folder under ``out_url``.

    Args:
        src_url: a committed statekit checkpoint (any storage statekit reads).
        out_url: a local directory (created; must not already hold an ``index.json``).
        storage_options: fsspec options for ``src_url``.

    Returns:
        Model key -> the offload folder written for it.

    Raises:
        CheckpointNotFoundError, IncompleteCheckpointError, FormatVersionError: as
            :func:`statekit.plugin_api.read_manifest`.
        StatekitError: the checkpoint has no model stored as a tensor file.
        StorageError: ``out_url`` is not local, not writable, or already holds an offload index.
        UnsupportedDtypeError: a tensor's dtype has no offload encoding (complex32, float4; names it).
        CorruptCheckpointError: a tensor file fails verification (names it).
    """
    storage = Storage(src_url, storage_options)
    manifest = read_manifest(storage)
    checkpoint = Checkpoint(storage, mode="load", manifest=manifest, verify=True)
    keys = [
        k for k, o in manifest.objects.items() if o.kind == "model" and f"{k}.safetensors" in manifest.files
    ]
    if not keys:
        raise StatekitError(f"{storage.url}: no model stored as <key>.safetensors; nothing to export to an offload folder")
    out = Storage(out_url)
    if out.local_path() is None:
        raise StorageError(f"{out_url}: an offload folder must be on the local filesystem", url=out_url)
    root = os.path.abspath(out.path)
    folders = {k: root if len(keys) == 1 else os.path.join(root, k) for k in keys}
    for folder in folders.values():
        if os.path.isfile(os.path.join(folder, offload_format.INDEX_NAME)):
            raise StorageError(f"{folder}: already holds an offload index ({offload_format.INDEX_NAME}); "
                               "export into a new directory", url=folder)
    for key, folder in folders.items():
        check_offload_folder(folder, source=out_url)
        _export_model(checkpoint, key, folder)
    return folders


def _export_model(checkpoint: Any, key: str, folder: str) -> None:
    from statekit_offload.loading import model_files

    index: dict[str, Any] = {}
    for rel in model_files(checkpoint, key):  # <key>.safetensors, then an incremental save's other files
        _export_file(checkpoint, rel, folder, index)
    offload_format.write_index(folder, index)


def _export_file(checkpoint: Any, rel: str, folder: str, index: dict[str, Any]) -> None:
    url = f"{checkpoint.url}/{rel}"
    with checkpoint.open(rel, "rb") as f:  # statekit's verifying reader: every byte is checked
        header = read_header(f, url, checkpoint.manifest.files[rel].size_bytes)
        sinks = {e.name: _stream.Sink() for e in header.entries}
        names = [(e.name, e) for e in header.entries]
        by_name = {e.name: e for e in header.entries}
        names += [(alias, by_name[stored]) for alias, stored in header.aliases.items()]
        for name, e in names:
            if offload_format.offload_dtype_name(e.dtype) is None:
                raise UnsupportedDtypeError(
                    f"{url}: tensor {name!r} has dtype {e.dtype}, which Accelerate's offload format cannot hold"
                )
            index[name] = offload_format.dat_entry(e.dtype, e.shape)
            sinks[e.name].paths.append(offload_format.dat_path(folder, name))
        _stream.stream(f, header, url, sinks, read_all=True)
        _stream.verify_to_end(f, f"nothing of {folder} is usable")
