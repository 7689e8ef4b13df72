"""Editing a committed manifest in tests: :func:`rewrite_manifest`."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

__all__ = ["rewrite_manifest"]


def rewrite_manifest(directory: str | os.PathLike[str], edit: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
    """Apply ``edit(manifest)`` (in place) to the local checkpoint ``directory``'s ``statekit.json``
    and write it back with a valid self-checksum, as if another setup had committed it (without
    this the edit fails the checksum, as real damage does). Returns the manifest as written."""
    from statekit.format.manifest import MANIFEST_NAME, manifest_bytes  # format imports torch: not at import time

    path = os.path.join(os.fspath(directory), MANIFEST_NAME)
    with open(path, encoding="utf-8") as f:
        manifest = json.load(f)
    edit(manifest)
    data = manifest_bytes(manifest)
    with open(path, "wb") as f:
        f.write(data)
    return manifest
