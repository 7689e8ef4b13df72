"""statekit-fsdp: sharded checkpoints of FSDP models through torch.distributed.checkpoint.

The hooks live in :mod:`statekit_fsdp.plugin` (entry point ``fsdp``); :func:`consolidate`
is ``statekit convert CKPT OUT --to safetensors``. See docs/plugins/fsdp.md. Importing
this package does not import torch.distributed.checkpoint.
"""

from __future__ import annotations

from statekit_fsdp.consolidation import PLUGIN_NAME, consolidate

__version__ = "0.1.0"

__all__ = ["PLUGIN_NAME", "__version__", "consolidate"]
