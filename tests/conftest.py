"""Core test configuration: the statekit.testing fixtures (plugin managers, storage URLs, S3)."""

from __future__ import annotations

import os
from importlib.metadata import entry_points

# statekit.testing is a pytest11 plugin once statekit is installed with that entry point;
# registering it a second time through pytest_plugins would fail, so only ask for it when
# pytest does not load it by itself.
if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD") or not any(
    ep.value.split(":")[0] == "statekit.testing" for ep in entry_points(group="pytest11")
):
    pytest_plugins = ["statekit.testing"]
