"""statekit-offload: statekit checkpoints in Accelerate's big-model pipeline.

Load under a memory budget (``statekit.load(..., device_map="auto", max_memory=...,
offload_folder=...)``), save an offloaded model tensor by tensor, and export an offload
folder (``statekit convert CKPT OUT --to offload``): docs/plugins/offload.md. Importing
this package is cheap: the names below are imported on first use.
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
