"""The engine: what one save writes and one load reads, below the hooks (no pluggy here):
the checkpoint context handed to hooks and its writer and reader, the objects, the core's
writes and reads, staging, incremental reuse, the lock and the commit. One line per module:
docs/design-notes.md, "Module layout"; call sequences: "The map" and "Where a save and a
load live".
"""
