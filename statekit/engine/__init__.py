"""The engine: the checkpoint context, entries, staging, writing, reading and the commit (no pluggy); data-loader positions are in statekit.loaders."""
