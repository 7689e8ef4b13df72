"""The plugin host: the hook contract, the plugin manager and the one-at-a-time call loop.

Owns: the hookspecs and their documentation (:mod:`~statekit.hooks.hookspecs`, the contract
plugins implement: save/load pre and post hooks, attach, the manager hooks), the plugin
manager (:mod:`~statekit.hooks.registry`: entry-point discovery in group ``statekit``,
blocking with ``STATEKIT_DISABLE_PLUGINS``, tracing, :func:`~statekit.hooks.registry.call_each`),
which plugin took which model or object (:mod:`~statekit.hooks.claims`). The RNG
guard around plugin calls is :func:`statekit.devices.rng_guard` (the one snapshot and
restore of the global random states).

Call sequence: :func:`~statekit.hooks.registry.get_plugin_manager` (built on first use,
entry points loaded) -> the API calls :func:`~statekit.hooks.registry.call_each` with a
hook name and the :class:`statekit.engine.context.Checkpoint` -> each plugin's hookimpl
runs in turn under ``rng_guard`` with ``checkpoint.plugin`` set to its name (the files it
writes are recorded as its own) -> ``after_each`` (the claims tracker removes what the
plugin took from the core's share). A plugin's exception becomes a
:class:`statekit.errors.PluginError` naming plugin and hook; statekit's specific errors
(``StateMismatchError``, ``CorruptCheckpointError``...) keep their type, attributed.
"""
