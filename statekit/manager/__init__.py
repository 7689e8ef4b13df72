"""A run's lifetime: many saves and one resume under a root (the top layer below the CLI).

Modules:

- :mod:`~statekit.manager.manager`: ``CheckpointManager``: naming a step's folder, ``save``,
  ``resume``, ``wait``, async saves one at a time, plugins' manager options.
- :mod:`~statekit.manager.retention`: after each commit: ``latest``, retention with plugin
  vetoes, ``statekit_checkpoint_committed``.
- :mod:`~statekit.manager.resume_order`: the checkpoints a resume tries, in order, across roots,
  and the fallback past a damaged one.
- :mod:`~statekit.manager.lineage`: runs and branches under a root (``lineage.json``, rollbacks)
  and one manager's place in them (``RunLineage``: run id, branch, parent); ``statekit.OtherRunWarning``
  (a named run resumed its own checkpoint, not another run's newer one).
- :mod:`~statekit.manager.listing`: listing, naming and deleting the checkpoints under a root
  (also used by the CLI and, through :mod:`statekit.plugin_api`, by plugins).
- :mod:`~statekit.manager.backpressure`: ``save()`` while an async save still writes; ``stats()``.
- :mod:`~statekit.manager.preemption`: the save on a signal (``save_on_signal``).
- :mod:`~statekit.manager.trainer_hook`: ``CheckpointHook``, ``TrainerProgress`` for hook-based trainers.

Not here: one save or one load (:mod:`statekit.api`), another tier or any other manager
extension (plugins, on the manager hooks: ``docs/hooks.md``).

Call sequences: docs/design-notes.md, "Call sequences through each package" (manager).
"""

