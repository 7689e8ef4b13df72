"""statekit-fsdp: sharded checkpoints of FSDP models through torch.distributed.checkpoint.

Installing the distribution registers :mod:`statekit_fsdp.plugin` under the entry point
``fsdp`` of group ``statekit``; statekit then saves every FSDP1/FSDP2 model (and the
optimizers over its parameters) as per-rank safetensors shards plus JSON metadata, and
loads them back at any world size. Importing this package is cheap:
torch.distributed.checkpoint is imported only when a hook or the converter runs.

Public names:

* :func:`consolidate` (``statekit convert CKPT OUT --to safetensors``): one full
  safetensors file per model, assembled from the shards one tensor at a time.
* :data:`PLUGIN_NAME`: the name the plugin is registered under (``"fsdp"``).
"""

from __future__ import annotations

from statekit_fsdp.consolidation import PLUGIN_NAME, consolidate

__version__ = "0.1.0"

__all__ = ["PLUGIN_NAME", "__version__", "consolidate"]
