"""One save or one load: the public calls behind the facade, through the hooks to the engine.

Modules:

- :mod:`~statekit.api.saveload`: ``save`` / ``save_objects``, the orchestration of every save.
- :mod:`~statekit.api.loading`: ``load`` / ``load_objects``, the orchestration of every load.
- :mod:`~statekit.api.bridge`: ``save_state`` / ``load_state`` of a whole Accelerate run.
- :mod:`~statekit.api.accelerate_hooks`: Accelerate's registered save/load pre-hooks.
- :mod:`~statekit.api.attach`: attach mode (``statekit.attach(accelerator)``).
- :mod:`~statekit.api.asyncsave`: background writes (``PendingSave``) and their exit handling.
- :mod:`~statekit.api.fingerprint`: the resume fingerprint of the live run, computed at save, checked
  at load (the comparison: :mod:`statekit.checks.fingerprint`).
- :mod:`~statekit.api.skip_batches`: ``accelerate.skip_first_batches`` after a statekit resume.

Not here: a run's lifetime (:mod:`statekit.manager`, above), the hook contract
(:mod:`statekit.hooks`), what is written and read (:mod:`statekit.engine`).

Call sequences: docs/design-notes.md, "The map: layers, one save, one load" and "Where a
save and a load live".
"""
