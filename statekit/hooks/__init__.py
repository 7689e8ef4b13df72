"""The plugin host: :mod:`~statekit.hooks.hookspecs` (the hook contract and ``ManagerView``)
and :mod:`~statekit.hooks.registry` (the plugin manager, ``call_each`` and the claims).
Call sequences: docs/design-notes.md, "Call sequences through each package" (hooks).
"""
