"""statekit-diffusers: diffusers models (and transformers models that are pipeline
components, such as a text encoder beside a UNet), their EMA and noise schedulers,
checkpointed by statekit in the diffusers folder layout, on any fsspec storage.

Install it and statekit finds it (entry point ``diffusers`` in group ``statekit``); no code
change is needed. The public names here are for what the plugin cannot guess:

* :func:`configure`: folder names, EMA pairing, pipeline class and shard size for saves
  that pass no options (``accelerator.save_state(dir)`` after ``statekit.attach``);
* :class:`NoiseScheduler`: makes a diffusers noise scheduler checkpointable, so its
  configuration is saved and exported with the pipeline;
* :func:`convert`: the ``statekit convert SRC OUT --to diffusers`` converter.

Importing this package does not import diffusers or transformers.
"""

from __future__ import annotations

__version__ = "0.1.0"

from statekit_diffusers.convert import convert
from statekit_diffusers.scheduler import NoiseScheduler
from statekit_diffusers.settings import configure

__all__ = ["NoiseScheduler", "__version__", "configure", "convert"]
