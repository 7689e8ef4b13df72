"""The engine: what one save writes and one load reads, below the hooks (no pluggy here).

Owns: the checkpoint context handed to hooks (:mod:`~statekit.engine.context`: the
identity of a save or load and every method a plugin calls), over its two halves: the
save's files, each recorded as a ``FileEntry`` (:mod:`~statekit.engine.file_writer`), and
the load's files, each checked against the manifest and opened once per load
(:mod:`~statekit.engine.file_reader`); incremental reuse
(:mod:`~statekit.engine.incremental`); the classification of saved objects
(:mod:`~statekit.engine.entries`: ``classify``, ``unwrap_model``, ``check_fit``); the
core's own files (:mod:`~statekit.engine.write`); what a load reads and in what order
(:mod:`~statekit.engine.read`: ``LoadPlan``, ``verify``; :mod:`~statekit.engine.optimizer_fit`;
:mod:`~statekit.engine.read_ahead`); host staging of async saves
(:mod:`~statekit.engine.staging`), gradients between optimizer steps
(:mod:`~statekit.engine.gradients`), the free-space check (:mod:`~statekit.engine.space`),
the save lock (:mod:`~statekit.engine.locking`) and the one manifest builder and commit
(:mod:`~statekit.engine.commit`).

Not here: data-loader positions (:mod:`statekit.loaders`, the layer below, which the
entries and the reads call), the byte layout of files (:mod:`statekit.format`), the
storage (:mod:`statekit.storage`).

The save and load sequences through these modules are drawn in ``docs/design-notes.md``
("Where a save and a load live").
"""
