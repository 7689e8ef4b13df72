"""statekit-diffusers: diffusers models, their EMA and noise schedulers in the diffusers folder layout.

The public names are for what the plugin cannot guess: :func:`configure` (settings for
saves that pass no options), :class:`NoiseScheduler` and :func:`convert`
(``statekit convert SRC OUT --to diffusers``); see docs/plugins/diffusers.md. Importing
this package does not import diffusers or transformers.
"""

from __future__ import annotations

__version__ = "0.1.0"

from statekit_diffusers.convert import convert
from statekit_diffusers.scheduler import NoiseScheduler
from statekit_diffusers.settings import configure

__all__ = ["NoiseScheduler", "__version__", "configure", "convert"]
