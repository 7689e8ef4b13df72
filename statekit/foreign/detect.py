"""Format detection and opening: :func:`detect_format`, :func:`open_checkpoint`,
:func:`folder_kind` (what a folder under a root is) and :func:`survey` (what can be checked
of another format). Nothing is unpickled to detect a format.
"""

from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass, field
from typing import Any

from statekit import format as fmt
from statekit.engine.locking import LOCK_NAME, is_statekit_bookkeeping
from statekit.errors import CheckpointNotFoundError, IncompleteCheckpointError, StatekitError
from statekit.foreign import accelerate, trainer
from statekit.foreign.base import CheckpointReader, basename, describe_kind
from statekit.foreign.dcp import DCP_METADATA, DCPReader
from statekit.foreign.readers import AccelerateReader, SafetensorsReader, StatekitReader, TorchReader, TrainerReader
from statekit.storage import Storage

FORMATS = ("statekit", "accelerate", "dcp", "trainer", "safetensors", "torch")
"""Names returned by :func:`detect_format`."""

_READERS: dict[str, type[CheckpointReader]] = {
    "statekit": StatekitReader,
    "accelerate": AccelerateReader,
    "dcp": DCPReader,
    "trainer": TrainerReader,
    "safetensors": SafetensorsReader,
    "torch": TorchReader,
}

FOLDER_KINDS = ("statekit", "incomplete", "trainer", "accelerate", "dcp", "unknown")
"""What :func:`folder_kind` calls a folder: ``statekit`` (a committed statekit checkpoint:
``statekit.json``), ``incomplete`` (statekit's save lock, no manifest: a statekit save that
never committed, or a deletion statekit began), and folders statekit did not write:
``trainer`` (a transformers Trainer checkpoint), ``accelerate`` (``Accelerator.save_state``),
``dcp`` (``torch.distributed.checkpoint``), ``unknown`` (anything else, an empty folder too)."""

FOREIGN_KINDS = ("trainer", "accelerate", "dcp", "unknown")
"""The :data:`FOLDER_KINDS` of folders statekit did not write: never deleted, overwritten or resumed."""

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


def detect_format(url: str | Storage, storage_options: dict[str, Any] | None = None) -> str:
    """Name the format of the checkpoint at ``url`` (one of :data:`FORMATS`), unpickling nothing:
    a file by content then extension, a directory by its file names (docs/cli.md, "Formats
    statekit reads").

    Raises:
        CheckpointNotFoundError: nothing exists at ``url``.
        IncompleteCheckpointError: statekit files without a manifest (its save lock, or files it wrote).
        StatekitError: the location is not a checkpoint of a known format.
    """
    return _detect(Storage.of(url, storage_options))


def _detect(storage: Storage) -> str:
    storage.invalidate()
    if _is_file(storage):
        return _sniff_file(storage)
    return _detect_names(storage, storage.listdir())


def _detect_names(storage: Storage, names: list[str]) -> str:
    """:func:`_detect` of a directory, given its listing."""
    if not names:
        if storage.exists():
            raise IncompleteCheckpointError(
                f"{storage.url} is an empty directory: no {fmt.MANIFEST_NAME} (a save that never committed), not a checkpoint"
            )
        raise CheckpointNotFoundError(f"no checkpoint at {storage.url}")
    if fmt.MANIFEST_NAME in names:
        return "statekit"
    if LOCK_NAME in names:  # statekit takes its lock before it writes anything, whatever the layout
        raise IncompleteCheckpointError(
            f"{storage.url} has statekit's save lock ({LOCK_NAME}) and no {fmt.MANIFEST_NAME}: an incomplete statekit "
            "save (never committed)"
        )
    if DCP_METADATA in names:
        return "dcp"
    if trainer.is_trainer_checkpoint(names):  # before Accelerate's: both write model.safetensors
        return "trainer"
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
        "Accelerate or Trainer files; not a safetensors or torch file)"
    )


def open_checkpoint(
    url: str | Storage, *, allow_pickle: bool = False, storage_options: dict[str, Any] | None = None,
    format: str | None = None,
) -> CheckpointReader:
    """Open a checkpoint of any supported format for inspection (metadata first).

    Args:
        url: file or directory URL (any fsspec URL), or a :class:`~statekit.storage.Storage`.
        allow_pickle: permit unpickling (DCP ``.metadata``, torch files, Accelerate ``.bin``/``.pkl``);
            pickle can run arbitrary code: only for trusted files.
        storage_options: fsspec options.
        format: skip detection and use this format (one of :data:`FORMATS`).

    Raises:
        PickleNotAllowedError: the format needs pickle and not ``allow_pickle``; names the file.
        CheckpointNotFoundError: as :func:`detect_format`.
        IncompleteCheckpointError: as :func:`detect_format`.
        StatekitError: as :func:`detect_format`.
        CorruptCheckpointError: malformed metadata (names the file).
    """
    storage = Storage.of(url, storage_options)
    name = format or _detect(storage)
    if name not in _READERS:
        raise StatekitError(f"unknown checkpoint format {name!r}; known: {', '.join(FORMATS)}")
    return _READERS[name](storage, allow_pickle)


def folder_kind(storage: Storage, names: list[str] | None = None) -> str:
    """What a directory under a root is, by its contents: one of :data:`FOLDER_KINDS` (docs/cli.md,
    ``statekit ls``); ``incomplete`` needs statekit's save lock as proof. Nothing is unpickled.

    Raises:
        StorageError: the directory cannot be listed.
    """
    names = storage.listdir() if names is None else names
    if fmt.MANIFEST_NAME in names:
        return "statekit"
    if any(n.startswith(LOCK_NAME) for n in names):
        return "incomplete"
    content = [n for n in names if not is_statekit_bookkeeping(n)]
    if not content:
        return "unknown"
    try:
        found = _detect_names(storage, content)
    except StatekitError:  # not a layout statekit knows (an uncommitted part, a folder of other things)
        return "unknown"
    return found if found in FOREIGN_KINDS else "unknown"


def describe_folder(storage: Storage, kind: str | None = None) -> str:
    """A directory in words, for messages (``"a transformers Trainer checkpoint"``; for unknown
    contents what it holds: ``"a folder statekit cannot name (it holds 'notes.txt')"``, ``"an empty folder"``)."""
    names = storage.listdir()
    kind = kind or folder_kind(storage, names)
    if kind != "unknown":
        return describe_kind(kind)
    content = [n for n in names if not is_statekit_bookkeeping(n)]
    if not content:
        return "an empty folder"
    shown = ", ".join(repr(n) for n in content[:5]) + (f", ... ({len(content)} entries)" if len(content) > 5 else "")
    return f"{describe_kind(kind)} (it holds {shown})"


@dataclass(frozen=True)
class FileCheck:
    """What was checked of one file without unpickling anything.

    Attributes:
        file: the file, relative to the checkpoint (its name for a single-file checkpoint).
        ok: True passed, False failed, None cannot be checked without unpickling (not read).
        detail: what was checked, or what is wrong.
    """

    file: str
    ok: bool | None
    detail: str


@dataclass(frozen=True)
class Survey:
    """A checkpoint of another format, as far as it can be checked without a manifest (:func:`survey`).

    Attributes:
        url: the checkpoint.
        format: its format (:data:`FORMATS`).
        description: the format in words.
        files: ``relative path -> size in bytes``.
        checks: one :class:`FileCheck` per model file (and for DCP, the metadata not read).
    """

    url: str
    format: str
    description: str
    files: dict[str, int]
    checks: tuple[FileCheck, ...] = field(default=())

    @property
    def size_bytes(self) -> int:
        """Total bytes of :attr:`files`."""
        return sum(self.files.values())

    @property
    def ok(self) -> bool:
        """False when a check failed (a damaged model file); checks not made count as passed."""
        return all(c.ok is not False for c in self.checks)

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict: ``url, format, description, files, size_bytes, checks [{file, ok, detail}]``."""
        return {"url": self.url, "format": self.format, "description": self.description, "files": dict(self.files),
                "size_bytes": self.size_bytes, "checks": [c.__dict__.copy() for c in self.checks]}


def survey(url: str | Storage, storage_options: dict[str, Any] | None = None) -> Survey:
    """What can be checked of a checkpoint of another format, reading no pickle: its files and
    whether its model loads as far as that shows.

    Raises:
        CheckpointNotFoundError: as :func:`detect_format`.
        IncompleteCheckpointError: as :func:`detect_format`.
        StatekitError: as :func:`detect_format`; also for a statekit checkpoint (use :func:`statekit.verify`).
    """
    storage = Storage.of(url, storage_options)
    found = _detect(storage)
    if found == "statekit":
        raise StatekitError(f"{url} is a statekit checkpoint: verify it against its manifest (statekit.verify)")
    if found in ("safetensors", "torch"):
        return Survey(storage.url, found, describe_kind(found), {basename(storage.url): storage.size("")},
                      (_check_file(storage, ""),))
    names = storage.listdir()
    checks: list[FileCheck] = []
    if found == "dcp":
        checks.append(FileCheck(DCP_METADATA, None, "a pickle: not read (statekit inspect --allow-pickle reads it)"))
    elif found == "trainer":
        checks += [_check_file(storage, n) for n in names if trainer.is_model_file(n)]
        checks += [_check_shard_index(storage, n, names) for n in names if n.endswith(".index.json")]
    else:
        checks += [_check_file(storage, n) for n in accelerate.accelerate_files(names) if accelerate.is_model_file(n)]
    files = {rel: storage.size(rel) for rel in storage.find()}
    return Survey(storage.url, found, describe_kind(found), files, tuple(checks))


def _check_file(storage: Storage, rel: str) -> FileCheck:
    """One model file, checked without unpickling: a safetensors header, or a torch zip archive's directory."""
    name = rel or basename(storage.url)
    try:
        size = storage.size(rel)
        with storage.open_read(rel) as f:
            head = f.read(16)
            f.seek(0)
            if len(head) >= 9 and head[8:9] == b"{":
                header = fmt.read_header(f, storage.url_of(rel), size)
                return FileCheck(name, True, f"safetensors header readable: {len(header.entries) + len(header.aliases)} tensors")
            if head[:4] == b"PK\x03\x04":
                records = zipfile.ZipFile(f).namelist()
                if not any(r.endswith("data.pkl") for r in records):
                    return FileCheck(name, False, "a zip archive without a torch data.pkl: not a torch file")
                return FileCheck(name, True, f"torch zip archive readable: {len(records)} records (not unpickled)")
    except (StatekitError, zipfile.BadZipFile, OSError, ValueError) as exc:
        return FileCheck(name, False, f"unreadable: {exc}")
    if head[:1] == b"\x80":
        return FileCheck(name, None, "a legacy torch pickle: readable only by unpickling (not read)")
    return FileCheck(name, False, "neither a safetensors header nor a torch file (damaged?)")


def _check_shard_index(storage: Storage, rel: str, names: list[str]) -> FileCheck:
    """A sharded model's index (``model.safetensors.index.json``): every shard it names exists."""
    try:
        weight_map = json.loads(storage.read_bytes(rel))["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError, OSError, StatekitError) as exc:
        return FileCheck(rel, False, f"not a readable shard index: {exc}")
    missing = [s for s in shards if s not in names]
    if missing:
        return FileCheck(rel, False, f"names shards that are missing: {', '.join(missing)}")
    return FileCheck(rel, True, f"all {len(shards)} shards it names are present")
