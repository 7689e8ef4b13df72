"""The engine: what one save writes and one load reads, below the hooks (no pluggy here).

Modules:

- :mod:`~statekit.engine.context`: ``Checkpoint``, the context handed to hooks: the
  identity of a save or load, every method a plugin calls, handed to its two halves:
- :mod:`~statekit.engine.file_writer`: ``FileWriter``, a save's files, each recorded as a
  ``FileEntry`` in the pass that writes it (async deferral included);
- :mod:`~statekit.engine.file_reader`: ``FileReader``, a load's files, each checked against
  the manifest and opened once per load.
- :mod:`~statekit.engine.entries`: the saved objects: ``classify``, ``unwrap_model``, ``check_fit``.
- :mod:`~statekit.engine.write`: the core's model and object files.
- :mod:`~statekit.engine.read`: ``LoadPlan``, what a load reads and in what order (fit-checked
  first); ``verify``.
- :mod:`~statekit.engine.optimizer_fit`: does a saved optimizer or scheduler state fit.
- :mod:`~statekit.engine.read_ahead`: fresh memory for a load's later tensor files.
- :mod:`~statekit.engine.staging`: host staging memory of async saves.
- :mod:`~statekit.engine.gradients`: gradients accumulated between optimizer steps.
- :mod:`~statekit.engine.incremental`: ``IncrementalReuse``, unchanged files reused.
- :mod:`~statekit.engine.space`: the free-space check before a local save.
- :mod:`~statekit.engine.locking`: the save lock (and a copy's in-progress mark).
- :mod:`~statekit.engine.commit`: the one manifest builder and commit path.
- :mod:`~statekit.engine.live_state`: the live tensors the state check digests.

Not here: data-loader positions (:mod:`statekit.loaders`, below), every check's verdict
(:mod:`statekit.checks`), the byte layout of files
(:mod:`statekit.format`), the storage (:mod:`statekit.storage`).

Call sequences: docs/design-notes.md, "The map: layers, one save, one load" and "Where a
save and a load live" (drawn).
"""
