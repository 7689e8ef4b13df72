"""The engine: the checkpoint context, entries, data-loader positions, staging, writing, reading and the commit (no pluggy)."""
