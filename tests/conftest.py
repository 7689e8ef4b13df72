"""Core test configuration: the statekit.testing fixtures (plugin managers, storage URLs, S3).

statekit.testing is also a ``pytest11`` entry point named ``statekit.testing``; pytest
registers a plugin once per name, so asking for it here is harmless when the entry point
is loaded and needed when it is not (``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1``, or statekit
not installed with its entry points).
"""

pytest_plugins = ["statekit.testing"]
