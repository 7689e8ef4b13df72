"""Mode plugins of the Accelerate conformance suite (``tests/integration/accelerate/test_accelerate_conformance.py``).

Each module here is a pytest plugin loaded with ``-p conformance.<module>`` into a pytest
subprocess that runs Accelerate's *own* checkpoint tests (fetched from the sdist of the
installed Accelerate at test time); ``tests/`` is put on ``PYTHONPATH`` for that. None
of them is a ``conftest.py`` and none is named ``test_*``, so the core test run neither
loads nor collects them.

* :mod:`conformance.attach_init`: ``statekit.attach(accelerator)`` right after every
  ``Accelerator.__init__``;
* :mod:`conformance.attach_prepare`: ``statekit.attach(accelerator)`` once, after the
  first ``Accelerator.prepare`` call of each instance;
* :mod:`conformance.dropin`: every ``Accelerator.save_state``/``load_state`` call routed
  through ``statekit.save_state``/``statekit.load_state`` (and
  ``statekit.CheckpointManager`` for automatic checkpoint naming), as
  ``docs/migrating.md`` tells a user to replace them; Accelerate's implementation is
  never called.

:mod:`conformance.common` counts, per test, what the mode did (accelerators created,
attach calls, saves and loads that reached Accelerate or statekit) and writes the counts
into the JUnit XML as ``<property name="statekit.*">`` entries, so the harness can tell
that statekit was really in the path of every save and load.
"""
