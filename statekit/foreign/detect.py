"""Format detection and opening: :func:`detect_format` names a checkpoint's format, :func:`open_checkpoint` reads it.

Nothing is unpickled to detect a format: files are sniffed by content then extension,
directories by the files they hold.
"""

from __future__ import annotations

from typing import Any

from statekit import format as fmt
from statekit.errors import CheckpointNotFoundError, IncompleteCheckpointError, StatekitError
from statekit.foreign import accelerate
from statekit.foreign.base import CheckpointReader, basename
from statekit.foreign.dcp import DCP_METADATA, DCPReader
from statekit.foreign.readers import AccelerateReader, SafetensorsReader, StatekitReader, TorchReader
from statekit.storage import Storage

FORMATS = ("statekit", "accelerate", "dcp", "safetensors", "torch")
"""Names returned by :func:`detect_format`."""

_READERS: dict[str, type[CheckpointReader]] = {
    "statekit": StatekitReader,
    "accelerate": AccelerateReader,
    "dcp": DCPReader,
    "safetensors": SafetensorsReader,
    "torch": TorchReader,
}


def _is_file(storage: Storage) -> bool:
    try:
        return bool(storage.fs.isfile(storage.path))
    except Exception:  # noqa: BLE001 - a backend that cannot tell is treated as a directory
        return False


def _sniff_file(storage: Storage) -> str:
    with storage.open_read("") as f:
        head = f.read(16)
    if len(head) >= 9 and head[8:9] == b"{":  # before the pickle check: a header length may start with 0x80
        return "safetensors"
    if head[:4] == b"PK\x03\x04" or (head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")):
        return "torch"
    name = basename(storage.url).lower()
    if name.endswith(".safetensors"):
        return "safetensors"
    if name.endswith((".pt", ".pth", ".bin", ".ckpt")):
        return "torch"
    raise StatekitError(f"{storage.url}: not a safetensors or torch file (unrecognized content)")


def detect_format(url: str, storage_options: dict[str, Any] | None = None) -> str:
    """Name the format of the checkpoint at ``url`` (one of :data:`FORMATS`).

    A file is sniffed by content (zip or pickle magic: ``torch``; an 8-byte length then
    ``{``: ``safetensors``), then by extension. A directory is ``statekit`` if it has
    ``statekit.json``, ``dcp`` if it has ``.metadata``, ``accelerate`` if it has files
    named as ``Accelerator.save_state`` names them. Nothing is unpickled.

    Args:
        url: file or directory URL.
        storage_options: fsspec options.

    Returns:
        The format name.

    Raises:
        CheckpointNotFoundError: nothing exists at ``url``.
        IncompleteCheckpointError: a directory of statekit files without a manifest.
        StatekitError: the location is not a checkpoint of a known format.
    """
    return _detect(Storage(url, storage_options))


def _detect(storage: Storage) -> str:
    storage.invalidate()
    if _is_file(storage):
        return _sniff_file(storage)
    names = storage.listdir()
    if not names:
        if storage.exists():
            raise IncompleteCheckpointError(
                f"{storage.url} is an empty directory: no {fmt.MANIFEST_NAME} (a save that never committed), not a checkpoint"
            )
        raise CheckpointNotFoundError(f"no checkpoint at {storage.url}")
    if fmt.MANIFEST_NAME in names:
        return "statekit"
    if DCP_METADATA in names:
        return "dcp"
    found = accelerate.accelerate_files(names)
    # save_state always writes random_states_<rank>.pkl; a lone model.safetensors next to
    # statekit's .json files is an uncommitted statekit save, not an Accelerate directory
    if accelerate.pickle_files(found) or (found and not any(n.endswith(".json") for n in names)):
        mine = accelerate.written_by_statekit(storage, found)
        if not mine:
            return "accelerate"
        raise IncompleteCheckpointError(
            f"{storage.url} has no {fmt.MANIFEST_NAME}: an incomplete statekit save (never committed; "
            f"{', '.join(mine)} written by statekit), not an Accelerate checkpoint"
        )
    if any(n.endswith((".safetensors", ".json")) for n in names):
        raise IncompleteCheckpointError(
            f"{storage.url} has no {fmt.MANIFEST_NAME}: an incomplete statekit save (never committed), "
            "or not a checkpoint"
        )
    if fmt.checkpoint_dirs(names):
        raise StatekitError(f"{storage.url} is a checkpoint root, not a checkpoint: list it with `statekit ls`")
    raise StatekitError(
        f"{storage.url} is not a checkpoint statekit can read (no statekit.json, DCP .metadata, "
        "Accelerate files; not a safetensors or torch file)"
    )


def open_checkpoint(
    url: str, *, allow_pickle: bool = False, storage_options: dict[str, Any] | None = None, format: str | None = None
) -> CheckpointReader:
    """Open a checkpoint of any supported format for inspection (metadata first).

    Args:
        url: file or directory URL (any fsspec URL).
        allow_pickle: permit unpickling (DCP ``.metadata``, torch files, Accelerate
            ``.bin``/``.pkl`` files). Pickle can run arbitrary code: only for trusted files.
        storage_options: fsspec options.
        format: skip detection and use this format (one of :data:`FORMATS`).

    Returns:
        A :class:`~statekit.foreign.CheckpointReader`.

    Raises:
        PickleNotAllowedError: the format needs pickle (DCP, torch file) and not
            ``allow_pickle``; names the file.
        CheckpointNotFoundError, IncompleteCheckpointError, StatekitError: as
            :func:`detect_format`.
        CorruptCheckpointError: malformed metadata (names the file).
    """
    storage = Storage(url, storage_options)
    name = format or _detect(storage)
    if name not in _READERS:
        raise StatekitError(f"unknown checkpoint format {name!r}; known: {', '.join(FORMATS)}")
    return _READERS[name](storage, allow_pickle)
