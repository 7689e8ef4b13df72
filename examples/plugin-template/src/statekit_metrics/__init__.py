"""statekit-metrics: an example statekit plugin (the plugin template of the statekit docs).

It writes ``metrics.json`` (the checkpoint's step and the JSON-able save options) into
every checkpoint and reads it back on load. Importing this package is cheap: besides the
standard library it imports only :mod:`statekit.plugin_api`, the names statekit promises
to plugins.
"""

from __future__ import annotations

from statekit_metrics.plugin import FILE, last_loaded

__version__ = "0.1.0"

__all__ = ["FILE", "__version__", "last_loaded"]
