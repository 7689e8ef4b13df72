"""The manifest (``statekit.json``, format ``statekit/1``): its name, validation and reading.

The manifest lists every file of a committed checkpoint with its size and checksum, the
objects saved and who saved them; its presence marks the checkpoint committed. The
schema is ``statekit/manifest.schema.json``, explained in ``docs/format.md``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from statekit.errors import CheckpointNotFoundError, CorruptCheckpointError, FormatVersionError, IncompleteCheckpointError
from statekit.storage import Storage
from statekit.storage.hashing import checksum_bytes

FORMAT = "statekit/1"
"""The manifest's ``format`` value this version writes and reads."""

MANIFEST_NAME = "statekit.json"
"""File name of the manifest; its presence marks a committed checkpoint."""

CHECKPOINT_DIR_NAME = re.compile(r"^checkpoint-(\d{8,})$")
"""A manager's checkpoint directory name, ``checkpoint-<step:08d>`` (group 1: the step); the
one pattern listing, format detection and the checkpoint-root message use."""

MANIFEST_CHECKSUM = "manifest_checksum"
"""The manifest's field holding the XXH3-64 checksum of the rest of the manifest
(:func:`manifest_bytes`); optional: manifests written before it existed have none."""

_FIELDS: dict[str, type] = {
    "statekit_version": str,
    "created": str,
    "world_size": int,
    "plugins": dict,
    "objects": dict,
    "files": dict,
    "metadata": dict,
    "records": dict,
}
"""The manifest's required fields and their JSON types."""


def check_relpath(path: str, source: str = "manifest", error: type[Exception] = CorruptCheckpointError) -> str:
    """Validate a checkpoint-relative path: no scheme, no absolute path, no ``..``.

    Args:
        path: the relative path.
        source: what holds it (a manifest URL), named in the error.
        error: the error class to raise (writers pass a plain ``StatekitError``: a bad
            path given to a writer is a caller bug, not a corrupt checkpoint).

    Returns:
        ``path`` unchanged.

    Raises:
        CorruptCheckpointError: the path escapes the checkpoint or is malformed.
    """
    parts = path.split("/") if isinstance(path, str) else []
    if (
        not parts
        or "://" in path
        or path.startswith("/")
        or "\\" in path
        or any(p in ("", ".", "..") for p in parts)
    ):
        message = f"{source}: invalid relative path {path!r} (must stay inside the checkpoint)"
        raise error(message, path=source) if error is CorruptCheckpointError else error(message)
    return path


def _canonical(body: dict[str, Any]) -> bytes:
    """The manifest without its checksum as canonical JSON (sorted keys, no spaces): the
    checksum covers the values, not the layout, so re-indenting the file keeps it valid."""
    rest = {k: v for k, v in body.items() if k != MANIFEST_CHECKSUM}
    text = json.dumps(rest, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    # surrogatepass: a lone surrogate (os.fsdecode of a non-UTF-8 file name in metadata) is
    # valid in the manifest file (written with \u escapes) and must not fail the commit
    return text.encode("utf-8", "surrogatepass")


def manifest_bytes(manifest: dict[str, Any]) -> bytes:
    """The bytes of the manifest file, with :data:`MANIFEST_CHECKSUM` set in ``manifest``.

    Every file of a checkpoint is checksummed in the manifest; the manifest checksums
    itself, so one flipped bit in it (a ``step`` of 9 instead of 8, a metric that steers
    ``keep_best``) is a :class:`CorruptCheckpointError` at read, not a silent wrong resume.
    The checksum is taken over the manifest as a reader parses it back (JSON turns integer
    keys into strings), in canonical form.

    Args:
        manifest: the manifest (strict JSON: no NaN or infinity); updated in place.

    Returns:
        UTF-8 JSON, indented one space per level.

    Raises:
        ValueError: the manifest is not strict JSON.
    """
    parsed = json.loads(json.dumps(manifest, allow_nan=False))  # _canonical leaves out an old checksum
    manifest[MANIFEST_CHECKSUM] = checksum_bytes(_canonical(parsed))
    return json.dumps(manifest, indent=1, allow_nan=False).encode("utf-8")


def validate_manifest(manifest: Any, source: str) -> dict[str, Any]:
    """Check a parsed manifest against format version 1 (see ``docs/format.md``).

    Args:
        manifest: the parsed JSON.
        source: the manifest's URL, named in errors.

    Returns:
        The manifest, unchanged.

    Raises:
        FormatVersionError: ``format`` is not ``statekit/1`` (a newer or foreign format).
        CorruptCheckpointError: a required field is missing or has the wrong type, the
            optional ``fingerprint`` is not an object, or the manifest does not match its
            own checksum (:data:`MANIFEST_CHECKSUM`; edited or damaged after its commit).
    """
    if not isinstance(manifest, dict):
        raise CorruptCheckpointError(f"{source}: manifest is not a JSON object", path=source)
    fmt = manifest.get("format")
    if fmt != FORMAT:
        if isinstance(fmt, str) and fmt.startswith("statekit/"):
            raise FormatVersionError(
                f"{source}: checkpoint format {fmt!r} is not supported by this statekit (reads {FORMAT!r}); upgrade statekit"
            )
        raise CorruptCheckpointError(f"{source}: not a statekit manifest (format={fmt!r})", path=source)
    for key, typ in _FIELDS.items():
        if not isinstance(manifest.get(key), typ) or isinstance(manifest.get(key), bool):
            raise CorruptCheckpointError(f"{source}: manifest field {key!r} missing or not {typ.__name__}", path=source)
    if manifest.get("step") is not None and (not isinstance(manifest["step"], int) or isinstance(manifest["step"], bool)):
        raise CorruptCheckpointError(f"{source}: manifest field 'step' is not an integer", path=source)
    if "fingerprint" in manifest and not isinstance(manifest["fingerprint"], dict):  # optional (older checkpoints lack it)
        raise CorruptCheckpointError(f"{source}: manifest field 'fingerprint' is not an object", path=source)
    for path, entry in manifest["files"].items():
        check_relpath(path, source)
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("size_bytes"), int)
            or not isinstance(entry.get("checksum"), str)
            or not isinstance(entry.get("rank"), int)
        ):
            raise CorruptCheckpointError(f"{source}: manifest entry for file {path!r} is malformed", path=source)
    for key, obj in manifest["objects"].items():
        if not isinstance(obj, dict) or not isinstance(obj.get("kind"), str) or not isinstance(obj.get("owner"), str):
            raise CorruptCheckpointError(f"{source}: manifest entry for object {key!r} is malformed", path=source)
    recorded = manifest.get(MANIFEST_CHECKSUM)
    if recorded is not None:
        actual = checksum_bytes(_canonical(manifest)) if isinstance(recorded, str) else None
        if actual != recorded:
            raise CorruptCheckpointError(
                f"{source}: the manifest does not match its own checksum (recorded {recorded!r}, computed {actual!r}): "
                "it was edited or damaged after the commit",
                path=source,
            )
    return manifest


def read_manifest(storage: Storage) -> dict[str, Any]:
    """Read and validate the manifest of a checkpoint directory.

    Args:
        storage: the checkpoint directory.

    Returns:
        The validated manifest.

    Raises:
        CheckpointNotFoundError: nothing exists at the URL.
        IncompleteCheckpointError: the directory exists without a manifest.
        CorruptCheckpointError: the manifest is not valid JSON or not format 1.
        FormatVersionError: the manifest is of a newer format.
    """
    url = storage.url_of(MANIFEST_NAME)
    storage.invalidate()
    try:
        data = storage.read_bytes(MANIFEST_NAME)
    except FileNotFoundError:
        if storage.exists():
            raise IncompleteCheckpointError(_why_no_manifest(storage)) from None
        raise CheckpointNotFoundError(f"no checkpoint at {storage.url}") from None
    try:
        manifest = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptCheckpointError(f"{url}: manifest is not valid JSON: {exc}", path=url) from None
    return validate_manifest(manifest, url)


_ACCELERATE_DIR_NAME = re.compile(r"^checkpoint_(\d+)$")  # Accelerate's automatic_checkpoint_naming
_SAVED_SUFFIXES = (".safetensors", ".json", ".bin", ".pkl", ".pt", ".distcp")  # files a save (any writer) leaves
_LOCK_NAME = ".statekit-lock"  # statekit.engine.locking.LOCK_NAME (a layer above): taken before anything is written
_NESTED_LOOKED_AT = 100  # subdirectories looked into for a message (an error path: bounded)


def _why_no_manifest(storage: Storage) -> str:
    """What a directory without a manifest is, in words: a manager root, a folder of
    checkpoints (statekit's or Accelerate's) or of manager roots, an empty folder, or a save
    that never committed; with what to pass instead."""
    url = storage.url
    names = storage.listdir()
    children = checkpoint_dirs(names)
    if children:  # a manager root (runs/exp1), not a checkpoint: nothing failed
        return (f"{url} is a checkpoint root, not a checkpoint: it holds {len(children)} checkpoint directories, "
                f"the last {children[-1]!r}; load one of them, or resume with CheckpointManager(...).resume()")
    accelerate = sorted((n for n in names if _ACCELERATE_DIR_NAME.match(n)), key=lambda n: int(n.rsplit("_", 1)[1]))
    if accelerate:
        return (f"{url} is a folder of Accelerate checkpoints, not a checkpoint: it holds {len(accelerate)} "
                f"(the last {accelerate[-1]!r}); load one of them, or resume with CheckpointManager(accelerator, "
                f"{url!r}, allow_pickle=True).resume()")
    if not names:
        return f"{url} is empty (no {MANIFEST_NAME}): nothing was saved there, or the save that created it never committed"
    if any(n == _LOCK_NAME or n.endswith(_SAVED_SUFFIXES) for n in names):  # a save's files (or Accelerate's)
        return f"{url} has no {MANIFEST_NAME}: the save that wrote it never committed"
    looked_at = names[:_NESTED_LOOKED_AT]
    nested = [n for n in looked_at if storage.child(n).exists(MANIFEST_NAME)]
    if nested:
        return (f"{url} is a folder of checkpoints, not a checkpoint: it holds {', '.join(repr(n) for n in nested[:5])}"
                f"{', ...' if len(nested) > 5 else ''}; load one of them ({url}/{nested[-1]})")
    roots = [n for n in looked_at if checkpoint_dirs(storage.child(n).listdir())]
    if roots:
        return (f"{url} is a folder of checkpoint roots, not a checkpoint: it holds {', '.join(repr(n) for n in roots[:5])}"
                f"{', ...' if len(roots) > 5 else ''}; load a checkpoint inside one, or resume with "
                f"CheckpointManager(..., {url + '/' + roots[-1]!r}).resume()")
    return (f"{url} is not a checkpoint: it has no {MANIFEST_NAME} and none of the files a save writes (it holds "
            f"{', '.join(repr(n) for n in names[:5])}{', ...' if len(names) > 5 else ''}); pass a checkpoint's "
            "own folder")


def checkpoint_dirs(names: Iterable[str]) -> list[str]:
    """The names among ``names`` (a directory listing) that are a manager's checkpoint
    directories (:data:`CHECKPOINT_DIR_NAME`), sorted: a listing with any is a checkpoint root."""
    return sorted(name for name in names if CHECKPOINT_DIR_NAME.match(name))
