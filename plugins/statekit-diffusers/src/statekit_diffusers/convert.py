"""``statekit convert CKPT OUT --to diffusers``: export a checkpoint as a diffusers pipeline folder.

The output is what ``DiffusionPipeline.save_pretrained`` writes (diffusers
``pipelines/pipeline_utils.py``); which weights and pipeline class: docs/plugins/diffusers.md.
"""

from __future__ import annotations

from typing import Any

from statekit.plugin_api import (
    CHUNK_BYTES,
    Checkpoint,
    CheckpointExistsError,
    CorruptCheckpointError,
    Manifest,
    ModelSource,
    StatekitError,
    StatekitWarning,
    Storage,
    read_manifest,
    TensorFiles,
    storage_errors,
    warn_user,
)

from statekit_diffusers import layout

PLUGIN_NAME = "diffusers"
"""The name statekit-diffusers is registered under (its records in the manifest)."""

PIPELINE_RECORD = "_pipeline"
"""Records key of the pipeline class name (never a stable key: those start with a letter or digit)."""


def convert(
    src_url: str,
    out_url: str,
    *,
    storage_options: dict[str, Any] | None = None,
    pipeline_class: str | None = None,
    ema: bool = True,
    plugin_name: str = PLUGIN_NAME,
) -> dict[str, Any]:
    """Write the diffusers/transformers models of a statekit checkpoint as a pipeline folder.

    Args:
        src_url: a committed statekit checkpoint (any fsspec URL).
        out_url: the folder to create (any fsspec URL); must not exist or be empty.
        storage_options: fsspec options for both URLs.
        pipeline_class: pipeline class name for ``model_index.json``; overrides the recorded one.
        ema: export EMA weights for models that have an EMA in the checkpoint.
        plugin_name: the name statekit-diffusers was registered under when saving.

    Returns:
        The ``model_index.json`` content written (``{}`` when none was).

    Raises:
        CheckpointNotFoundError, IncompleteCheckpointError, FormatVersionError: ``src_url``
            is not a committed checkpoint.
        StatekitError: the checkpoint holds no model saved by statekit-diffusers.
        CheckpointExistsError: ``out_url`` exists and is not empty.
        CorruptCheckpointError: a copied file does not match the manifest (names it).
        StorageError: reading or writing failed (names the URL).
    """
    src = Storage(src_url, storage_options)
    manifest = read_manifest(src)
    records = manifest.records.get(plugin_name) or {}
    entries = {k: r for k, r in records.items() if isinstance(r, dict) and isinstance(r.get("folder"), str)}
    if not any(r.get("kind") == "model" for r in entries.values()):
        raise StatekitError(f"{src.url}: no diffusers or transformers model was saved by statekit-diffusers in this checkpoint")
    out = Storage(out_url, storage_options)
    out.invalidate()
    if out.listdir():
        raise CheckpointExistsError(f"{out.url} exists and is not empty; choose a new folder for the export")
    index = _copy_components(Checkpoint(src, mode="load", manifest=manifest, verify=True), out, entries, ema)
    pipeline = pipeline_class or records.get(PIPELINE_RECORD) or _infer_pipeline(entries)
    if pipeline is None:
        warn_user(
            f"{out.url}: wrote the component folders ({', '.join(sorted(index))}) but no model_index.json: "
            "say which pipeline they form (save with diffusers_pipeline='StableDiffusionPipeline', "
            "or convert(..., pipeline_class=...))",
            StatekitWarning,
        )
        return {}
    model_index = {"_class_name": pipeline, "_diffusers_version": layout.library_version(layout.DIFFUSERS), **index}
    out.write_bytes("model_index.json", layout.hf_json(model_index))
    return model_index


def _copy_components(checkpoint: Checkpoint, out: Storage, entries: dict[str, dict[str, Any]], ema: bool) -> dict[str, Any]:
    """Copy each model's config and weights (its EMA's with ``ema``) and each scheduler's
    config into their folders under ``out``; returns ``model_index.json``'s components
    (``folder -> [library, class]``)."""
    models = {k: r for k, r in entries.items() if r.get("kind") == "model"}
    emas = {r.get("model_key"): r for r in entries.values() if r.get("kind") == "ema" and r.get("model_key")}
    index: dict[str, Any] = {}
    for key, rec in sorted(models.items(), key=lambda kv: kv[1]["folder"]):
        folder = rec["folder"]
        weights_from = emas[key]["folder"] if ema and key in emas else folder
        _copy(checkpoint, out, f"{folder}/{layout.CONFIG_NAME}", f"{folder}/{layout.CONFIG_NAME}")
        for rel in _weight_files(checkpoint.manifest, weights_from, rec["library"]):
            _copy(checkpoint, out, rel, f"{folder}/{rel.split('/', 1)[1]}")
        index[folder] = [rec["library"], rec["class"]]
    for rec in entries.values():
        if rec.get("kind") == "scheduler":
            rel = f"{rec['folder']}/{layout.SCHEDULER_CONFIG_NAME}"
            _copy(checkpoint, out, rel, rel)
            index[rec["folder"]] = [rec.get("library", layout.DIFFUSERS), rec["class"]]
    return index


def _infer_pipeline(entries: dict[str, dict[str, Any]]) -> str | None:
    kinds = sorted((r.get("kind"), r.get("folder")) for r in entries.values() if r.get("kind") in ("model", "scheduler"))
    if kinds == [("model", "unet"), ("scheduler", "scheduler")]:
        return "DDPMPipeline"
    return None


def _weight_files(manifest: Manifest, folder: str, library: str) -> list[str]:
    """The weight files (and shard index) of a saved folder, from the manifest."""
    stem = layout.WEIGHTS_NAME[library].rsplit(".", 1)[0]
    files = sorted(
        rel
        for rel in manifest.files
        if rel.startswith(f"{folder}/") and rel.count("/") == 1 and rel.split("/", 1)[1].startswith(stem)
    )
    if not files:
        raise CorruptCheckpointError(f"the manifest lists no weights under {folder}/", path=folder)
    return files


def _copy(checkpoint: Checkpoint, out: Storage, rel: str, out_rel: str) -> None:
    """Stream one file from the checkpoint to the export; the checkpoint's verifying reader
    checks size and checksum against the manifest when the whole file has been read."""
    url = f"{checkpoint.url}/{rel}"
    try:
        with checkpoint.open(rel, "rb") as f, storage_errors(url, "reading"), out.open_write(out_rel) as g:
            while chunk := f.read(CHUNK_BYTES):
                g.write(chunk)
    except CorruptCheckpointError as exc:
        out.remove(out_rel)
        raise CorruptCheckpointError(f"{exc}; the export at {out.url} is incomplete", path=exc.path) from None


def export_source(checkpoint: Checkpoint, key: str) -> ModelSource | None:
    """The ``STATEKIT_EXPORT_SOURCE`` of this plugin (``statekit.export_pretrained``): model
    ``key``'s folder, its weight files read one tensor at a time (named as the library
    names them: ``diffusion_pytorch_model`` or ``model``) and its ``config.json``; the
    model's own weights, not its EMA's. None for a key this plugin did not save as a model.
    """
    manifest = checkpoint.manifest
    record = ((manifest.records.get(PLUGIN_NAME) if manifest is not None else None) or {}).get(key)
    if manifest is None or not isinstance(record, dict) or record.get("kind") != "model" or not isinstance(record.get("folder"), str):
        return None
    folder, library = record["folder"], record["library"]
    with checkpoint.open(f"{folder}/{layout.CONFIG_NAME}", "rb") as f:
        config = f.read()
    weights = [rel for rel in _weight_files(manifest, folder, library) if rel.endswith(".safetensors")]
    stem = layout.WEIGHTS_NAME[library].rsplit(".", 1)[0]
    return TensorFiles(checkpoint, weights).source(files={layout.CONFIG_NAME: config}, weights_name=stem)

