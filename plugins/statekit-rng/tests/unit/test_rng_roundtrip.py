"""Python, NumPy and torch CPU random states survive a save/load round trip."""

from __future__ import annotations

import random
import warnings

import numpy as np
import pytest
import torch

import statekit
import statekit.api.saveload
import statekit.hooks.registry
import statekit_rng.plugin as rng_plugin


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _draw() -> tuple[float, float, torch.Tensor]:
    return random.random(), float(np.random.rand()), torch.rand(3)


def _assert_same(a: tuple[float, float, torch.Tensor], b: tuple[float, float, torch.Tensor]) -> None:
    assert a[0] == b[0]
    assert a[1] == b[1]
    assert torch.equal(a[2], b[2])


def test_round_trip_restores_python_numpy_torch(pm, url: str, fake_devices) -> None:
    fake_devices(None)
    _seed_all(1)
    _draw()  # move away from the seeded state
    manifest = statekit.save(url, {"w": torch.arange(4.0)})
    expected = _draw()
    _seed_all(99)
    with warnings.catch_warnings():
        warnings.simplefilter("error", statekit.StatekitWarning)
        statekit.load(url, {"w": torch.zeros(4)})
    _assert_same(_draw(), expected)

    assert manifest.records["rng"] == {
        "format": 1,
        "world_size": 1,
        "device_type": None,
        "device_count": 0,
        "loaders": [],
    }
    assert {"rng/rank-00000.json", "rng/rank-00000.safetensors"} <= set(manifest.files)
    assert manifest.files["rng/rank-00000.json"].writer == "rng"
    assert manifest.plugins["rng"] == "0.1.0"


def test_save_does_not_shift_random_streams(pm, memory_url: str, fake_devices) -> None:
    fake_devices(None)
    _seed_all(5)
    before = _draw()
    _seed_all(5)
    statekit.save(memory_url, {"w": torch.ones(2)})
    _assert_same(_draw(), before)


def test_host_rng_guard_does_not_undo_restore(pm, memory_url: str, fake_devices) -> None:
    """Regression: without STATEKIT_MANAGES_RNG the host's guard puts back the states the
    plugin restored; the flag is what makes the restore stick."""
    fake_devices(None)
    assert rng_plugin.STATEKIT_MANAGES_RNG is True

    class Unflagged:  # the very same hooks, without the flag
        statekit_save_state_pre = staticmethod(rng_plugin.statekit_save_state_pre)
        statekit_load_state_pre = staticmethod(rng_plugin.statekit_load_state_pre)
        statekit_load_state_post = staticmethod(rng_plugin.statekit_load_state_post)

    bare = statekit.hooks.registry.build_plugin_manager(autoload=False)
    bare.register(Unflagged(), name="rng")  # same name: same records
    _seed_all(3)
    with statekit.hooks.registry.use_plugin_manager(bare):
        statekit.save(memory_url, {"w": torch.ones(2)})
    expected = _draw()

    _seed_all(77)
    scrambled = _draw()
    _seed_all(77)
    with statekit.hooks.registry.use_plugin_manager(bare):
        statekit.load(memory_url, {"w": torch.ones(2)})
    _assert_same(_draw(), scrambled)  # guarded: the restore was undone

    _seed_all(77)
    statekit.load(memory_url, {"w": torch.ones(2)})  # the installed plugin (flag set)
    _assert_same(_draw(), expected)


def test_no_unsaved_rng_warning_with_plugin(pm, memory_url: str, monkeypatch: pytest.MonkeyPatch, fake_devices) -> None:
    fake_devices(None)
    monkeypatch.setattr(statekit.api.saveload, "_warned_rng", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", statekit.StatekitWarning)
        statekit.save(memory_url, {"w": torch.ones(2)})

    monkeypatch.setenv("STATEKIT_DISABLE_PLUGINS", "rng")
    with statekit.hooks.registry.use_plugin_manager(statekit.hooks.registry.build_plugin_manager()):
        with pytest.warns(statekit.StatekitWarning, match="random-number-generator"):
            statekit.save(memory_url + "-2", {"w": torch.ones(2)})


def test_checkpoint_without_rng_records_loads_silently(
    memory_url: str, monkeypatch: pytest.MonkeyPatch, fake_devices
) -> None:
    fake_devices("cuda", 2)  # would warn about devices if the plugin acted
    monkeypatch.setattr(statekit.api.saveload, "_warned_rng", True)  # the core's one-time warning is not under test
    monkeypatch.setenv("STATEKIT_DISABLE_PLUGINS", "rng")
    with statekit.hooks.registry.use_plugin_manager(statekit.hooks.registry.build_plugin_manager()):
        manifest = statekit.save(memory_url, {"w": torch.ones(2)})
    assert "rng" not in manifest.records
    monkeypatch.delenv("STATEKIT_DISABLE_PLUGINS")
    _seed_all(8)
    expected = _draw()
    _seed_all(8)
    with statekit.hooks.registry.use_plugin_manager(statekit.hooks.registry.build_plugin_manager()):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            statekit.load(memory_url, {"w": torch.ones(2)})
    _assert_same(_draw(), expected)  # nothing restored, nothing shifted


def test_rank_file_is_verified(pm, tmp_path, fake_devices) -> None:
    fake_devices(None)
    url = str(tmp_path / "ckpt")
    statekit.save(url, {"w": torch.ones(2)})
    path = tmp_path / "ckpt" / "rng" / "rank-00000.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(statekit.CorruptCheckpointError, match="rng/rank-00000.safetensors") as info:
        statekit.load(url, {"w": torch.ones(2)})
    assert info.value.plugin_name == "rng"  # statekit's own errors keep their type, attributed


def test_newer_state_format_is_refused() -> None:
    state = rng_plugin.snapshot()
    state["format"] = 99
    with pytest.raises(statekit.FormatVersionError, match="format 99"):
        rng_plugin.restore(state, source="x/rng/rank-00000.json")
