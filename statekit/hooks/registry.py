"""The plugin manager: entry-point discovery, blocking, tracing, and one-at-a-time hook calls,
with the claims made in them (which plugin took which model or object out of the core's path).

Built on first use by :func:`get_plugin_manager`, never at import time. Its switches, read
when it is built: ``STATEKIT_DISABLE_PLUGINS=a,b`` (names blocked),
``STATEKIT_DISABLE_PLUGIN_AUTOLOAD=1`` (only the statekit distribution's own entry points),
``STATEKIT_TRACE_PLUGINS=1`` (every hook call to stderr); docs/hooks.md, "Calling rules".
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import os
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import pluggy

from statekit.hooks import hookspecs
from statekit.errors import PluginError, PluginMissingError, StatekitError, StatekitWarning, warn_user
from statekit.format.manifest_types import Manifest
from statekit.devices import rng_guard

ENTRY_POINT_GROUP = "statekit"
"""Entry-point group that plugin distributions register under."""

hookimpl = pluggy.HookimplMarker("statekit")
"""Marker for hook implementations: ``@statekit.hookimpl`` (options as pluggy's)."""


@dataclass(frozen=True)
class PluginSource:
    """Where a registered plugin came from (shown by ``statekit plugins``).

    Attributes:
        name: registered name (the entry-point name for installed plugins).
        origin: ``"entry point"`` or ``"code"``.
        distribution: distribution name, or None for in-code plugins.
        version: distribution version, or None.
        entry_point: ``"module:attr"`` value of the entry point, or None.
    """

    name: str
    origin: str
    distribution: str | None = None
    version: str | None = None
    entry_point: str | None = None


@dataclass(frozen=True)
class CopyListing:
    """How ``statekit ls URL --replica OTHER`` words the copies a tier plugin makes on another
    root: the plugin attribute ``STATEKIT_COPY_LISTING`` (docs/hooks.md, "Tier plugins").

    Attributes:
        markers: the ``by`` of the in-use markers the plugin holds on a checkpoint while it
            copies it (state ``copying``).
        copied: the JSON's boolean field (committed on the other root) and that state;
            ``not <copied>`` for a checkpoint only the listed root holds.
        state_field: the JSON field of the state: ``copied``, ``copying``, ``incomplete`` (an
            uncommitted copy nobody is copying) or ``not <copied>``.
    """

    markers: frozenset[str] = frozenset()
    copied: str = "copied"
    state_field: str = "copy"


@dataclass(frozen=True)
class BrokenPlugin:
    """An installed plugin whose entry point failed to import: it is skipped (its hooks do
    not run), ``statekit plugins`` lists it as broken, and a load of a checkpoint it wrote
    fails naming it.

    Attributes:
        source: where it is installed (name, distribution, version, entry point).
        error: ``"<ExceptionType>: <message>"`` of the import failure.
    """

    source: PluginSource
    error: str

    def describe(self) -> str:
        """``"plugin 'x' (entry point 'm' of distribution d 1.0) failed to import: E: ..."``."""
        s = self.source
        return (f"plugin {s.name!r} (entry point {s.entry_point!r} of distribution {s.distribution} {s.version}) "
                f"failed to import: {self.error}")


class PluginManager(pluggy.PluginManager):
    """A ``pluggy.PluginManager`` for project ``statekit`` that remembers plugin sources."""

    def __init__(self) -> None:
        super().__init__("statekit")
        self.add_hookspecs(hookspecs)
        self.sources: dict[str, PluginSource] = {}
        self.broken: dict[str, BrokenPlugin] = {}
        """Installed plugins that failed to import, by name (skipped; see :class:`BrokenPlugin`)."""
        self._warned_options: set[str] = set()

    def register(self, plugin: object, name: str | None = None) -> str | None:
        """Register a plugin object or module (see ``pluggy.PluginManager.register``).

        Args:
            plugin: a module or object with ``statekit_*`` functions marked ``@hookimpl``.
            name: the name to register under; defaults to pluggy's canonical name.

        Returns:
            The registered name, or None if the name is blocked.

        Raises:
            PluginError: the plugin implements an unknown hook or a wrapper, or the name
                is taken.
        """
        try:
            registered = super().register(plugin, name)
            if registered is not None:
                self._check_hooks(registered)
        except (pluggy.PluginValidationError, ValueError) as exc:
            raise PluginError(f"cannot register plugin {name or plugin!r}: {exc}", plugin_name=name) from exc
        if registered is not None and registered not in self.sources:
            self.sources[registered] = PluginSource(name=registered, origin="code")
        return registered

    def unregister(self, plugin: object | None = None, name: str | None = None) -> Any:
        """Remove a plugin by object or name (see ``pluggy.PluginManager.unregister``)."""
        name = name or (self.get_name(plugin) if plugin is not None else None)
        removed = super().unregister(plugin, name)
        if removed is not None and name is not None:
            self.sources.pop(name, None)
        return removed

    def check_pending(self) -> None:
        """Like pluggy's: a ``statekit_*`` function without a spec (a misspelled hook).

        Raises:
            PluginError: naming the plugin and the unknown hook.
        """
        try:
            super().check_pending()
        except pluggy.PluginValidationError as exc:
            name = self.get_name(exc.plugin)
            raise PluginError(f"plugin {name!r}: {exc}", plugin_name=name) from exc

    def _check_hooks(self, name: str) -> None:
        """Reject wrappers and hooks without a spec at registration, not at first use."""
        for hook in self.get_hookcallers(self.get_plugin(name)) or []:
            for impl in hook.get_hookimpls():
                if impl.plugin_name != name:
                    continue
                problem = None
                if not hook.has_spec():
                    problem = f"{hook.name} is not a statekit hook (misspelled?)"
                elif impl.hookwrapper or impl.wrapper:
                    problem = f"{hook.name}: hook wrappers are not supported by statekit"
                if problem:
                    super().unregister(name=name)
                    raise pluggy.PluginValidationError(impl.plugin, problem)

    def register_builtin(self, factory: Any, name: str, version: str) -> bool:
        """Register a plugin that ships inside statekit's core once, recorded as ``built-in`` (a name
        blocked with ``STATEKIT_DISABLE_PLUGINS`` stays blocked).

        Args:
            factory: ``callable() -> plugin``, called only when the plugin is registered now.
            name: the plugin's name.
            version: statekit's version (recorded in the manifest like any plugin's).

        Returns:
            False when ``name`` is blocked, True otherwise (registered now or before).
        """
        if self.is_blocked(name):
            return False
        if self.get_plugin(name) is None:
            self.register(factory(), name=name)
            self.sources[name] = PluginSource(name, "built-in", "statekit", version)
        return True

    def manager_option_owners(self) -> dict[str, tuple[str, Any]]:
        """The manager-level options the registered plugins declare (``STATEKIT_MANAGER_OPTIONS``:
        option name -> default; validated in ``statekit_manager_options``).

        Returns:
            ``{option: (plugin name, default)}``.

        Raises:
            PluginError: two registered plugins declare the same option (naming both).
        """
        owners: dict[str, tuple[str, Any]] = {}
        for plugin_name, plugin in self.list_name_plugin():
            for option, default in dict(getattr(plugin, "STATEKIT_MANAGER_OPTIONS", None) or {}).items():
                if option in owners and owners[option][0] != plugin_name:
                    raise PluginError(
                        f"plugins {owners[option][0]!r} and {plugin_name!r} both declare the manager option {option!r}",
                        plugin_name=plugin_name,
                    )
                owners[option] = (plugin_name, default)
        return owners

    def take_manager_options(self, options: dict[str, Any]) -> dict[str, Any]:
        """Take the manager-level options out of a manager's keyword options.

        Args:
            options: ``CheckpointManager(...)``'s ``**options``; the declared manager-level
                ones are removed from it (in place), the rest stay checkpoint options.

        Returns:
            Every option the registered plugins declare (:meth:`manager_option_owners`):
            the value given, or the declared default.

        Raises:
            PluginMissingError: an option of an installed plugin (built-in or third-party) is
                given (a value other than its default) while ``STATEKIT_DISABLE_PLUGINS``
                blocks that plugin: the feature would silently not exist.
            PluginError: as :meth:`manager_option_owners`.
        """
        owners = self.manager_option_owners()
        taken = {option: options.pop(option, default) for option, (_, default) in owners.items()}
        blocked = [ep for ep in _installed_entry_points() if self.is_blocked(ep.name)] if options else []
        for option, value in list(options.items()):
            for ep in blocked:
                # a plugin module is cheap to import (the plugin contract): read its declaration
                declared = dict(getattr(ep.load(), "STATEKIT_MANAGER_OPTIONS", None) or {})
                if option not in declared:
                    continue
                if value is declared[option] or value == declared[option]:
                    del options[option]  # the default: the plugin would do nothing
                    break
                dist = getattr(getattr(ep, "dist", None), "name", None)
                raise PluginMissingError(
                    f"{option}={value!r} needs the plugin {ep.name!r}{f' ({dist})' if dist else ''}, which "
                    "STATEKIT_DISABLE_PLUGINS blocks: the feature would silently not exist",
                    plugin_name=ep.name,
                    distribution=dist,
                )
        return taken

    def require_owner(self, owner: str, distribution: str | None, what: str, then: str = "") -> None:
        """Check that the plugin a checkpoint's object was saved by can load it back.

        Args:
            owner: the plugin name recorded in the manifest (``objects[key]["owner"]``).
            distribution: the recorded ``owner_distribution``; None means ``statekit-<owner>``.
            what: the object, for the message: ``"<url>: 'model_0'"``.
            then: appended to the message (what the caller has not done yet).

        Raises:
            PluginMissingError: ``owner`` is not registered (not installed, or blocked by
                ``STATEKIT_DISABLE_PLUGINS``), naming the distribution to ``pip install``.
        """
        if self.get_plugin(owner) is not None:
            return
        broken = self.broken.get(owner)
        if broken is not None:
            raise PluginMissingError(
                f"{what} was saved by {broken.describe()}; it cannot load what it saved: fix or reinstall "
                f"{broken.source.distribution}{then}",
                plugin_name=owner,
                distribution=broken.source.distribution,
            )
        dist_name = distribution or f"statekit-{owner}"
        blocked = " (it is blocked by STATEKIT_DISABLE_PLUGINS)" if self.is_blocked(owner) else ""
        raise PluginMissingError(
            f"{what} was saved by plugin {owner!r}, which is not available{blocked}; pip install {dist_name}{then}",
            plugin_name=owner,
            distribution=dist_name,
        )

    def check_options(self, options: Mapping[str, Any], caller: Callable[..., Any] | None = None) -> None:
        """Warn once per name about an option that no registered plugin declares in its
        ``STATEKIT_OPTIONS`` (docs/hooks.md, "Calling rules").

        Args:
            options: the keyword options a caller passed through to the plugins.
            caller: the function or class that took them; its own parameter names are
                offered as suggestions (read only when an option is unknown).

        Warns:
            StatekitWarning: naming the option, the closest known name if any, the
                registered plugins, and those that declare no ``STATEKIT_OPTIONS``.
        """
        unknown = [name for name in options if name not in self._warned_options]
        if not unknown:
            return
        declared: set[str] = set()
        undeclared: list[str] = []
        for plugin_name, plugin in self.list_name_plugin():
            if plugin is None:
                continue
            names = getattr(plugin, "STATEKIT_OPTIONS", None)
            if names is None:
                undeclared.append(plugin_name)
            else:
                declared |= set(names)
        keywords = set(inspect.signature(caller).parameters) if caller is not None else set()
        keywords |= set(self.manager_option_owners())  # suggestions only: they are not checkpoint options
        for name in unknown:
            if name in declared:
                continue
            self._warned_options.add(name)
            close = difflib.get_close_matches(name, sorted(declared | keywords), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            plugins = ", ".join(sorted(n for n, p in self.list_name_plugin() if p is not None)) or "none"
            if undeclared:
                message = (
                    f"option {name!r} is declared by no registered plugin (registered: {plugins}), so it most "
                    f"likely does nothing{hint} (plugin(s) {', '.join(sorted(undeclared))} declare no "
                    f"STATEKIT_OPTIONS: if one of them reads {name!r}, it should declare it)"
                )
            else:
                message = f"option {name!r} is read by no registered plugin (registered: {plugins}), so it does nothing{hint}"
            warn_user(message, StatekitWarning)

    def refuse_broken_writers(self, manifest: Manifest | None, url: str) -> None:
        """Refuse to load a checkpoint holding state of a plugin that failed to import:
        that state cannot be restored, and a load without it would resume wrong.

        Args:
            manifest: the checkpoint's manifest (None: nothing to check).
            url: the checkpoint URL, for the message.

        Raises:
            PluginError: naming the plugin, its import error, what it wrote and what to do.
        """
        if not self.broken or manifest is None:
            return
        wrote: dict[str, list[str]] = {}
        for rel, entry in manifest.files.items():
            if entry.writer in self.broken:
                wrote.setdefault(entry.writer, []).append(rel)
        for key, obj in manifest.objects.items():
            if obj.owner in self.broken:
                wrote.setdefault(obj.owner, []).append(key)
        for name in manifest.records:
            if name in self.broken:
                wrote.setdefault(name, [])
        for name, what in sorted(wrote.items()):
            shown = f" ({', '.join(sorted(what)[:5])}{', ...' if len(what) > 5 else ''})" if what else ""
            raise PluginError(
                f"{url} holds state written by plugin {name!r}{shown}, and {self.broken[name].describe()}: "
                f"nothing was loaded; fix or reinstall {self.broken[name].source.distribution} to load it",
                plugin_name=name,
            )

    def copy_listing(self) -> CopyListing:
        """The :class:`CopyListing` the registered plugins declare: one plugin's as declared;
        none or several, the generic words (several: with all their markers)."""
        declared = [c for c in (getattr(p, "STATEKIT_COPY_LISTING", None) for p in self.get_plugins()) if c is not None]
        if len(declared) == 1:
            return declared[0]
        return CopyListing(frozenset().union(*(c.markers for c in declared)))

    def manages_rng(self) -> bool:
        """True if a registered plugin declares ``STATEKIT_MANAGES_RNG = True``."""
        return any(getattr(p, "STATEKIT_MANAGES_RNG", False) for p in self.get_plugins())


def _env_list(name: str) -> list[str]:
    return [part.strip() for part in os.environ.get(name, "").split(",") if part.strip()]


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


def build_plugin_manager(autoload: bool | None = None) -> PluginManager:
    """Build a new plugin manager: specs, blocked names, entry points, ``check_pending()``.

    Args:
        autoload: load plugins from entry points of group ``statekit``; defaults to True
            unless ``STATEKIT_DISABLE_PLUGIN_AUTOLOAD`` is set. False still loads the
            entry points of the statekit distribution itself (its built-in plugins).

    Returns:
        A new :class:`PluginManager` (a ``pluggy.PluginManager``).

    Warns:
        StatekitWarning: an entry point fails to import (naming the plugin, distribution,
            entry point and error, and ``STATEKIT_DISABLE_PLUGINS=<name>``); it is skipped
            and recorded in ``pm.broken``.

    Raises:
        PluginError: a plugin implements a hook that does not exist.
    """
    pm = PluginManager()
    for name in _env_list("STATEKIT_DISABLE_PLUGINS"):
        pm.set_blocked(name)
    if autoload is None:
        autoload = not _env_flag("STATEKIT_DISABLE_PLUGIN_AUTOLOAD")
    _load_entry_points(pm, builtin_only=not autoload)
    pm.check_pending()
    if _env_flag("STATEKIT_TRACE_PLUGINS"):
        pm.trace.root.setwriter(sys.stderr.write)
        pm.enable_tracing()
    return pm


def _statekit_distribution() -> Any:
    """statekit's own installed distribution, or None (a source tree on ``sys.path``)."""
    try:
        return metadata.distribution("statekit")
    except metadata.PackageNotFoundError:
        return None


def _installed_entry_points() -> list[Any]:
    """Every installed entry point of group ``statekit`` (the built-in ones included)."""
    return list(metadata.entry_points(group=ENTRY_POINT_GROUP))


def _load_entry_points(pm: PluginManager, *, builtin_only: bool = False) -> None:
    # Mirrors pluggy.PluginManager.load_setuptools_entrypoints, but attributes failures.
    if builtin_only:
        dist = _statekit_distribution()
        dists = [dist] if dist is not None else []
    else:
        dists = list(metadata.distributions())
    for dist in dists:
        for ep in dist.entry_points:
            if ep.group != ENTRY_POINT_GROUP or pm.is_blocked(ep.name) or pm.get_plugin(ep.name) is not None:
                continue
            dist_name = dist.metadata["name"]
            source = PluginSource(ep.name, "entry point", dist_name, dist.version, ep.value)
            try:
                plugin = ep.load()
            except Exception as exc:  # one broken plugin must not break every save, load and the CLI
                broken = pm.broken[ep.name] = BrokenPlugin(source, f"{type(exc).__name__}: {exc}")
                warn_user(
                    f"{broken.describe()}; it is skipped: checkpoints saved now do NOT hold its state, and "
                    f"checkpoints it wrote cannot be loaded. Fix or reinstall {dist_name}, or set "
                    f"STATEKIT_DISABLE_PLUGINS={ep.name} to skip it without this warning",
                    StatekitWarning,
                )
                continue
            pm.register(plugin, name=ep.name)
            pm.sources[ep.name] = source


_lock = threading.Lock()
_manager: PluginManager | None = None


def get_plugin_manager() -> PluginManager:
    """Return the process-wide plugin manager, building it on the first call.

    Returns:
        The :class:`PluginManager`; ``.register(obj, name=...)`` and
        ``.unregister(name=...)`` add and remove plugins in code.

    Raises:
        PluginError: as :func:`build_plugin_manager`.
    """
    global _manager
    with _lock:
        if _manager is None:
            _manager = build_plugin_manager()
        return _manager


@contextlib.contextmanager
def use_plugin_manager(pm: PluginManager) -> Iterator[PluginManager]:
    """Make ``pm`` the process-wide manager inside the block (tests, embedding hosts)."""
    global _manager
    with _lock:
        previous, _manager = _manager, pm
    try:
        yield pm
    finally:
        with _lock:
            _manager = previous


def reset_plugin_manager() -> None:
    """Forget the process-wide manager, so the next use rebuilds it (re-reads the env)."""
    global _manager
    with _lock:
        _manager = None


def call_each(
    pm: pluggy.PluginManager,
    hook_name: str,
    checkpoint: Any,
    kwargs: dict[str, Any],
    after_each: Any = None,
    *,
    guard_rng: bool = True,
) -> list[tuple[str, Any]]:
    """Call every implementation of ``hook_name`` one at a time in pluggy's order, each with
    ``checkpoint.plugin`` set to its name and under the RNG guard (docs/hooks.md, "Calling rules").

    Args:
        pm: the plugin manager.
        hook_name: one of the ``statekit_*`` hook names.
        checkpoint: the context passed as ``checkpoint`` (may be None for ``statekit_attach``).
        kwargs: every hook argument by name (``checkpoint`` included where the spec has it).
        after_each: optional ``callable(plugin_name: str) -> None`` after each call (the caller
            records what the plugin removed from ``models``/``objects``).
        guard_rng: False runs every implementation without the RNG guard (a hook called
            from a background thread while training runs: ``statekit_checkpoint_committed``).

    Returns:
        ``(plugin_name, result)`` for every implementation that returned something other
        than None, in call order.

    Raises:
        PluginError: an implementation raised (``plugin_name``, ``hook_name``, ``__cause__``; a plain
            ``StatekitError`` too); before ``statekit_load_state_pre``, the checkpoint holds state of
            a plugin that failed to import (:meth:`PluginManager.refuse_broken_writers`).
        StatekitError: a subclass raised by an implementation (``StateMismatchError``...) keeps its
            type, with ``plugin_name``/``hook_name`` set and a note naming them.
    """
    trace = _env_flag("STATEKIT_TRACE_PLUGINS")
    hook = getattr(pm.hook, hook_name)
    if hook_name == "statekit_load_state_pre" and getattr(pm, "broken", None) and checkpoint is not None:
        # every load path calls this before anything is restored: a plugin that wrote
        # state and cannot be called now would leave it behind without a word
        pm.refuse_broken_writers(checkpoint.manifest, checkpoint.url)
    results: list[tuple[str, Any]] = []
    for impl in reversed(hook.get_hookimpls()):
        name = impl.plugin_name
        if checkpoint is not None:
            checkpoint.plugin = name
        if trace:
            print(f"statekit: {hook_name} -> plugin {name!r}", file=sys.stderr)
        try:
            result = _call_one(impl, hook_name, [kwargs[arg] for arg in impl.argnames], guard_rng)
        finally:
            if checkpoint is not None:
                checkpoint.plugin = None
        if trace:
            print(f"statekit: {hook_name} <- plugin {name!r} done", file=sys.stderr)
        if after_each is not None:
            after_each(name)
        if result is not None:
            results.append((name, result))
    return results


def _call_one(impl: Any, hook_name: str, args: list[Any], guard_rng: bool) -> Any:
    """One implementation's call, under the RNG guard unless it manages the RNG itself;
    what it raises attributed to it (see :func:`call_each`)."""
    name = impl.plugin_name
    unguarded = not guard_rng or getattr(impl.plugin, "STATEKIT_MANAGES_RNG", False)
    try:
        with contextlib.nullcontext() if unguarded else rng_guard():
            return impl.function(*args)
    except StatekitError as exc:
        if type(exc) is StatekitError:  # misuse of the context: the plugin's fault
            raise PluginError(f"plugin {name!r} failed in {hook_name}: {exc}", plugin_name=name, hook_name=hook_name) from exc
        # statekit's specific errors keep their type so callers can catch them, attributed here
        if isinstance(exc, PluginError):
            exc.plugin_name = exc.plugin_name or name
            exc.hook_name = exc.hook_name or hook_name
        else:
            exc.plugin_name, exc.hook_name = name, hook_name  # type: ignore[attr-defined]
            exc.add_note(f"raised by plugin {name!r} in {hook_name}")
        raise
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as exc:  # also DCP's CheckpointException, a BaseException
        raise PluginError(
            f"plugin {name!r} failed in {hook_name}: {type(exc).__name__}: {exc}", plugin_name=name, hook_name=hook_name
        ) from exc


# Claims: a plugin claims a model by removing it (and, on save, its ``weights`` entry) from
# the lists it is handed, and an object by popping it from ``checkpoint.objects``; these
# ``after_each`` callbacks of :func:`call_each` attribute each removal to the plugin just
# called, so the manifest can record the owner.


def track_save_claims(
    checkpoint: Any, hook_models: list[Any], weights: list[Any], model_keys: dict[int, str], owners: dict[str, str]
) -> Callable[[str], None]:
    """``after_each`` for ``statekit_save_state_pre``: records ``owners[key] = plugin``.

    Args:
        checkpoint: the save's context (its ``objects`` are watched).
        hook_models: the ``models`` list handed to the hooks.
        weights: the ``weights`` list handed to the hooks (parallel to ``hook_models``).
        model_keys: ``id(model) -> stable key``.
        owners: filled with stable key -> plugin name.

    Returns:
        ``callable(plugin_name)``; it raises ``PluginError`` when a plugin left ``models`` and
        ``weights`` of different lengths.
    """
    state = {"models": {id(m) for m in hook_models}, "objects": set(checkpoint.objects)}

    def after_each(plugin: str) -> None:
        if len(weights) != len(hook_models):
            raise PluginError(
                f"plugin {plugin!r} left models ({len(hook_models)}) and weights ({len(weights)}) out of step: "
                "remove a model and its weights entry together",
                plugin_name=plugin,
                hook_name="statekit_save_state_pre",
            )
        now_models = {id(m) for m in hook_models}
        for removed in state["models"] - now_models:
            owners[model_keys[removed]] = plugin
        now_objects = set(checkpoint.objects)
        for removed in state["objects"] - now_objects:
            owners[removed] = plugin
        state["models"], state["objects"] = now_models, now_objects

    return after_each


def track_load_claims(
    checkpoint: Any, hook_models: list[Any], models: list[Any], keys: list[str], object_keys: list[str], taken: dict[str, str]
) -> Callable[[str], None]:
    """``after_each`` for ``statekit_load_state_pre``: records ``taken[key] = plugin`` for
    every model removed from ``hook_models`` and object popped from ``checkpoint.objects``.

    Args:
        checkpoint: the load's context.
        hook_models: the ``models`` list handed to the hooks.
        models: the load's models, parallel to ``keys``.
        keys: their stable keys.
        object_keys: stable keys of the other objects.
        taken: filled with stable key -> plugin name.

    Returns:
        ``callable(plugin_name)``.
    """

    def after_each(plugin: str) -> None:
        for model, key in zip(models, keys):
            if key not in taken and all(model is not x for x in hook_models):
                taken[key] = plugin
        for key in object_keys:
            if key not in taken and key not in checkpoint.objects:
                taken[key] = plugin

    return after_each
