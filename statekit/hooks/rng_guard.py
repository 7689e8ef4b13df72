"""The RNG guard of plugin calls: :func:`statekit.loaders.rng_guard.rng_guard` (re-exported).

The guard lives in the loaders layer because the data-loader position (which re-reads
consumed batches on resume, :mod:`statekit.loaders.iterable`, and replays the random states
of batches fetched ahead, :mod:`statekit.loaders.fetch_rng`) needs it too, and the loaders
may not import the hooks layer.
"""

from __future__ import annotations

from statekit.loaders.rng_guard import rng_guard

__all__ = ["rng_guard"]
