"""One save or one load: the public calls behind the facade, through the hooks to the engine.

Owns: :func:`~statekit.api.saveload.save` / :func:`~statekit.api.loading.load` (and their
``*_objects`` forms the manager and the bridge call), the Accelerate bridge
(:mod:`~statekit.api.bridge`: ``save_state``/``load_state`` of a whole run;
:mod:`~statekit.api.accelerate_hooks`: pre-hooks registered with Accelerate), attach mode
(:mod:`~statekit.api.attach`), async saves (:mod:`~statekit.api.asyncsave`:
``PendingSave``), the resume fingerprint (:mod:`~statekit.api.fingerprint`,
:mod:`~statekit.api.fingerprint_compare`), ``skip_first_batches`` routing
(:mod:`~statekit.api.skip_batches`).

Not here: a run's lifetime and the checkpoints under a root (:mod:`statekit.manager`, the
layer above: listing in :mod:`statekit.manager.listing`), two-tier storage (the plugin
package :mod:`statekit_replicate`, on the manager hooks), the hook contract
(:mod:`statekit.hooks`), what is written and read (:mod:`statekit.engine`).

Call sequence of a save: :func:`~statekit.api.saveload.save` -> ``classify`` each object
(:func:`statekit.engine.entries.classify`) -> :func:`~statekit.api.saveload.save_objects`:
free-space check and ``prepare_target`` (the save lock, :mod:`statekit.engine.locking`) ->
``context_for`` (a :class:`statekit.engine.context.Checkpoint`) ->
:func:`statekit.api.fingerprint.compute` -> ``statekit_save_state_pre`` one plugin at a
time (:func:`statekit.hooks.registry.call_each`, claims tracked) ->
:func:`statekit.engine.write.write_core_state` (what no plugin took) -> ``flush`` (staged
files of an async save) -> ``_commit``: :func:`statekit.engine.commit.gather_files`,
``objects_table``, ``build_manifest``, :func:`statekit.engine.commit.commit` on rank 0 ->
``statekit_save_state_post``. Of a load: :func:`~statekit.api.loading.load` ->
:func:`~statekit.api.loading.load_objects`: :func:`statekit.format.manifest.read_manifest`
(an Accelerate folder goes to :func:`statekit.foreign.accelerate.load`) -> resume audit
``begin`` and :func:`statekit.api.fingerprint.check` -> ``_load_native``: ``_check_loadable``,
then :class:`statekit.engine.read.LoadPlan` (what is read, in what order:
``check_before_hooks`` -> ``statekit_load_state_pre`` -> ``read``) -> Accelerate's random
states -> ``statekit_load_state_post``.
"""
