"""The engine: what one save writes and one load reads, below the hooks (no pluggy here).

Owns: the checkpoint context handed to hooks (:mod:`~statekit.engine.context`:
``save_tensors``/``save_state``/``open``, ``load_tensors``/``load_state``, every file
recorded with its size and checksum on save and checked against them on load), the
classification of saved objects (:mod:`~statekit.engine.entries`: ``classify``,
``unwrap_model``, ``check_fit``), the core's own files (:mod:`~statekit.engine.write`),
reading and fit-checking them (:mod:`~statekit.engine.read`, ``verify``;
:mod:`~statekit.engine.optimizer_fit`; :mod:`~statekit.engine.read_ahead`), host staging of
async saves (:mod:`~statekit.engine.staging`), gradients between optimizer steps
(:mod:`~statekit.engine.gradients`), the free-space check (:mod:`~statekit.engine.space`),
the save lock (:mod:`~statekit.engine.locking`) and the one manifest builder and commit
(:mod:`~statekit.engine.commit`).

Not here: data-loader positions (:mod:`statekit.loaders`, the layer below, which the
entries and the reads call), the byte layout of files (:mod:`statekit.format`), the
storage (:mod:`statekit.storage`).

Call sequence of a save (called by :mod:`statekit.api.saveload` after the pre-hooks):
:func:`~statekit.engine.write.write_core_state` -> ``save_model`` /
``Checkpoint.save_state`` (a data loader's state from
:func:`statekit.loaders.data.loader_state`) -> ``Checkpoint.save_tensors`` ->
:func:`statekit.format.write_tensors` into ``Storage.open_write`` (or staged, then
``Checkpoint.flush``) -> :func:`~statekit.engine.commit.gather_files` (every rank's file
entries to rank 0) -> ``objects_table`` -> ``build_manifest`` (with the resume audit's
:func:`statekit.loaders.audit.summary`) -> :func:`~statekit.engine.commit.commit`
(``Storage.commit`` of the manifest, last). Of a load (called by
:mod:`statekit.api.loading`): :func:`~statekit.engine.read.check_entries` and
``check_models`` (headers and skeletons only, nothing touched) ->
``load_entries_undoable`` -> ``load_models`` -> ``load_model`` ->
``Checkpoint.load_tensors`` -> :func:`statekit.format.read_tensors` from
``Storage.open_read(rel, bulk=True)`` (the storage picks the I/O method), checked against
the manifest's size and checksum; all of it inside ``Checkpoint.reading_each_file_once``,
so the file a check parsed the header of is read on through the same open file; a data loader's state goes to :func:`statekit.loaders.data.restore_loader`.
"""
