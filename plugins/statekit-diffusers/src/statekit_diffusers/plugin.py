"""The statekit-diffusers hooks: diffusers/transformers models, their EMA and noise schedulers.

Registered from the entry point ``diffusers`` in group ``statekit``. Importing this module
never imports diffusers or transformers (``python -X importtime`` shows neither): models
are recognised through ``sys.modules`` (see :mod:`statekit_diffusers.layout`).

Save (``statekit_save_state_pre``), on every rank; files are written by rank 0 only (the
models are replicated):

* every model in ``models`` that is, once Accelerate/DDP/``torch.compile`` wrappers are
  stripped, a ``diffusers.ModelMixin`` whose parameters are not sharded (DTensor/FSDP2 or
  DeepSpeed ZeRO-3 models are left to the sharding plugins) is taken and written as
  ``<folder>/config.json`` plus ``<folder>/diffusion_pytorch_model.safetensors``, sharded
  with an index above ``max_shard_size``;
* so is a ``transformers.PreTrainedModel`` that is a pipeline component (a text encoder
  beside a UNet): the save holds a diffusers model or a noise scheduler, or a pipeline
  class is given, or a folder name is given for it in code (``diffusers_names``,
  :func:`statekit_diffusers.configure`); written with ``model.safetensors``. A
  transformers model alone (a GPT-2 under key ``model``) is left to the core, which names
  its files by its key and puts its frozen tensors in files that incremental saves reuse;
* every ``diffusers.training_utils.EMAModel`` in ``checkpoint.objects`` that can be paired
  with a model is taken and written as ``<folder>_ema/`` in the same layout (its shadow
  parameters under the model's parameter names, its counters in ``config.json`` as
  ``EMAModel.save_pretrained`` does, so ``EMAModel.from_pretrained`` reads the folder);
* every :class:`statekit_diffusers.NoiseScheduler` is taken and written as
  ``scheduler/scheduler_config.json``.

``checkpoint.records[<stable key>]`` says where each object went; load routes it back.

Load (``statekit_load_state_pre``): every model and object whose manifest owner is this
plugin is loaded in place (the optimizer keeps its parameters) after every key, shape and
dtype was checked; a mismatch raises :class:`statekit.StateMismatchError` before any
tensor is written.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from statekit.plugin_api import hookimpl
from statekit_diffusers import layout, loading, saving, settings
from statekit_diffusers.convert import PIPELINE_RECORD, convert
from statekit_diffusers.saving import EMA_COUNTERS

__all__ = [
    "EMA_COUNTERS",
    "PIPELINE_RECORD",
    "STATEKIT_CONVERTERS",
    "STATEKIT_OPTIONS",
    "statekit_load_state_pre",
    "statekit_save_state_pre",
]

STATEKIT_CONVERTERS = {"diffusers": convert}
"""Converters found by ``statekit convert SRC OUT --to diffusers``."""

STATEKIT_OPTIONS = frozenset(settings.OPTIONS)
"""The ``checkpoint.options`` this plugin reads (:mod:`statekit_diffusers.settings`)."""


@hookimpl
def statekit_save_state_pre(models: list[Any], weights: list[Any], output_dir: str, checkpoint: Any) -> None:
    """Take diffusers models (and transformers pipeline components), EMAs and noise
    schedulers; write their folders.

    See the module docstring. Folder names: given in code (``diffusers_names`` option or
    :func:`statekit_diffusers.configure`), else from the class (``unet``, ``vae``...),
    made unique with ``_1``, ``_2``.

    Raises:
        StatekitError: ambiguous EMA pairing, duplicate folder names given in code, a
            malformed option. (The host reports it as a PluginError; nothing is committed.)
    """
    opts = settings.resolve(checkpoint.options)
    taken, emas, schedulers = saving.collect(models, checkpoint, opts)
    if not (taken or emas or schedulers):
        return
    explicit, used = saving.reserve_folders(checkpoint, models, taken, emas + schedulers, opts)
    paired = saving.pair_emas(emas, taken, opts, explicit, used)
    scheduler_folders = {key: explicit.get(key) or layout.dedupe("scheduler", used) for key, _ in schedulers}
    saving.write_models(checkpoint, models, weights, taken, opts.max_shard_bytes)
    saving.write_emas(checkpoint, paired, opts.max_shard_bytes)
    saving.write_schedulers(checkpoint, schedulers, scheduler_folders)
    if opts.pipeline:
        checkpoint.records[PIPELINE_RECORD] = opts.pipeline


@hookimpl
def statekit_load_state_pre(models: list[Any], input_dir: str, checkpoint: Any) -> None:
    """Load every model, EMA and noise scheduler this plugin saved, in place, and take them.

    Every key, shape and dtype is checked (and every config read) before the first tensor
    is written, so a mismatch leaves all models untouched.

    Raises:
        StateMismatchError: a model or EMA does not fit its saved weights (keys listed).
        CorruptCheckpointError: a record or file is missing, malformed or fails verification.
    """
    if not checkpoint.records:
        return
    jobs: list[Callable[[], None]] = []
    mine_models = [m for m in models if loading.is_mine(checkpoint, checkpoint.key_of(m), ("model",))]
    for wrapped in mine_models:
        jobs.append(loading.prepare_model(checkpoint, checkpoint.key_of(wrapped), wrapped))
    mine_objects = [k for k in list(checkpoint.objects) if loading.is_mine(checkpoint, k, ("ema", "scheduler"))]
    for key in mine_objects:
        obj = checkpoint.objects[key]
        kind = (checkpoint.records.get(key) or {}).get("kind")
        if kind == "ema":
            jobs.append(loading.prepare_ema(checkpoint, key, obj))
        else:
            jobs.append(loading.prepare_scheduler(checkpoint, key, obj))
    for job in jobs:
        job()
    for wrapped in mine_models:
        models.pop(next(i for i, m in enumerate(models) if m is wrapped))
    for key in mine_objects:
        saving.claim(checkpoint.objects, key)
