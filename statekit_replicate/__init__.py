"""Two-tier checkpoints: the ``replicate`` plugin (``CheckpointManager(..., replicate_to=...)``).

Ships inside the statekit distribution as its own top-level package and is registered
through the entry-point group ``statekit`` like every plugin (``docs/tiers.md``).
"""
