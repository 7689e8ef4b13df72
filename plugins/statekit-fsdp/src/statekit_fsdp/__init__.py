"""statekit-fsdp: sharded checkpoints of FSDP models through torch.distributed.checkpoint.

Installing the distribution registers :mod:`statekit_fsdp.plugin` under the entry point
``fsdp`` of group ``statekit``; statekit then saves every FSDP1/FSDP2 model (and the
optimizers over its parameters) as per-rank safetensors shards plus JSON metadata, and
loads them back at any world size. Importing this package is cheap: torch.distributed
is imported only when a hook or the converter runs.

Public names:

* :func:`consolidate` (``statekit convert CKPT OUT --to safetensors``): one full
  safetensors file per model, assembled from the shards one tensor at a time.
* :data:`PLUGIN_NAME`: the name the plugin is registered under (``"fsdp"``).
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

PLUGIN_NAME = "fsdp"
"""Entry-point name of the plugin; the manifest names it as owner of the models it saved."""

__all__ = ["PLUGIN_NAME", "__version__", "consolidate"]


def consolidate(src_url: str, out_url: str, *, storage_options: dict[str, Any] | None = None, verify: bool = True) -> list[str]:
    """Write the full (unsharded) weights of a checkpoint's models as safetensors files.

    See :func:`statekit_fsdp.consolidation.consolidate` (imported lazily).
    """
    from statekit_fsdp.consolidation import consolidate as _consolidate

    return _consolidate(src_url, out_url, storage_options=storage_options, verify=verify)
