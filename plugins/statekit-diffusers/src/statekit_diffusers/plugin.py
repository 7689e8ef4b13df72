"""The statekit-diffusers hooks (entry point ``diffusers`` in group ``statekit``).

What is taken, the folder layout, the records and the load checks: docs/plugins/diffusers.md.
Importing this module never imports diffusers or transformers (:mod:`statekit_diffusers.layout`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from statekit.plugin_api import hookimpl
from statekit_diffusers import layout, loading, saving, settings
from statekit_diffusers.convert import PIPELINE_RECORD, convert, export_source
from statekit_diffusers.saving import EMA_COUNTERS

__all__ = [
    "EMA_COUNTERS",
    "PIPELINE_RECORD",
    "STATEKIT_CONVERTERS",
    "STATEKIT_EXPORT_SOURCE",
    "STATEKIT_OPTIONS",
    "statekit_load_state_pre",
    "statekit_save_state_pre",
]

STATEKIT_CONVERTERS = {"diffusers": convert}
"""Converters found by ``statekit convert SRC OUT --to diffusers``."""

STATEKIT_EXPORT_SOURCE = export_source
"""``statekit.export_pretrained`` of a model this plugin saved (:func:`statekit_diffusers.convert.export_source`)."""

STATEKIT_OPTIONS = frozenset(settings.OPTIONS)
"""The ``checkpoint.options`` this plugin reads (:mod:`statekit_diffusers.settings`)."""


@hookimpl
def statekit_save_state_pre(models: list[Any], weights: list[Any], output_dir: str, checkpoint: Any) -> None:
    """Take diffusers models (and transformers pipeline components), EMAs and noise
    schedulers; write their folders (docs/plugins/diffusers.md).

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
    """Load every model, EMA and noise scheduler this plugin saved, in place, and take them;
    all are checked before the first tensor is written.

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
