"""The engine: what one save writes and one load reads, below the hooks (no pluggy here).

Modules:

- :mod:`~statekit.engine.context`: ``Checkpoint``, the context handed to hooks: file I/O
  checked against the manifest.
- :mod:`~statekit.engine.entries`: the saved objects: ``classify``, ``unwrap_model``, ``check_fit``.
- :mod:`~statekit.engine.write`: the core's model and object files.
- :mod:`~statekit.engine.read`: objects from a checkpoint, fit-checked first; ``verify``.
- :mod:`~statekit.engine.optimizer_fit`: does a saved optimizer or scheduler state fit.
- :mod:`~statekit.engine.read_ahead`: fresh memory for a load's later tensor files.
- :mod:`~statekit.engine.staging`: host staging memory of async saves.
- :mod:`~statekit.engine.gradients`: gradients accumulated between optimizer steps.
- :mod:`~statekit.engine.incremental`: incremental saves: unchanged files reused.
- :mod:`~statekit.engine.space`: the free-space check before a local save.
- :mod:`~statekit.engine.locking`: the save lock (and a copy's in-progress mark).
- :mod:`~statekit.engine.commit`: the one manifest builder and commit path.

Not here: data-loader positions (:mod:`statekit.loaders`, below), the byte layout of files
(:mod:`statekit.format`), the storage (:mod:`statekit.storage`).

Call sequences: docs/design-notes.md, "The map: layers, one save, one load".
"""
