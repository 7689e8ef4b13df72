"""What a native load reads and in what order (:class:`LoadPlan`), each object's read, and
whole-checkpoint verification. No plugin code runs here (:mod:`statekit.api.loading` runs
the hooks); the sequence is in docs/design-notes.md ("The map", "Loads check everything
before they copy anything").
"""

from __future__ import annotations

import copy
import logging
import re
from collections.abc import Mapping
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from statekit import format as fmt
from statekit.checks import next_batch
from statekit.loaders import data
from statekit.engine.context import CORE, Checkpoint
from statekit.engine.entries import Entry, check_fit, unwrap_model
from statekit.engine.file_reader import FileReader
from statekit.engine.gradients import AccumulatedGradients
from statekit.engine import references
from statekit.engine.incremental import is_frozen_file
from statekit.engine.optimizer_fit import check_optimizer_fit, check_scheduler_fit, parameter_names
from statekit.errors import CorruptCheckpointError, StateMismatchError, StorageError
from statekit.progress import progress
from statekit.format.manifest import read_manifest
from statekit.format.manifest_types import Manifest, ObjectEntry
from statekit.storage import Storage

logger = logging.getLogger("statekit")


@dataclass
class LoadPlan:
    """A native load of ``entries`` (every key in the manifest): inside :meth:`files_open`,
    :meth:`check_before_hooks`, then the caller's ``statekit_load_state_pre``, then
    :meth:`read` of what no plugin took.

    Attributes:
        strict: as :func:`load_models`.
        incompatible: after :meth:`read`, stable key -> missing and unexpected keys.
        not_restored: after :meth:`read`, what could not be restored (for one warning).
    """

    checkpoint: Checkpoint
    entries: list[Entry]
    accelerator: Any = None
    strict: bool = True
    incompatible: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    not_restored: list[str] = field(default_factory=list)

    @property
    def saved_objects(self) -> Mapping[str, ObjectEntry]:
        """The manifest's ``objects``."""
        return self.checkpoint.reader.manifest.objects

    @contextmanager
    def files_open(self) -> Iterator[None]:
        """Each file opened and its header parsed once within the block
        (:meth:`statekit.Checkpoint.reading_each_file_once`).

        Raises:
            StorageError: closing a file failed (only when the block did not raise).
        """
        with self.checkpoint.reader.session():
            yield

    def check_before_hooks(self) -> None:
        """:func:`check_entries` of every core-owned entry, before anything is loaded."""
        names = parameter_names(unwrap_model(e.obj, self.accelerator) for e in self.entries if e.kind == "model")
        core = [e for e in self.entries if self.saved_objects[e.key].owner == CORE]
        check_entries(self.checkpoint, core, self.saved_objects, names)

    def read(self, models: list[Any], taken: Mapping[str, str]) -> None:
        """Read what no plugin took (``taken``: ``{key: plugin}``): every model's fit, the
        ``early`` objects all or nothing, the models, the ``late`` ones (:func:`split_for_load`),
        with fresh memory made ahead for the later tensor files.

        Raises:
            StateMismatchError: an object or model does not fit (what was applied before it
                is put back, or the message says what is loaded).
            CorruptCheckpointError: a file fails verification (names it).
        """
        keys = [e.key for e in self.entries if e.kind == "model"]
        core = [(unwrap_model(m, self.accelerator), k) for m, k in zip(models, keys) if k not in taken]
        core_models, core_keys = [m for m, _ in core], [k for _, k in core]
        early, late = split_for_load([e for e in self.entries if e.kind != "model" and e.key not in taken])
        saved, checkpoint = self.saved_objects, self.checkpoint
        ahead = tensor_files_of(checkpoint, early + late, saved) if loads_in_place(core_models) else []
        with checkpoint.reader.fresh_memory_ahead(ahead):
            check_models(checkpoint, core_models, core_keys, saved, self.strict)  # every model first
            self.not_restored += load_entries_undoable(checkpoint, early, saved)  # put back if one refuses
            self.incompatible = load_models(checkpoint, core_models, core_keys, saved, self.strict)
            self.not_restored += _load_after_models(checkpoint, late, saved)


def load_models(
    checkpoint: Checkpoint,
    core_models: list[torch.nn.Module],
    keys: list[str],
    saved_objects: Mapping[str, ObjectEntry],
    strict: bool = True,
) -> dict[str, dict[str, list[str]]]:
    """Fill every model (unwrapped, parallel to ``keys``) in place from its
    ``<key>.safetensors`` (or codec file), each checked against its saved keys, shapes and
    dtypes first. ``strict=False`` loads the keys model and checkpoint share, as
    ``load_state_dict(strict=False)``; shapes and dtypes must still match.

    Returns:
        Stable key -> ``{"missing_keys": [...], "unexpected_keys": [...]}`` (empty lists
        when strict).

    Raises:
        StateMismatchError: a model does not fit (that model is untouched).
        CorruptCheckpointError: a file fails verification (names it).
    """
    return {key: load_model(checkpoint, key, model, saved_objects[key], strict) for model, key in zip(core_models, keys)}


def check_models(
    checkpoint: Checkpoint,
    core_models: list[torch.nn.Module],
    keys: list[str],
    saved_objects: Mapping[str, ObjectEntry],
    strict: bool = True,
) -> None:
    """Check every model against its saved keys, shapes and dtypes (from the headers)
    before any model is filled; arguments as :func:`load_models`.

    Raises:
        StateMismatchError: a model does not fit (every model is untouched).
        CorruptCheckpointError: a header is malformed (names the file).
    """
    for model, key in zip(core_models, keys):
        _fit_model(checkpoint, key, model, saved_objects[key], strict)


def check_entries(
    checkpoint: Checkpoint, entries: list[Entry], saved_objects: Mapping[str, ObjectEntry], names: Mapping[int, str] | None = None
) -> None:
    """Check that the saved state of every optimizer, scheduler and tensor among ``entries``
    fits it (:mod:`statekit.engine.optimizer_fit`; a tensor's shape and dtype), from the
    skeletons and headers only; ``names`` is ``id(parameter) -> name`` for the messages.

    Raises:
        StateMismatchError: a state does not fit (names the object, the file, the
            parameter and both shapes); nothing was loaded.
        CorruptCheckpointError: a state file is missing or malformed (names it).
    """
    files = checkpoint.reader.manifest.files if checkpoint.reader.manifest is not None else {}
    for e in entries:
        saved = saved_objects.get(e.key)
        if saved is None or e.kind not in ("optimizer", "scheduler", "tensor"):
            continue
        base = _state_base(checkpoint, e, saved)
        if f"{base}.json" not in files:
            continue  # per-rank state of another world size: reported when it is loaded
        where = f"{e.kind} {e.key!r} ({checkpoint.url}/{base}.json)"
        try:
            state = checkpoint.reader.load_state(base, shapes_only=True)
        except (TypeError, RuntimeError, NotImplementedError):
            continue  # a value that needs its data (a NumPy array): checked when it is applied
        if e.kind == "optimizer":
            check_optimizer_fit(where, e.obj, state, names)
        elif e.kind == "scheduler":
            check_scheduler_fit(where, e.obj, state)
        else:
            _check_tensor(where, e, state)


def split_for_load(entries: list[Entry]) -> tuple[list[Entry], list[Entry]]:
    """``(early, late)``: what is applied before the models (in the given order, all or
    nothing: :func:`load_entries_undoable`) and the optimizers and tensors applied after
    them, into memory made ahead while the models are read."""
    late = [e for e in entries if e.kind in ("optimizer", "tensor")]
    return [e for e in entries if e.kind not in ("optimizer", "tensor")], late


def _undoable(e: Entry) -> bool:
    """Whether a snapshot of the object's state puts it back (not a data loader's position,
    nor accumulated gradients, whose state at a sync point is "no gradients")."""
    return e.kind != "dataloader" and not isinstance(e.obj, AccumulatedGradients)


def load_entries_undoable(checkpoint: Checkpoint, entries: list[Entry], saved_objects: Mapping[str, ObjectEntry]) -> list[str]:
    """Restore ``entries`` as :func:`load_entries`, all or nothing: when one refuses its
    state (StateMismatchError, CorruptCheckpointError) the ones applied before it are put
    back from snapshots, except data loader positions and accumulated gradients."""
    not_restored: list[str] = []
    undo: list[tuple[Entry, Any]] = []
    try:
        for e in entries:
            if e.kind == "dict":
                undo.append((e, dict(e.obj)))
            elif _undoable(e):
                undo.append((e, copy.deepcopy(e.obj.state_dict())))
            _load_entry(checkpoint, e, saved_objects[e.key], not_restored)
    except BaseException:
        for e, before in reversed(undo):
            if e.kind == "dict":
                e.obj.clear()
                e.obj.update(before)
            else:
                e.obj.load_state_dict(before)
        raise
    return not_restored


def load_entries(checkpoint: Checkpoint, entries: list[Entry], saved_objects: Mapping[str, ObjectEntry]) -> list[str]:
    """Restore every non-model entry; returns what could not be restored (per-rank state
    of a rank the checkpoint has no file for), for one warning.

    Raises:
        StateMismatchError: an object refused its state (names the object and file).
    """
    not_restored: list[str] = []
    for e in entries:
        _load_entry(checkpoint, e, saved_objects[e.key], not_restored)
    return not_restored


def _load_after_models(checkpoint: Checkpoint, late: list[Entry], saved_objects: Mapping[str, ObjectEntry]) -> list[str]:
    """The optimizers and tensors, applied after the models (their fit was checked before
    anything was loaded; what can still fail is a damaged file): an error says what is loaded."""
    try:
        return load_entries(checkpoint, late, saved_objects)
    except (CorruptCheckpointError, StateMismatchError) as exc:
        note = (
            f" (the models and every object but {', '.join(repr(e.key) for e in late)} are loaded; "
            "load a good checkpoint before training)"
        )
        if isinstance(exc, CorruptCheckpointError):
            raise CorruptCheckpointError(f"{exc}{note}", path=exc.path) from exc
        raise StateMismatchError(f"{checkpoint.url}", reason=f"{exc}{note}") from exc


def tensor_files_of(checkpoint: Checkpoint, entries: list[Entry], saved_objects: Mapping[str, ObjectEntry]) -> list[str]:
    """The tensor files :func:`load_entries` reads for ``entries`` on this rank, in order
    (a file the checkpoint lacks included: the caller filters), for
    :meth:`statekit.Checkpoint.fresh_memory_ahead`."""
    rels = []
    for e in entries:
        saved = saved_objects.get(e.key)
        if e.kind == "dataloader" and saved is not None and saved.per_rank:
            continue
        rels.append(f"{_state_base(checkpoint, e, saved)}.safetensors")
    return rels


def loads_in_place(models: list[torch.nn.Module]) -> bool:
    """Whether every parameter and buffer of ``models`` is on the CPU (their files are read
    in place, so memory made ahead for later files adds nothing to the peak). Not
    ``state_dict()``: FSDP1's gathers the whole model."""
    return all(t.device.type == "cpu" for m in models for t in (*m.parameters(), *m.buffers()))


def _state_base(checkpoint: Checkpoint, e: Entry, saved: ObjectEntry | None) -> str:
    """Where an entry's state files are: ``<key>``, or ``<key>/rank-<rank>`` for per-rank state."""
    return fmt.rank_path(e.key, checkpoint.rank) if saved is not None and saved.per_rank else e.key


def _fit_model(
    checkpoint: Checkpoint, key: str, model: torch.nn.Module, saved: ObjectEntry, strict: bool = True
) -> tuple[dict[str, Any], set[str], dict[str, list[str]]]:
    """Check one model against its saved state (the tensor file's header, or a codec
    file's shapes) without filling it.

    Returns:
        ``(targets, saved keys, report)``: the model's state dict, the saved keys, and the
        missing and unexpected keys (empty when strict).
    """
    files = saved.files or [f"{key}.safetensors"]
    targets = model.state_dict()
    if f"{key}.json" in files:  # a model with extra (non-tensor) state, stored through the codec
        try:
            state = checkpoint.reader.load_state(key, shapes_only=True)
        except (TypeError, RuntimeError, NotImplementedError):
            state = checkpoint.reader.load_state(key)
        shapes = {k: (tuple(v.shape), v.dtype) for k, v in state.items() if isinstance(v, torch.Tensor)}
        return targets, set(state), _check_model_state(checkpoint, key, f"{key}.json", targets, shapes, set(state), strict)
    rels = model_tensor_files(key, files)
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for rel in rels:
        header = checkpoint.reader.tensor_header(rel)  # kept open for load_model's read (Checkpoint.reading_each_file_once)
        for e in header.entries:
            if e.name in shapes:
                raise CorruptCheckpointError(f"{checkpoint.url}/{rel}: tensor {e.name!r} is also in another file of model {key!r}", path=f"{checkpoint.url}/{rel}")
            shapes[e.name] = (e.shape, e.dtype)
        for alias, name in header.aliases.items():
            shapes[alias] = shapes[name]
    referenced = checkpoint.referenced(key, model)  # frozen tensors a pretrained folder holds (engine/references.py)
    if referenced is not None:
        shapes.update(referenced.shapes())
    return targets, set(shapes), _check_model_state(checkpoint, key, rels[0], targets, shapes, set(shapes), strict)


def model_tensor_files(key: str, files: tuple[str, ...] | list[str]) -> list[str]:
    """A core model's tensor files among ``files`` (``manifest.files`` or the object's
    ``files``): ``<key>.safetensors``, then its frozen files of an incremental save
    (format ``statekit/2``) in name order."""
    return [f"{key}.safetensors"] + sorted(rel for rel in files if is_frozen_file(key, rel))


def custom_load(model: torch.nn.Module) -> str | None:
    """Why filling the unwrapped ``model``'s tensors in place would skip load code of its
    own (load hooks, a ``_load_from_state_dict`` or ``load_state_dict`` override outside
    torch.nn), naming the module and its class; None when it would not. Such a model loads
    through ``load_state_dict`` (docs/api.md, "statekit.load")."""
    if type(model).load_state_dict is not torch.nn.Module.load_state_dict:
        return f"{type(model).__name__} overrides load_state_dict"
    for name, module in model.named_modules():
        where = f"module {name or '(root)'!r} ({type(module).__name__})"
        if module._load_state_dict_pre_hooks or module._load_state_dict_post_hooks:
            return f"{where} has load_state_dict hooks"
        override = type(module)._load_from_state_dict
        owner = next(c for c in type(module).__mro__ if "_load_from_state_dict" in vars(c))
        if override is not torch.nn.Module._load_from_state_dict and not owner.__module__.startswith("torch.nn."):
            return f"{where} overrides _load_from_state_dict"
    return None


def load_model(
    checkpoint: Checkpoint, key: str, model: torch.nn.Module, saved: ObjectEntry, strict: bool = True
) -> dict[str, list[str]]:
    """Fill one model in place (see :func:`load_models`); returns its missing and
    unexpected keys (empty when strict)."""
    targets, saved_keys, report = _fit_model(checkpoint, key, model, saved, strict)
    if f"{key}.json" in (saved.files or ()):
        model.load_state_dict(checkpoint.reader.load_state(key), strict=strict)
        return report
    custom = custom_load(model)
    if custom is not None:  # its own load code must run: read into fresh tensors, then load_state_dict
        logger.debug("model %r: %s; loading through load_state_dict", key, custom)
        state: dict[str, torch.Tensor] = {}
        for rel in model_tensor_files(key, saved.files or ()):
            state.update(checkpoint.reader.load_tensors(rel))
        if checkpoint.referenced(key) is not None:
            state.update(checkpoint.referenced(key).load())
        model.load_state_dict(state, strict=strict)
        return report
    shared = {k: t for k, t in targets.items() if k in saved_keys}
    try:
        with torch.no_grad():
            for rel in model_tensor_files(key, saved.files or ()):  # each fills the targets it holds
                checkpoint.reader.load_tensors(rel, into=shared)
            if checkpoint.referenced(key) is not None:
                checkpoint.referenced(key).load(into=shared)
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(
            f"{exc} (model {key!r} is partly overwritten: load a good checkpoint into it before use)", path=exc.path
        ) from exc
    return report


def _check_model_state(
    checkpoint: Checkpoint,
    key: str,
    rel: str,
    targets: Mapping[str, Any],
    saved_shapes: dict[str, tuple[tuple[int, ...], torch.dtype]],
    saved_keys: set[str],
    strict: bool = True,
) -> dict[str, list[str]]:
    """Raise :class:`StateMismatchError` before anything is written into the model;
    not ``strict``: only shapes and dtypes of the shared keys must match, and the missing
    and unexpected keys are returned."""
    meta = sorted(k for k, t in targets.items() if isinstance(t, torch.Tensor) and t.device.type == "meta")
    if meta:
        raise StateMismatchError(
            f"model {key!r} ({checkpoint.url}/{rel}) has parameters on the meta device (built under "
            "init_empty_weights?); the core cannot fill them: pass device_map=/max_memory= with statekit-offload installed",
            mismatched={k: "meta tensor" for k in meta},
        )
    saved = {k: saved_shapes.get(k, (None, None)) for k in saved_keys}
    report = {"missing_keys": sorted(set(targets) - saved_keys), "unexpected_keys": sorted(saved_keys - set(targets))}
    if not strict:
        targets = {k: t for k, t in targets.items() if k in saved}
        saved = {k: v for k, v in saved.items() if k in targets}
    check_fit(f"model {key!r} ({checkpoint.url}/{rel}; the model is untouched)", targets, saved)
    return report if not strict else {"missing_keys": [], "unexpected_keys": []}


def _load_entry(checkpoint: Checkpoint, e: Entry, saved: ObjectEntry, not_restored: list[str]) -> None:
    per_rank = bool(saved.per_rank)  # as saved: the caller need not repeat per_rank=
    if e.kind == "dataloader" and per_rank:
        _load_loader(checkpoint, e, not_restored)
        return
    base = _state_base(checkpoint, e, saved)
    if per_rank and f"{base}.json" not in checkpoint.reader.manifest.files:
        not_restored.append(f"{e.key} for rank {checkpoint.rank} (the checkpoint has no state for this rank)")
        return
    state = checkpoint.reader.load_state(base)
    where = f"{e.kind} {e.key!r} ({checkpoint.url}/{base}.json)"
    if e.kind == "tensor":
        value = _check_tensor(where, e, state)
        with torch.no_grad():
            e.obj.copy_(value)
        return
    try:
        if e.kind == "dict":
            e.obj.clear()
            e.obj.update(state)
        elif e.kind == "dataloader":
            data.restore_loader(e.obj, state, name=e.key)
        else:
            e.obj.load_state_dict(state)
    except (KeyError, ValueError, RuntimeError, TypeError) as exc:
        raise StateMismatchError(f"{where}: {type(exc).__name__}: {exc}") from exc


def _check_tensor(where: str, e: Entry, state: Any) -> torch.Tensor:
    """The saved tensor of a tensor entry, checked against the live one's shape and dtype."""
    value = state.get(e.key) if isinstance(state, dict) else None
    if not isinstance(value, torch.Tensor):
        raise StateMismatchError(where, missing=[e.key])
    if value.shape != e.obj.shape or value.dtype != e.obj.dtype:
        raise StateMismatchError(
            where, mismatched={e.key: f"saved {list(value.shape)} {value.dtype} vs target {list(e.obj.shape)} {e.obj.dtype}"}
        )
    return value


def loader_positions(checkpoint: Checkpoint, key: str) -> tuple[Any, list[Any] | None]:
    """The saved positions of loader ``key`` (files ``<key>/rank-<r>.json``): this rank's
    (None when it saved none) and, when :mod:`statekit.loaders.elastic` needs them, every
    saved rank's (index = saved rank); else None.

    Raises:
        CorruptCheckpointError: a position file fails verification (names it).
    """
    files = checkpoint.reader.manifest.files
    bases = [fmt.rank_path(key, r) for r in range(checkpoint.reader.manifest.world_size)]
    base = fmt.rank_path(key, checkpoint.rank)
    own = checkpoint.reader.load_state(base) if f"{base}.json" in files else None
    if isinstance(own, dict):
        _merge_next_batch(checkpoint, key, own)
    ranks = None
    mine = own if isinstance(own, dict) else {}
    # every rank's position is needed with another world size, an earlier one in this epoch
    # (history), or Accelerate's dispatcher (its ranks share one stream of batches)
    if own is None or len(bases) != checkpoint.world_size or mine.get("history") or (mine.get("layout") or {}).get("kind") == "dispatch":
        if all(f"{b}.json" in files for b in bases):
            ranks = [own if b == base else checkpoint.reader.load_state(b) for b in bases]
    return own, ranks


def _merge_next_batch(checkpoint: Checkpoint, key: str, own: dict[str, Any]) -> None:
    """Add the content of the first batch the saved run yielded after the save (written
    beside the checkpoint after its commit: :class:`statekit.checks.next_batch.Witness`) to the
    position's record, so the resume audit checks it; nothing when none was written."""
    if not isinstance(own.get("next"), dict) or own["next"].get("content_digest"):
        return
    rel = fmt.next_batch_path(key, checkpoint.rank)
    try:
        raw = checkpoint.storage.read_bytes(rel)
    except FileNotFoundError:
        return
    except StorageError as exc:  # the record only adds a check: the resume goes on without it
        logger.warning("resume audit: could not read %s (%s); the first batch is checked by what the save recorded",
                       checkpoint.storage.url_of(rel), exc)
        return
    next_batch.merge_next_batch(own, raw, checkpoint.reader.manifest.manifest_checksum, checkpoint.storage.url_of(rel))


def _load_loader(checkpoint: Checkpoint, e: Entry, not_restored: list[str]) -> None:
    """Restore a data loader's position from :func:`loader_positions`."""
    base = fmt.rank_path(e.key, checkpoint.rank)
    own, ranks = loader_positions(checkpoint, e.key)
    try:
        restored = data.restore_loader(e.obj, own, name=e.key, ranks=ranks)
    except StateMismatchError:
        raise
    except (KeyError, ValueError, RuntimeError, TypeError) as exc:
        raise StateMismatchError(f"dataloader {e.key!r} ({checkpoint.url}/{base}.json): {type(exc).__name__}: {exc}") from exc
    if not restored:
        not_restored.append(f"{e.key} for rank {checkpoint.rank} (the checkpoint has no state for this rank)")


def verify(url: str, *, storage_options: dict[str, Any] | None = None) -> Manifest:
    """Check every file of a committed checkpoint against its manifest (size and checksum),
    reading each once, streaming; nothing is loaded. Shows a progress bar on a terminal.

    Args:
        url: checkpoint directory URL.
        storage_options: fsspec options.

    Returns:
        The manifest.

    Raises:
        CheckpointNotFoundError, IncompleteCheckpointError, FormatVersionError: as
            :func:`read_manifest`.
        CorruptCheckpointError: the first file that is missing, or whose size or
            checksum differs; ``.path`` names it.
        MissingBaseError, ChangedBaseError: a pretrained folder the checkpoint references
            is gone, or a referenced tensor's bytes differ (names it).
    """
    storage = Storage.of(url, storage_options)
    manifest = read_manifest(storage)
    verify_files(storage, manifest)
    for resolved in references.resolve_all(manifest.references, storage).values():
        resolved.verify()  # a referenced frozen base: found, its headers and tensors' bytes as recorded
    return manifest


def verify_files(storage: Storage, manifest: Manifest, rank: int | None = None) -> None:
    """:func:`verify`'s pass over the files ``manifest`` lists: every rank's, or with
    ``rank`` the shared ones and ``rank``'s own.

    Raises:
        CorruptCheckpointError: the first file that is missing, or whose size or checksum
            differs; ``.path`` names it.
    """
    names = sorted(rel for rel in manifest.files if rank is None or not _other_ranks_file(rel, rank))
    reader = FileReader(storage, manifest, verify=True)
    with progress(sum(manifest.files[rel].size_bytes for rel in names), "verify") as advance:
        for rel in names:
            with reader.reading(rel) as f:
                while chunk := f.read(fmt.CHUNK_BYTES):
                    advance(len(chunk))
                f.read()  # end of file: the reader compares size and checksum here


def _other_ranks_file(rel: str, rank: int) -> bool:
    """A per-rank file of another rank (``.../rank-00001.json``, Accelerate's ``random_states_1.pkl``)."""
    parsed = fmt.parse_rank_path(rel)
    if parsed is not None:
        return parsed[1] != rank
    match = re.fullmatch(r"random_states_(\d+)\.pkl", rel)
    return match is not None and int(match.group(1)) != rank
