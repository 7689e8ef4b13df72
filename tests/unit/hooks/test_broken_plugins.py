"""A plugin that fails to import: a save warns and goes on without its state, a load of a
checkpoint it wrote fails naming it (native and attached), ``statekit plugins`` lists it as
broken and exits 0."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import statekit

pytest.importorskip("accelerate")

from accelerate_helpers import prepared_linear  # noqa: E402


SOMETIMES_BROKEN = """
import os
from statekit import hookimpl

if os.environ.get("STATEKIT_TEST_BREAK_PLUGIN"):
    raise ImportError("needs torch 9")

@hookimpl
def statekit_save_state_pre(checkpoint):
    checkpoint.save_json("extra/mine.json", {"saved": True})
"""


@pytest.fixture
def plugin_site(tmp_path, monkeypatch):
    from plugin_helpers import PluginSite

    return PluginSite(tmp_path / "site", monkeypatch)


def _rebuilt(plugin_site, monkeypatch, module, broken):
    import sys

    from statekit.hooks import registry

    if broken:
        monkeypatch.setenv("STATEKIT_TEST_BREAK_PLUGIN", "1")
    else:
        monkeypatch.delenv("STATEKIT_TEST_BREAK_PLUGIN", raising=False)
    monkeypatch.delitem(sys.modules, module, raising=False)
    registry.reset_plugin_manager()


def test_a_broken_plugin_warns_at_save_and_its_checkpoints_refuse_to_load(plugin_site, monkeypatch, tmp_path):
    from statekit.hooks import registry

    module = plugin_site.add("mine", SOMETIMES_BROKEN)
    monkeypatch.setattr(registry, "_manager", None)  # restored after the test
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "optim": optimizer}
    statekit.save(str(tmp_path / "written-by-mine"), state)

    _rebuilt(plugin_site, monkeypatch, module, broken=True)
    with pytest.warns(statekit.StatekitWarning, match=r"plugin 'mine' .*failed to import: ImportError: needs torch 9.*do NOT hold its state.*STATEKIT_DISABLE_PLUGINS=mine") as caught:
        statekit.save(str(tmp_path / "without-mine"), state)  # saves, loudly without its state
    assert caught[0].filename == __file__
    statekit.load(str(tmp_path / "without-mine"), state)  # nothing of it there: loads
    before = model.weight.detach().clone()
    with pytest.raises(statekit.PluginError, match=r"written-by-mine holds state written by plugin 'mine' \(extra/mine.json\).*failed to import: ImportError: needs torch 9.*nothing was loaded") as info:
        statekit.load(str(tmp_path / "written-by-mine"), state)
    assert info.value.plugin_name == "mine"
    assert torch.equal(model.weight, before)


def test_an_attached_load_of_a_folder_a_broken_plugin_wrote_fails_naming_it(plugin_site, monkeypatch, tmp_path):
    from statekit.hooks import registry

    module = plugin_site.add("mine", SOMETIMES_BROKEN)
    monkeypatch.setattr(registry, "_manager", None)
    accelerator, (model, optimizer) = prepared_linear()
    statekit.attach(accelerator)
    accelerator.save_state(str(tmp_path / "ckpt"))

    _rebuilt(plugin_site, monkeypatch, module, broken=True)
    accelerator, (model, optimizer) = prepared_linear()
    with pytest.warns(statekit.StatekitWarning, match=r"plugin 'mine'.*failed to import"):
        statekit.attach(accelerator)
    before = model.weight.detach().clone()
    with pytest.raises(statekit.PluginError, match=r"holds state written by plugin 'mine' \(extra/mine.json\)"):
        accelerator.load_state(str(tmp_path / "ckpt"))
    assert torch.equal(model.weight, before)


def test_statekit_plugins_lists_a_broken_plugin_and_exits_0(plugin_site, monkeypatch):
    from click.testing import CliRunner

    from statekit.cli import main
    from statekit.hooks import registry

    plugin_site.add("broken", "raise ImportError('needs torch 9')\n", version="0.0.1")
    plugin_site.add("good", "from statekit import hookimpl\n\n@hookimpl\ndef statekit_save_state_pre(checkpoint):\n    pass\n")
    monkeypatch.setattr(registry, "_manager", None)
    result = CliRunner().invoke(main, ["plugins"])
    assert result.exit_code == 0, result.output
    assert "broken (broken)" in result.output
    assert "good" in result.output
    assert "broken: broken failed to import: ImportError: needs torch 9" in result.output
    assert "STATEKIT_DISABLE_PLUGINS=broken" in result.output

    registry.reset_plugin_manager()
    result = CliRunner().invoke(main, ["plugins", "--json"])
    assert result.exit_code == 0
    rows = {r["name"]: r for r in json.loads(result.output)}
    assert rows["broken"]["broken"] == "ImportError: needs torch 9"
    assert rows["good"]["broken"] is None
