"""The statekit-metrics plugin module: registered from the entry point ``metrics`` in group ``statekit``.

On save (``statekit_save_state_pre``) rank 0 writes ``metrics.json`` through the checkpoint
context, so the file is in the manifest with its size and checksum and attributed to this
plugin::

    {"step": 100, "options": {"run_name": "exp1"}}

``options`` are the keyword options of the save that statekit does not know itself
(``statekit.save(url, state, run_name="exp1")``) and that are JSON values; other options
are left out. On load (``statekit_load_state_post``) the file is read back, verified
against the manifest, and made available as :func:`last_loaded`; a load option
``metrics_out=<dict>`` receives it too. A checkpoint saved without the plugin loads
unchanged.

A plugin imports statekit names from :mod:`statekit.plugin_api` only: the names promised
to plugins (``docs/plugin-api.md``).
"""

from __future__ import annotations

import json
from typing import Any

from statekit.plugin_api import Checkpoint, StatekitError, hookimpl

FILE = "metrics.json"
"""Path of the plugin's file, relative to the checkpoint."""

STATEKIT_OPTIONS = frozenset({"run_name", "metrics_out"})
"""The options this plugin documents (``run_name`` is recorded, ``metrics_out`` receives the
file on load): declared so that statekit warns about a misspelled one. It records any
other JSON option too, which statekit then warns about as possibly misspelled."""

_LAST: dict[str, Any] = {}


def last_loaded() -> dict[str, Any] | None:
    """The content of ``metrics.json`` of the last checkpoint loaded in this process.

    Returns:
        ``{"step": ..., "options": {...}}``, or None when no checkpoint with the file was
        loaded yet.
    """
    return dict(_LAST["value"]) if "value" in _LAST else None


def _json_options(options: dict[str, Any]) -> dict[str, Any]:
    """The options that are JSON values (others, such as tensors or callables, are skipped)."""
    kept = {}
    for name, value in options.items():
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError):
            continue
        kept[name] = value
    return kept


@hookimpl
def statekit_save_state_pre(models: list[Any], weights: list[Any], output_dir: str, checkpoint: Checkpoint) -> None:
    """Write ``metrics.json`` (rank 0 only: the file is replicated).

    Args:
        models: the models of the save (left to the core).
        weights: their state dicts (not accessed).
        output_dir: the checkpoint's URL.
        checkpoint: the save's :class:`statekit.plugin_api.Checkpoint` context.
    """
    if checkpoint.rank != 0:
        return
    checkpoint.save_json(FILE, {"step": checkpoint.step, "options": _json_options(dict(checkpoint.options))})
    checkpoint.records["file"] = FILE


@hookimpl
def statekit_load_state_post(models: list[Any], input_dir: str, checkpoint: Checkpoint) -> None:
    """Read ``metrics.json`` back, if this plugin wrote it.

    Args:
        models: the models of the load (already restored).
        input_dir: the checkpoint's URL.
        checkpoint: the load's :class:`statekit.plugin_api.Checkpoint` context; ``records`` is what
            the save stored.

    Raises:
        CorruptCheckpointError: the file is missing or fails verification
            (passed through with its type).
        StatekitError: ``metrics_out`` is given and is not a dict.
    """
    rel = checkpoint.records.get("file")
    if rel is None:  # saved without this plugin
        return
    value = checkpoint.load_json(rel)
    _LAST["value"] = value
    out = checkpoint.options.get("metrics_out")
    if out is not None:
        if not isinstance(out, dict):
            raise StatekitError(f"{input_dir}: option metrics_out must be a dict, got {type(out).__name__}")
        out.update(value)
