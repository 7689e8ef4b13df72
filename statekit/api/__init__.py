"""The public API behind the facade: save/load through the hooks, the Accelerate bridge, attach, CheckpointManager, async saves."""
