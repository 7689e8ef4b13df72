"""A run's lifetime: many saves and one resume under a root (the top layer below the CLI).

Owns: :class:`~statekit.manager.manager.CheckpointManager` (naming a step's directory, the
plugins' manager options (``STATEKIT_MANAGER_OPTIONS``, validated by their plugin),
``save``/``resume``/``wait``, async saves one at a time, the in-use marker of the checkpoint
a run resumed from), what happens after each commit (:mod:`~statekit.manager.retention`:
``latest``, keep policies with plugin vetoes, the ``statekit_checkpoint_committed`` hook),
the order in which a resume tries checkpoints across the roots plugins offer
(:mod:`~statekit.manager.resume_order`), and the trainer hook for hook-based trainers
(:mod:`~statekit.manager.trainer_hook`: ``CheckpointHook``, ``TrainerProgress``).

Also here: listing, naming and deleting the checkpoints under a root
(:mod:`~statekit.manager.listing`; the CLI uses it without a manager, and plugins through
:mod:`statekit.plugin_api`).

Not here: one save or one load (:mod:`statekit.api`, which this layer calls), two-tier
storage (the ``replicate`` plugin, package :mod:`statekit_replicate`, registered by its
entry point: the manager imports no plugin).

Call sequence of a save: ``CheckpointManager.save(step)`` -> ``url_for(step)`` ->
:func:`statekit.api.bridge.save_state` (Accelerate) or
:func:`statekit.api.saveload.save_objects` with ``after_commit`` ->
:func:`~statekit.manager.retention.after_commit` on every rank after the commit (``latest``,
retention, ``statekit_checkpoint_committed``). Of a resume: ``CheckpointManager.resume()``
-> :func:`~statekit.manager.resume_order.resume_candidates` (newest committed first, then
the roots of ``statekit_resume_roots``) -> for each, ``_load`` ->
:func:`statekit.api.bridge.load_state` or :func:`statekit.api.loading.load_objects`; a
corrupt candidate is skipped (logged) and the next one tried.
"""
