"""Claims: which plugin took which model or object out of the core's path in a hook.

A plugin claims a model by removing it (and, on save, its ``weights`` entry) from the
lists it is handed, and an object by popping it from ``checkpoint.objects``; these
``after_each`` callbacks of :func:`statekit.hooks.registry.call_each` attribute each
removal to the plugin just called, so the manifest can record the owner.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from statekit.errors import PluginError


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
        ``callable(plugin_name)``.

    Raises:
        PluginError: (from the callback) a plugin left ``models`` and ``weights`` of
            different lengths.
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
