"""statekit-offload: statekit checkpoints in Accelerate's big-model pipeline.

* **Load under a memory budget:** ``statekit.load(url, {"model": model},
  device_map="auto", max_memory={"cpu": "1GiB"}, offload_folder="offload")`` fills a
  model built under ``accelerate.init_empty_weights()`` one tensor at a time: weights
  mapped to a device are loaded there, weights mapped to ``"disk"`` become entries of an
  Accelerate offload folder (read in place from the checkpoint when it is local, or
  copied to ``.dat`` files), and the model is dispatched (``accelerate.dispatch_model``)
  so ``model(x)`` runs.
* **Save an offloaded model:** ``statekit.save(url, {"model": dispatched_model})``
  writes the weights tensor by tensor from the offload files.
* **Export:** ``statekit convert CKPT OUT --to offload`` writes an offload folder.

Importing this package is cheap: the names below are imported on first use. See
``docs/plugins/offload.md``.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = [
    "InUseMarker",
    "LoadOptions",
    "OffloadInfo",
    "check_offload_folder",
    "export",
    "in_use_markers",
    "is_in_use",
    "is_offloaded",
    "mark_in_use",
    "offload_info",
    "release_in_use",
    "remove_stale_markers",
]

# The in-use markers are statekit's own (statekit.plugin_api); this package re-exports them.
_WHERE = {
    "InUseMarker": "statekit.plugin_api",
    "in_use_markers": "statekit.plugin_api",
    "is_in_use": "statekit.plugin_api",
    "mark_in_use": "statekit.plugin_api",
    "release_in_use": "statekit.plugin_api",
    "remove_stale_markers": "statekit.plugin_api",
    "LoadOptions": "statekit_offload.options",
    "OffloadInfo": "statekit_offload.loading",
    "check_offload_folder": "statekit_offload.options",
    "offload_info": "statekit_offload.loading",
    "is_offloaded": "statekit_offload.saving",
    "export": "statekit_offload.export",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib  # lazy: importing this package stays cheap

        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'statekit_offload' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
