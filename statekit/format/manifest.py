"""The manifest file (``statekit.json``, format ``statekit/1`` or ``statekit/2``): its name,
its bytes, reading it; its presence marks the checkpoint committed. Types and validation:
:mod:`statekit.format.manifest_types`; schema ``statekit/manifest.schema.json``, explained
in docs/format.md.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from statekit.errors import CheckpointNotFoundError, IncompleteCheckpointError
from statekit.format.manifest_types import MANIFEST_CHECKSUM, Manifest, canonical_bytes
from statekit.storage import Storage
from statekit.storage.hashing import checksum_bytes

MANIFEST_NAME = "statekit.json"
"""File name of the manifest; its presence marks a committed checkpoint."""

CHECKPOINT_DIR_NAME = re.compile(r"^checkpoint-(\d+)(?:\.([0-9a-z]+))?$")
"""A checkpoint directory name under a root, ``checkpoint-<step>`` with any number of digits
(group 1: the step): the manager's ``checkpoint-<step:08d>``, and Trainer's unpadded
``checkpoint-500`` (a Trainer output folder, or statekit checkpoints named as Trainer names
them). The name says nothing of who wrote it: the listing decides by content
(:mod:`statekit.manager.listing`). The one pattern listing, format detection and the
checkpoint-root message use."""


def manifest_bytes(manifest: Manifest | dict[str, Any]) -> bytes:
    """The bytes of the manifest file, with :data:`MANIFEST_CHECKSUM` set (as :meth:`Manifest.sealed`).

    Args:
        manifest: the manifest, typed or as its JSON dict (strict JSON: no NaN or
            infinity); a dict is updated in place (its checksum set).

    Returns:
        UTF-8 JSON, indented one space per level.

    Raises:
        ValueError: the manifest is not strict JSON.
    """
    if isinstance(manifest, Manifest):
        return manifest.sealed()[1]
    parsed = json.loads(json.dumps(manifest, allow_nan=False))  # canonical_bytes leaves out an old checksum
    manifest[MANIFEST_CHECKSUM] = checksum_bytes(canonical_bytes(parsed))
    return json.dumps(manifest, indent=1, allow_nan=False).encode("utf-8")


def validate_manifest(manifest: Any, source: str) -> dict[str, Any]:
    """Check a parsed manifest (a JSON dict) as :meth:`Manifest.from_json`, the one validator, does.

    Args:
        manifest: the parsed JSON.
        source: the manifest's URL, named in errors.

    Returns:
        The manifest, unchanged.

    Raises:
        FormatVersionError: ``format`` is a ``statekit/N`` this version does not read.
        CorruptCheckpointError: what :meth:`Manifest.from_json` raises it for.
    """
    Manifest.from_json(manifest, source)
    return manifest


def read_manifest(storage: Storage) -> Manifest:
    """Read and validate the manifest of a checkpoint directory.

    Args:
        storage: the checkpoint directory.

    Returns:
        The validated manifest.

    Raises:
        CheckpointNotFoundError: nothing exists at the URL.
        IncompleteCheckpointError: the directory exists without a manifest.
        CorruptCheckpointError: the manifest is not valid JSON or not a valid manifest.
        FormatVersionError: the manifest is of a format this version does not read (a newer major).
    """
    url = storage.url_of(MANIFEST_NAME)
    storage.invalidate()
    try:
        data = storage.read_bytes(MANIFEST_NAME)
    except FileNotFoundError:
        if storage.exists():
            raise IncompleteCheckpointError(_why_no_manifest(storage)) from None
        raise CheckpointNotFoundError(f"no checkpoint at {storage.url}") from None
    return Manifest.from_json(data, url)


_ACCELERATE_DIR_NAME = re.compile(r"^checkpoint_(\d+)$")  # Accelerate's automatic_checkpoint_naming
_SAVED_SUFFIXES = (".safetensors", ".json", ".bin", ".pkl", ".pt", ".distcp")  # files a save (any writer) leaves
_LOCK_NAME = ".statekit-lock"  # statekit.engine.locking.LOCK_NAME (a layer above): taken before anything is written
_PRETRAINED_WEIGHTS = ("model.safetensors", "model-0", "pytorch_model", "diffusion_pytorch_model", "adapter_model")
_NESTED_LOOKED_AT = 100  # subdirectories looked into for a message (an error path: bounded)


def _why_no_manifest(storage: Storage) -> str:
    """What a directory without a manifest is, in words, with what to pass instead."""
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
    if "config.json" in names and any(n.startswith(_PRETRAINED_WEIGHTS) for n in names) and _LOCK_NAME not in names:
        return (f"{url} is a Hugging Face pretrained folder (config.json and weights), not a statekit checkpoint: "
                "from_pretrained loads it as it is; to reference it as a frozen base, see statekit.reference_pretrained")
    if any(n == _LOCK_NAME or n.endswith(_SAVED_SUFFIXES) for n in names):  # a save's files (or Accelerate's)
        return f"{url} has no {MANIFEST_NAME}: the save that wrote it never committed"
    return _why_not_a_checkpoint(storage, names)


def _listed(names: list[str]) -> str:
    return f"{', '.join(repr(n) for n in names[:5])}{', ...' if len(names) > 5 else ''}"


def _why_not_a_checkpoint(storage: Storage, names: list[str]) -> str:
    """What a directory that holds none of a save's files is: a folder of checkpoints, of
    manager roots, or something else."""
    url = storage.url
    looked_at = names[:_NESTED_LOOKED_AT]
    nested = [n for n in looked_at if storage.child(n).exists(MANIFEST_NAME)]
    if nested:
        return f"{url} is a folder of checkpoints, not a checkpoint: it holds {_listed(nested)}; load one of them ({url}/{nested[-1]})"
    roots = [n for n in looked_at if checkpoint_dirs(storage.child(n).listdir())]
    if roots:
        return (f"{url} is a folder of checkpoint roots, not a checkpoint: it holds {_listed(roots)}; load a checkpoint "
                f"inside one, or resume with CheckpointManager(..., {url + '/' + roots[-1]!r}).resume()")
    return (f"{url} is not a checkpoint: it has no {MANIFEST_NAME} and none of the files a save writes (it holds "
            f"{_listed(names)}); pass a checkpoint's own folder")


def checkpoint_dirs(names: Iterable[str]) -> list[str]:
    """The names among ``names`` that are a manager's checkpoint directories, sorted by step."""
    found = [(m, name) for name in names if (m := CHECKPOINT_DIR_NAME.match(name))]
    return [name for m, name in sorted(found, key=lambda f: (int(f[0].group(1)), f[1]))]
