"""The RNG guard of plugin calls: :func:`statekit.engine.rng_guard.rng_guard` (re-exported).

The guard lives in the engine layer because the data-loader position (which re-reads
consumed batches on resume, :mod:`statekit.engine.iterable`) needs it too, and the engine
may not import the hooks layer.
"""

from __future__ import annotations

from statekit.engine.rng_guard import rng_guard

__all__ = ["rng_guard"]
