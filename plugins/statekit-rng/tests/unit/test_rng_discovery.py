"""The plugin is found through its entry point, and can be blocked by name."""

from __future__ import annotations

import pytest

import statekit.hooks.registry
import statekit_rng.plugin as rng_plugin


def test_entry_point_registers_plugin_rng(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STATEKIT_DISABLE_PLUGINS", raising=False)
    monkeypatch.delenv("STATEKIT_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    pm = statekit.hooks.registry.build_plugin_manager()
    assert pm.get_plugin("rng") is rng_plugin
    source = pm.sources["rng"]
    assert (source.origin, source.distribution, source.version, source.entry_point) == (
        "entry point",
        "statekit-rng",
        "0.1.0",
        "statekit_rng.plugin",
    )
    assert pm.manages_rng()
    hooks = {h.name for h in pm.get_hookcallers(rng_plugin)}
    assert hooks == {
        "statekit_boundary_state",
        "statekit_save_state_pre",
        "statekit_load_state_pre",
        "statekit_load_state_post",
    }


def test_disable_plugins_env_blocks_rng(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STATEKIT_DISABLE_PLUGINS", "rng")
    pm = statekit.hooks.registry.build_plugin_manager()
    assert pm.get_plugin("rng") is None
    assert pm.is_blocked("rng")
    assert not pm.manages_rng()


def test_hook_order_snapshot_first_restore_last(pm: statekit.hooks.registry.PluginManager) -> None:
    class Other:
        @statekit.hookimpl
        def statekit_save_state_pre(self, checkpoint):  # pragma: no cover - never called
            pass

        @statekit.hookimpl
        def statekit_load_state_post(self, checkpoint):  # pragma: no cover - never called
            pass

    pm.register(Other(), name="other")
    # statekit.hooks.registry.call_each calls reversed(get_hookimpls()): first in that order runs first.
    save_order = [i.plugin_name for i in reversed(pm.hook.statekit_save_state_pre.get_hookimpls())]
    load_order = [i.plugin_name for i in reversed(pm.hook.statekit_load_state_post.get_hookimpls())]
    assert save_order[0] == "rng"
    assert load_order[-1] == "rng"


def test_package_import_is_light() -> None:
    import statekit_rng

    assert statekit_rng.__version__ == "0.1.0"
