"""Accelerate's registered save/load pre-hooks (``register_save_state_pre_hook``:
``fn(models, weights, output_dir)``; ``register_load_state_pre_hook``: ``fn(models,
input_dir)``), run under ``statekit.save_state``/``load_state`` as the built-in plugin
:data:`HOOKS_PLUGIN` with the semantics of accelerate 1.x's ``Accelerator.save_state``
(https://github.com/huggingface/accelerate/blob/main/src/accelerate/accelerator.py); local
checkpoints only; in attach mode Accelerate runs them itself (docs/design-notes.md,
"Accelerate conformance").
"""

from __future__ import annotations

import os
import re
from typing import Any

from statekit._version import __version__
from statekit.errors import PluginError, StorageError
from statekit.hooks.registry import hookimpl
from statekit.storage import url_to_fs

HOOKS_PLUGIN = "accelerate-hooks"
"""Name of the built-in plugin that runs Accelerate's registered pre-hooks."""


_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+)://")


def accelerate_directory(directory: Any, mode: str) -> Any:
    """The directory to hand an attached accelerator's ``save_state``/``load_state``
    (``mode``): ``directory`` unchanged (None, a path), or the local path of a ``file://``
    URL, since Accelerate takes its argument as a local path (docs/migrating.md).

    Raises:
        StorageError: a URL of another scheme (``s3://``, ``memory://``...), or one with a
            single slash (``s3:/bucket``); the message names the statekit call to use.
    """
    if directory is None:
        return None
    url = os.fspath(directory)
    scheme = _SCHEME.match(url)
    if scheme is None:
        url_to_fs(url)  # raises for "s3:/bucket", which would be a local folder named "s3:"
        return directory
    if scheme.group(1).lower() in ("file", "local"):
        return url_to_fs(url)[1]
    use = (f"statekit.save_state(accelerator, {url!r}) or a statekit.CheckpointManager(accelerator, root) with this URL as root"
           if mode == "save" else
           f"statekit.load_state(accelerator, {url!r}) or CheckpointManager(accelerator, root).resume()")
    raise StorageError(
        f"accelerator.{mode}_state({url!r}) with statekit attached: Accelerate {'writes' if mode == 'save' else 'reads'} "
        f"local paths only (it would take this URL for a local folder named {scheme.group(1) + ':'!r}); "
        f"nothing was {'written' if mode == 'save' else 'loaded'}. Use {use}",
        url=url,
    )


def user_hooks(accelerator: Any, mode: str) -> list[Any]:
    """Functions registered on ``accelerator`` for ``mode`` ("save" or "load"), in
    registration order, without the ones :func:`statekit.attach` registered."""
    table = getattr(accelerator, "_save_model_state_pre_hook" if mode == "save" else "_load_model_state_pre_hook", None)
    return [h for h in (table or {}).values() if not getattr(h, "statekit_attach_hook", False)]


def require_user_load_hooks(checkpoint: Any, accelerator: Any) -> list[Any]:
    """The load pre-hooks the user registered on ``accelerator``, after checking that a model
    a save pre-hook of theirs saved (owner :data:`HOOKS_PLUGIN` in the manifest) has one to
    load it.

    Raises:
        PluginError: such a model and no load pre-hook registered (names the models and
            ``register_load_state_pre_hook``); nothing was loaded.
    """
    hooks = user_hooks(accelerator, "load")
    manifest = getattr(checkpoint, "manifest", None)
    owned = sorted(k for k, o in (manifest.objects.items() if manifest is not None else ()) if o.owner == HOOKS_PLUGIN)
    if owned and not hooks:
        raise PluginError(
            f"{checkpoint.url}: {', '.join(owned)} was saved by a function registered with "
            "accelerator.register_save_state_pre_hook; register its load counterpart with "
            "accelerator.register_load_state_pre_hook before loading (nothing was loaded)",
            plugin_name=HOOKS_PLUGIN,
            hook_name="statekit_load_state_pre",
        )
    return hooks


def _runs_here(checkpoint: Any) -> bool:
    return checkpoint.accelerator is not None and not getattr(checkpoint, "accelerate_runs_hooks", False)


def _local_dir(checkpoint: Any, hooks: list[Any], mode: str) -> str:
    path = checkpoint.storage.local_path()
    if path is not None:
        return path
    names = ", ".join(getattr(h, "__qualname__", repr(h)) for h in hooks)
    raise PluginError(
        f"{checkpoint.url}: the accelerator has {mode}_state pre-hooks registered with Accelerate ({names}); "
        "they write and read local paths, so statekit runs them only for checkpoints on local disk. "
        "Save locally, or port them to a statekit plugin (statekit_save_state_pre/statekit_load_state_pre)",
        plugin_name=HOOKS_PLUGIN,
        hook_name=f"statekit_{mode}_state_pre",
    )


class AccelerateHooks:
    """The built-in plugin that runs an accelerator's registered pre-hooks (see the module)."""

    STATEKIT_OPTIONS: frozenset[str] = frozenset()  # reads no checkpoint.options

    @hookimpl(tryfirst=True)
    def statekit_save_state_pre(self, models: list[Any], weights: list[Any], checkpoint: Any) -> None:
        """Run the save pre-hooks; a removed ``weights`` entry takes its model."""
        if not _runs_here(checkpoint):
            return
        hooks = user_hooks(checkpoint.accelerator, "save")
        if not hooks:
            return
        directory = _local_dir(checkpoint, hooks, "save")
        hook_models, hook_weights = list(models), list(weights)
        for hook in hooks:
            hook(hook_models, hook_weights, directory)
        if len(hook_weights) == len(weights):  # nothing popped: Accelerate saves weights[i] as model i,
            weights[:] = hook_weights  # so an entry a hook replaced is what gets written
        else:
            kept = {id(w) for w in hook_weights}
            for i in reversed(range(len(weights))):
                if id(weights[i]) not in kept:
                    del models[i], weights[i]
        checkpoint.record_unlisted_at_commit = HOOKS_PLUGIN

    @hookimpl(tryfirst=True)
    def statekit_load_state_pre(self, models: list[Any], checkpoint: Any) -> None:
        """Run the load pre-hooks; a model removed from ``models`` is theirs to load."""
        if not _runs_here(checkpoint):
            return
        hooks = require_user_load_hooks(checkpoint, checkpoint.accelerator)
        if not hooks:
            return
        directory = _local_dir(checkpoint, hooks, "load")
        hook_models = list(models)
        for hook in hooks:
            hook(hook_models, directory)
        kept = {id(m) for m in hook_models}
        models[:] = [m for m in models if id(m) in kept]


def ensure_registered(pm: Any) -> None:
    """Register :class:`AccelerateHooks` as :data:`HOOKS_PLUGIN` on ``pm`` once (a name
    blocked with ``STATEKIT_DISABLE_PLUGINS`` stays blocked)."""
    pm.register_builtin(AccelerateHooks, HOOKS_PLUGIN, __version__)
