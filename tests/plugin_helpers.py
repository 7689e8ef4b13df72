"""Throwaway plugin distributions for the tests of plugin discovery (``unit/hooks/``)."""

from __future__ import annotations

import importlib
import sys
import textwrap
import uuid
from importlib.metadata import entry_points

from statekit.hooks import registry as plugins


class PluginSite:
    """Throwaway distributions (``*.dist-info`` with an ``entry_points.txt``) on ``sys.path``."""

    def __init__(self, root, monkeypatch):
        self.root = root
        self.tag = uuid.uuid4().hex[:8]
        root.mkdir()
        monkeypatch.syspath_prepend(str(root))
        self._monkeypatch = monkeypatch
        installed = [ep.name for ep in entry_points(group=plugins.ENTRY_POINT_GROUP)]
        self.blocked = installed  # keep the really installed plugins out of these tests
        monkeypatch.setenv("STATEKIT_DISABLE_PLUGINS", ",".join(installed))

    def add(self, name, source, version="1.2.3"):
        module = f"statekit_throwaway_{name}_{self.tag}"
        (self.root / f"{module}.py").write_text(textwrap.dedent(source))
        dist = f"statekit_{name}_{self.tag}"
        info = self.root / f"{dist}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: statekit-{name}-{self.tag}\nVersion: {version}\n")
        (info / "entry_points.txt").write_text(f"[statekit]\n{name} = {module}\n")
        importlib.invalidate_caches()
        self._monkeypatch.delitem(sys.modules, module, raising=False)
        return module

    def distribution(self, name):
        return f"statekit-{name}-{self.tag}"
