"""statekit-rng: the statekit plugin that saves and restores random-number-generator state.

Installing the distribution registers the plugin (entry point ``rng`` in group
``statekit``); nothing needs to be imported. The hooks live in :mod:`statekit_rng.plugin`,
which statekit imports when it builds its plugin manager. This package module imports
nothing heavy.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
