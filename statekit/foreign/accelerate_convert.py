"""``statekit convert``: a directory written by ``Accelerator.save_state`` rewritten in the
statekit format, loading exactly as its source loads: Accelerate's files become statekit
objects; in an attach-mode source, statekit's and plugins' files are copied byte for byte
(checksums checked). docs/cli.md, ``statekit convert``; docs/migrating.md, "Converting old
checkpoints".
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from typing import Any

from statekit import format as fmt
from statekit.engine.commit import build_manifest, commit
from statekit.engine.context import ACCELERATE_WRITER, CORE, Checkpoint
from statekit.engine.entries import strip_wrapper_prefixes
from statekit.engine.locking import abandon_save, prepare_target
from statekit.checks.state_check import StateRecorder
from statekit.errors import CorruptCheckpointError, StatekitError, StatekitWarning
from statekit.foreign.detect import describe_folder
from statekit.foreign.accelerate import (
    ACCELERATE_RNG,
    accelerate_files,
    is_accelerate_checkpoint,
    pickle_files,
    read_model,
    read_pickle,
)
from statekit.format.manifest import read_manifest
from statekit.format.manifest_types import FileEntry, Manifest, ObjectEntry, StateDigest
from statekit.storage import Storage

CONVERTED_FROM = "converted_from"
"""Key of ``records["statekit"]`` naming the source format of a converted checkpoint."""

_CONVERTED_KINDS = {"model": "model", "pytorch_model": "model", "optimizer": "optimizer", "scheduler": "scheduler",
                    "dl_state_dict": "dataloader", "custom_checkpoint": "custom", "scaler": "scaler"}

_OWN_KEY = re.compile(r"^(dataloader_\d+|gradients)$")
"""Keys of the per-rank files (:func:`statekit.format.rank_path`) an attached save writes next to Accelerate's."""


def convert(
    src_url: str,
    out_url: str,
    *,
    allow_pickle: bool = False,
    storage_options: dict[str, Any] | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Rewrite a directory written by ``Accelerator.save_state`` (statekit attached or not) in the
    statekit format; it restores what ``statekit.load_state`` of the source restores
    (``sampler.bin`` is not converted; the manifest's ``step`` is None).

    Args:
        src_url: the Accelerate directory.
        out_url: the new checkpoint's URL.
        allow_pickle: permit unpickling the source's pickle files.
        storage_options: fsspec options for both URLs.
        overwrite: replace a committed checkpoint at ``out_url``.

    Returns:
        The committed manifest.

    Raises:
        PickleNotAllowedError: the source has pickle files and not ``allow_pickle`` (nothing written).
        CheckpointExistsError: ``out_url`` holds a committed checkpoint and not ``overwrite``.
        CorruptCheckpointError: a file of an attach-mode source differs from its manifest
            (names it; nothing is committed).
        StatekitError: ``src_url`` is not an Accelerate checkpoint.
    """
    src = Storage(src_url, storage_options)
    if not is_accelerate_checkpoint(src):
        raise StatekitError(f"{src_url} is not a directory written by Accelerator.save_state")
    names = accelerate_files(src.listdir())
    attached = _attached_manifest(src)
    pickled = pickle_files(names)
    if pickled and not allow_pickle:
        read_pickle(src, pickled[0], allow_pickle)  # raises, naming the file
    own = _own_files(src, attached)  # checked before anything is written
    out = Storage(out_url, storage_options)
    prepare_target(out, overwrite=overwrite, describe=describe_folder)
    try:
        world_size = attached.world_size if attached else max(1, sum(1 for n in names if n.startswith("random_states_")))
        checkpoint = Checkpoint(out, mode="save", world_size=world_size)
        own_keys = {found[0] for found in map(fmt.parse_rank_path, own) if found and _OWN_KEY.match(found[0])}
        recorder = StateRecorder()  # (the digest of what the files hold: a plain Accelerate folder has none)
        objects, counters = _convert_files(src, checkpoint, names, allow_pickle, _accelerate_model_keys(attached), own_keys,
                                           recorder)
        _copy_own_objects(src, checkpoint, own, own_keys, attached, objects)
        counter_files = checkpoint.save_state("accelerator", counters)
        objects["accelerator"] = ObjectEntry(kind="custom", owner=CORE, per_rank=False, files=tuple(sorted(counter_files)))
        if any(p.startswith(f"{ACCELERATE_RNG}/") for p in checkpoint.files):
            objects[ACCELERATE_RNG] = _object_entry(checkpoint, ACCELERATE_RNG, "rng", per_rank=True)
        digest = attached.state_digest if attached is not None and attached.state_digest is not None else recorder.digest()
        return commit(out, _converted_manifest(src, checkpoint, objects, attached, digest), exclusive=not overwrite)
    except BaseException:
        abandon_save(out, 0)
        raise


def _convert_files(
    src: Storage, checkpoint: Checkpoint, names: list[str], allow_pickle: bool, model_keys: dict[int, str], own_keys: set[str],
    recorder: StateRecorder,
) -> tuple[dict[str, ObjectEntry], dict[str, int]]:
    """Write every Accelerate file into ``checkpoint`` in ``names``' order; returns their
    ``objects`` entries and Accelerate's counters.
    """
    objects: dict[str, ObjectEntry] = {}
    counters = {"step": 0, "iteration": 0}  # Accelerate's step: the accumulation counter, not the training step
    for name in names:
        converted = _convert_file(src, checkpoint, name, allow_pickle, model_keys, own_keys, counters, recorder)
        if converted is not None:
            key, kind = converted
            objects[key] = _object_entry(checkpoint, key, kind, per_rank=kind == "dataloader")
    return objects, counters


def _copy_own_objects(
    src: Storage, checkpoint: Checkpoint, own: dict[str, FileEntry], own_keys: set[str], attached: Manifest | None,
    objects: dict[str, ObjectEntry],
) -> None:
    """Copy the files statekit and plugins wrote next to Accelerate's and add their objects."""
    for rel, entry in own.items():
        _copy_file(src, checkpoint, rel, entry)
    for key in sorted(own_keys):
        objects[key] = _object_entry(checkpoint, key, "dataloader" if key.startswith("dataloader_") else "custom", per_rank=True)
    for key, obj in (attached.objects if attached else {}).items():  # models a plugin (or a registered hook) saved
        if obj.owner not in (CORE, ACCELERATE_WRITER):
            objects[key] = obj


def _converted_manifest(src: Storage, checkpoint: Checkpoint, objects: dict[str, ObjectEntry], attached: Manifest | None,
                        state_digest: StateDigest | None) -> Manifest:
    """The converted checkpoint's manifest: the source's records (the core's replaced by
    :data:`CONVERTED_FROM`), plugin versions, metadata, fingerprint and ``state_digest``.
    """
    records = {k: v for k, v in (attached.records if attached else {}).items() if k != CORE}
    records[CORE] = {CONVERTED_FROM: "accelerate"}
    writers = {e.writer for e in checkpoint.files.values()} | {o.owner for o in objects.values()} | set(records)
    plugins = {k: v for k, v in (attached.plugins if attached else {}).items() if k in writers}
    metadata = {**(attached.metadata if attached else {}), "converted_from": src.url, "source_format": "accelerate"}
    return build_manifest(checkpoint, checkpoint.files, objects, plugins=plugins, metadata=metadata,
                          records=records, fingerprint=attached.fingerprint if attached else None,
                          state_digest=state_digest)


def loaders_left_as_they_are(manifest: Manifest, entries: list[Any], url: str) -> list[Any]:
    """The run's loader entries a converted checkpoint holds no state for: a load leaves them as
    they are, as the source's ``load_state`` does, and warns naming them. Empty when not converted.
    """
    if (manifest.records.get(CORE) or {}).get(CONVERTED_FROM) != "accelerate":
        return []
    absent = [e for e in entries if e.kind == "dataloader" and e.key not in manifest.objects]
    if absent:
        warnings.warn(
            f"{url}: converted from an Accelerate directory that saved no state for "
            f"{', '.join(e.key for e in absent)}: left as it is, as Accelerator.load_state of the source leaves it "
            "(its epoch restarts from the first batch; statekit.attach(accelerator) before saving keeps the position)",
            StatekitWarning,
            stacklevel=4,
        )
    return absent


def _attached_manifest(src: Storage) -> Manifest | None:
    """The manifest an attached accelerator committed in ``src``, or None (plain Accelerate)."""
    if not src.exists(fmt.MANIFEST_NAME):
        return None
    manifest = read_manifest(src)
    return manifest if manifest.layout(CORE) == "accelerate" else None


def _own_files(src: Storage, attached: Manifest | None) -> dict[str, FileEntry]:
    """The files statekit and plugins wrote next to Accelerate's (attach mode), by path;
    every file the manifest lists (Accelerate's too) must exist with its size."""
    if attached is None:
        return {}
    for rel, entry in attached.files.items():
        url = src.url_of(rel)
        if not src.exists(rel):
            raise CorruptCheckpointError(f"{url}: file is missing (listed in the manifest); nothing was converted", path=url)
        if src.size(rel) != entry.size_bytes:
            raise CorruptCheckpointError(
                f"{url}: size {src.size(rel)} bytes, the manifest says {entry.size_bytes}; nothing was converted", path=url
            )
    return {rel: e for rel, e in sorted(attached.files.items()) if e.writer != ACCELERATE_WRITER}


def _accelerate_model_keys(attached: Manifest | None) -> dict[int, str]:
    """Accelerate's model file number -> the model's key. Accelerate numbers the models it
    saved by position among those no plugin took (attach mode records the owners)."""
    if attached is None:
        return {}
    models = sorted((k for k, o in attached.objects.items() if o.kind == "model"), key=lambda k: int(k.rsplit("_", 1)[1]))
    return dict(enumerate(k for k in models if attached.objects[k].owner == ACCELERATE_WRITER))


def _copy_file(src: Storage, checkpoint: Checkpoint, rel: str, entry: FileEntry) -> None:
    """Copy one file byte for byte, recorded with its writer and rank; its checksum must be
    the source manifest's."""
    with src.open_read(rel) as f, checkpoint.open(rel, "wb") as out:
        while chunk := f.read(fmt.CHUNK_BYTES):
            out.write(chunk)
    copied = checkpoint.files[rel]
    if copied.checksum != entry.checksum or copied.size_bytes != entry.size_bytes:
        url = src.url_of(rel)
        raise CorruptCheckpointError(f"{url}: checksum {copied.checksum}, the manifest says {entry.checksum}; "
                                     "nothing was converted", path=url)
    checkpoint.files[rel] = dataclasses.replace(copied, writer=entry.writer, rank=entry.rank)


def _convert_file(
    src: Storage,
    checkpoint: Checkpoint,
    name: str,
    allow_pickle: bool,
    model_keys: dict[int, str],
    own_keys: set[str],
    counters: dict[str, int],
    recorder: StateRecorder,
) -> tuple[str, str] | None:
    """Write one Accelerate file into ``checkpoint``; returns ``(key, kind)`` of its object, or None."""
    stem = name.partition(".")[0]
    base, _, index = stem.rpartition("_") if re.search(r"_\d+$", stem) else (stem, "", "0")
    if base == "random_states":
        states = read_pickle(src, name, allow_pickle)
        counters["step"] = int(states.get("step", counters["step"]) or 0)
        checkpoint.save_state(fmt.rank_path(ACCELERATE_RNG, int(index)), states)
        return None
    kind = _CONVERTED_KINDS.get(base)
    if kind is None:
        return None
    key = "scaler" if kind == "scaler" else f"{kind}_{index}"
    if kind == "model":
        key = model_keys.get(int(index), key)
        tensors = strip_wrapper_prefixes(read_model(src, name, allow_pickle))
        checkpoint.save_tensors(f"{key}.safetensors", tensors)
        recorder.add(key, tensors)
    elif kind == "dataloader":
        if key in own_keys:  # attach mode: statekit's exact position replaces the loader's own state
            return None
        state = {"tracked": False, "stateful": read_pickle(src, name, allow_pickle)}  # as restore_loader takes it
        for rank in range(checkpoint.world_size):  # Accelerate loads this one file on every rank
            checkpoint.save_state(fmt.rank_path(key, rank), state)
    else:
        state = read_pickle(src, name, allow_pickle)
        checkpoint.save_state(key, state)
        recorder.add(key, state)
    return key, kind


def _object_entry(checkpoint: Checkpoint, key: str, kind: str, *, per_rank: bool) -> ObjectEntry:
    """The manifest ``objects`` entry of a converted object owned by the core."""
    prefix = f"{key}/" if per_rank else f"{key}."
    files = tuple(sorted(p for p in checkpoint.files if p.startswith(prefix)))
    return ObjectEntry(kind=kind, owner=CORE, per_rank=per_rank, files=files)
