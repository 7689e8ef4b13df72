"""The plugin host: the hook contract, the plugin manager and the one-at-a-time call loop.

Modules:

- :mod:`~statekit.hooks.hookspecs`: the hook contract plugins implement (save/load pre and
  post hooks, attach, the manager hooks) and ``ManagerView``.
- :mod:`~statekit.hooks.registry`: the plugin manager: entry points (group ``statekit``),
  blocking (``STATEKIT_DISABLE_PLUGINS``), tracing, plugins' manager options, ``call_each``
  and the claims (which plugin took which model or object).

The RNG guard around plugin calls is :func:`statekit.devices.rng_guard`.

Call sequences: docs/design-notes.md, "Call sequences through each package" (hooks).
"""
