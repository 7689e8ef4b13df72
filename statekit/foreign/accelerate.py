"""Directories written by ``Accelerator.save_state``: the one owner of their file names
(:func:`accelerate_files`, after ``accelerate.checkpointing.save_accelerator_state``,
accelerate 1.x) and pickle gate (:func:`read_pickle`), and :func:`load`. All but the
safetensors model files are pickles, read only with ``allow_pickle=True`` (docs/cli.md,
"Formats statekit reads").
"""

from __future__ import annotations

import copy
import pickle
import re
import zipfile
from collections.abc import Iterable
from typing import Any

import torch

from statekit import format as fmt
from statekit.engine.entries import check_fit, strip_wrapper_prefixes, unwrap_model
from statekit.engine.gradients import warn_partial_window
from statekit.engine.optimizer_fit import check_optimizer_fit, check_scheduler_fit, parameter_names
from statekit.devices import accelerator_generators, restore_random_states, snapshot_random_states
from statekit.errors import CorruptCheckpointError, StatekitWarning, StateMismatchError, warn_user
from statekit.foreign.base import ForeignObject, ForeignSummary
from statekit.foreign.pickles import load_pickle, unreadable_pickle
from statekit.storage import Storage

def _device_key(device_type: str) -> str:
    """Accelerate's key of one accelerator's generators: ``torch_<type>_manual_seed``."""
    return f"torch_{device_type}_manual_seed"


def restore_rng(states: dict[str, Any], source: str = "Accelerate checkpoint") -> None:
    """Set the global generators from one unpickled ``random_states_<rank>.pkl`` dict, as
    ``load_accelerator_state`` does; with another device count than saved, the common ones
    are restored and a :class:`StatekitWarning` naming ``source`` says which are not.
    """
    found = accelerator_generators()
    saved = list(states[_device_key(found[0])]) if found is not None and _device_key(found[0]) in states else None
    restore_random_states(
        {"python": states["random_state"], "numpy": states.get("numpy_random_seed"), "torch": states["torch_manual_seed"],
         "device": saved},
        accelerator=found,
    )
    if found is None or saved is None:
        return
    kind, count = found[0], int(found[1].device_count())
    if len(saved) != count:
        rest = f"{kind}:{count}-{len(saved) - 1} not restored" if len(saved) > count else "the others keep their state"
        warn_user(f"{source}: random states of {len(saved)} {kind.upper()} device(s) saved, this process sees "
                  f"{count} ({rest}): draws on those devices (dropout) differ from the saved run's",
                  StatekitWarning)


def rng_snapshot() -> dict[str, Any]:
    """This process's generators in the same dict form (for :func:`restore_rng`)."""
    found = accelerator_generators()
    now = snapshot_random_states(accelerator=found)
    states: dict[str, Any] = {"random_state": now["python"], "torch_manual_seed": now["torch"]}
    if now["numpy"] is not None:
        states["numpy_random_seed"] = now["numpy"]
    if found is not None:
        states[_device_key(found[0])] = now["device"]
    return states


_ACCELERATE_FILE = re.compile(
    r"^(model(_\d+)?\.safetensors|pytorch_model(_\d+)?\.bin|optimizer(_\d+)?\.bin|scheduler(_\d+)?\.bin|"
    r"sampler(_\d+)?\.bin|dl_state_dict(_\d+)?\.bin|scaler\.pt|random_states_\d+\.pkl|custom_checkpoint_\d+\.pkl)$"
)


_ACCELERATE_ONLY = re.compile(
    r"^(model\.safetensors|pytorch_model(_\d+)?\.bin|optimizer(_\d+)?\.bin|scheduler(_\d+)?\.bin|"
    r"scaler\.pt|random_states_\d+\.pkl|custom_checkpoint_\d+\.pkl)$"
)


_MODEL_FILE = re.compile(r"^(model|pytorch_model)(_\d+)?\.(safetensors|bin)$")


def accelerate_files(names: Iterable[str]) -> list[str]:
    """The names among ``names`` of files ``Accelerator.save_state`` writes, sorted."""
    return sorted(n for n in names if _ACCELERATE_FILE.match(n))


def pickle_files(names: Iterable[str]) -> list[str]:
    """The pickles among Accelerate file ``names`` (all but the safetensors model files), in order."""
    return [n for n in names if not n.endswith(".safetensors")]


def is_model_file(name: str) -> bool:
    """True for a model state dict file (``model[_i].safetensors``, ``pytorch_model[_i].bin``)."""
    return bool(_MODEL_FILE.match(name))


def is_accelerate_checkpoint(storage: Storage) -> bool:
    """True if the directory holds files only ``Accelerator.save_state`` writes (not an
    interrupted statekit save: no lock, no file statekit wrote, :func:`written_by_statekit`)."""
    names = storage.listdir()
    if ".statekit-lock" in names or not any(_ACCELERATE_ONLY.match(name) for name in names):
        return False
    return not written_by_statekit(storage, accelerate_files(names))


def written_by_statekit(storage: Storage, names: Iterable[str]) -> list[str]:
    """The safetensors files among ``names`` whose header carries statekit's writer mark (without a
    manifest: a save that never committed); an unreadable header counts as not statekit's.
    """
    marked = []
    for name in names:
        if not name.endswith(".safetensors"):
            continue
        try:
            with storage.open_read(name) as f:
                header = fmt.read_header(f, storage.url_of(name))
        except Exception:  # noqa: BLE001 - unreadable: the reader that opens it reports it
            continue
        if header.metadata.get(fmt.WRITER_KEY) == fmt.WRITER:
            marked.append(name)
    return marked


def _suffix(i: int) -> str:
    return "" if i == 0 else f"_{i}"


def file_for(kind: str, index: int, names: set[str], rank: int = 0) -> str | None:
    """The Accelerate file name holding object ``kind`` number ``index`` (None if absent)."""
    candidates = {
        "model": [f"model{_suffix(index)}.safetensors", f"pytorch_model{_suffix(index)}.bin"],
        "optimizer": [f"optimizer{_suffix(index)}.bin"],
        "scheduler": [f"scheduler{_suffix(index)}.bin"],
        "dataloader": [f"dl_state_dict{_suffix(index)}.bin", f"sampler{_suffix(index)}.bin"],
        "scaler": ["scaler.pt"],
        "rng": [f"random_states_{rank}.pkl"],
        "custom": [f"custom_checkpoint_{index}.pkl"],
    }[kind]
    return next((c for c in candidates if c in names), None)


def read_pickle(storage: Storage, rel: str, allow_pickle: bool, *, mmap: bool = False) -> Any:
    """Unpickle one file of an Accelerate directory if ``allow_pickle`` (``mmap``: memory-map a
    local file, :func:`statekit.foreign.pickles.load_pickle`).

    Raises:
        PickleNotAllowedError: ``allow_pickle`` is False (names the file; nothing is read).
    """
    return load_pickle(
        storage, rel, allow_pickle, what="Accelerate format",
        remedy="or convert the checkpoint with `statekit convert --allow-pickle`", mmap=mmap,
    )


def read_model(storage: Storage, rel: str, allow_pickle: bool, into: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Read a model state dict (safetensors streamed, ``.bin`` through :func:`read_pickle`)."""
    if rel.endswith(".safetensors"):
        with storage.open_read(rel) as f:
            tensors, _ = fmt.read_tensors(f, storage.url_of(rel), storage.size(rel), into=into)
        return tensors
    return read_pickle(storage, rel, allow_pickle)


def _index(key: str) -> int:
    return int(key.rsplit("_", 1)[1]) if re.search(r"_\d+$", key) else 0


def load(
    storage: Storage, entries: list[Any], *, allow_pickle: bool, accelerator: Any = None, gradients_restored: bool = False
) -> ForeignSummary:
    """Restore ``entries`` (keys ``model_0``, ``optimizer_0``...) from an Accelerate directory, all
    or nothing: every file is read and checked before anything is applied, and a failure while
    applying puts the applied objects and the generators back. Follows
    ``accelerate.checkpointing.load_accelerator_state`` (docs/design-notes.md, "Accelerate conformance").

    Args:
        storage: the Accelerate directory.
        entries: the run's classified objects (:class:`statekit.engine.entries.Entry`).
        allow_pickle: permit unpickling the directory's pickle files.
        accelerator: the run's Accelerator (its ``process_index`` picks the random-state file;
            its ``step`` is set from it), or None.
        gradients_restored: the caller restores the accumulated gradients itself; otherwise a
            ``step`` between optimizer steps warns that the resume is not exact.

    Returns:
        A :class:`~statekit.foreign.base.ForeignSummary` (``format="accelerate"``).

    Raises:
        PickleNotAllowedError: a needed file is pickle and ``allow_pickle`` is False.
        StateMismatchError: an object has no file, or its state does not fit; nothing was changed.
        CorruptCheckpointError: a file cannot be read (names it); nothing was changed.
    """
    names = set(storage.listdir())
    plan = _plan_load(storage, entries, names)
    rank = accelerator.process_index if accelerator is not None else 0
    rng_file = file_for("rng", 0, names, rank)
    pickled = [rel for _, rel in plan if not rel.endswith(".safetensors")] + ([rng_file] if rng_file else [])
    if pickled and not allow_pickle:
        read_pickle(storage, pickled[0], allow_pickle)  # raises, naming the file
    try:
        staged = _read_and_check(storage, plan, allow_pickle, accelerator)  # nothing is applied yet
        rng_states = read_pickle(storage, rng_file, allow_pickle) if rng_file else None
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(f"{exc}; nothing was loaded", path=exc.path) from exc
    _apply_all_or_nothing(storage, staged, rng_states)
    step = rng_states.get("step") if rng_states is not None else None
    if accelerator is not None and step is not None:
        accelerator.step = step
        if not gradients_restored:
            warn_partial_window(accelerator, int(step))
    return ForeignSummary("accelerate", step, {e.key: ForeignObject(e.kind, rel) for e, rel in plan})


def _plan_load(storage: Storage, entries: list[Any], names: set[str]) -> list[tuple[Any, str]]:
    """``(entry, file name)`` for every entry with a file; raises if one has none."""
    plan: list[tuple[Any, str]] = []
    missing = []
    for e in entries:
        if e.key == "accelerator" or e.optional:  # statekit's own state: never in Accelerate's files
            continue
        kind = "custom" if e.kind in ("custom", "dict", "tensor") else e.kind
        rel = file_for(kind, _index(e.key), names)
        if rel is not None:
            plan.append((e, rel))
        elif kind != "dataloader":  # Accelerate writes loader state only for stateful/seedable samplers
            missing.append(e.key)
    if missing:
        raise StateMismatchError(f"Accelerate checkpoint {storage.url} (nothing was loaded)", missing=missing)
    return plan


def _read_and_check(storage: Storage, plan: list[tuple[Any, str]], allow_pickle: bool, accelerator: Any) -> list[tuple[Any, str, Any]]:
    """Read every planned file and check each model's and optimizer's fit; returns
    ``(model or entry, file, state)``.
    """
    staged: list[tuple[Any, str, Any]] = []
    names = parameter_names(unwrap_model(e.obj, accelerator) for e, _ in plan if e.kind == "model")
    for e, rel in plan:
        if e.kind != "model":
            state = read_pickle(storage, rel, allow_pickle)
            _check_object_fit(storage, e, rel, state, names)
            staged.append((e, rel, state))
            continue
        model = unwrap_model(e.obj, accelerator)
        targets = model.state_dict()
        state = strip_wrapper_prefixes(read_model(storage, rel, allow_pickle), targets)
        state.update({k: state[source] for k, source in _tied_to_saved(targets, state).items()})  # one name kept of tied weights
        saved = {k: (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else (None, None) for k, v in state.items()}
        check_fit(f"model {e.key!r} ({storage.url_of(rel)}; nothing was loaded)", targets, saved)
        staged.append((model, rel, state))
    return staged


def check_fit_before_load(storage: Storage, entries: list[Any], accelerator: Any = None, *, strict: bool = True) -> None:
    """Check, before ``Accelerator.load_state`` loads anything (attach mode), that the models,
    optimizers and schedulers fit Accelerate's files, by shapes only (safetensors headers,
    ``.bin`` memory-mapped with ``weights_only``); files it cannot read so are left to Accelerate.

    Args:
        storage: the directory being loaded.
        entries: entries keyed ``model_<i>``, ``optimizer_<i>``, ``scheduler_<i>``; others skipped.
        accelerator: the run's Accelerator (unwraps its models), or None.
        strict: False (``load_state(dir, strict=False)``): missing and unexpected model keys pass.

    Raises:
        StateMismatchError: an object does not fit (names it, the file, the parameter, both shapes).
        CorruptCheckpointError: a file cannot be read (names it); nothing was loaded.
    """
    names_in_dir = set(storage.listdir())
    names = parameter_names(unwrap_model(e.obj, accelerator) for e in entries if e.kind == "model")
    for e in entries:
        if e.kind not in ("model", "optimizer", "scheduler"):
            continue
        rel = file_for(e.kind, _index(e.key), names_in_dir)
        if rel is None or storage.local_path(rel) is None:
            continue
        if e.kind == "model":
            _check_model_file_fit(storage, e, rel, unwrap_model(e.obj, accelerator), strict)
        else:
            state = _peek_pickle(storage, rel)
            if state is not None:
                _check_object_fit(storage, e, rel, state, names)


def _check_model_file_fit(storage: Storage, e: Any, rel: str, model: Any, strict: bool) -> None:
    """The model's shapes and dtypes against its file's, from metadata only (a pickle the
    restricted unpickler refuses is skipped); with ``strict=False`` shared keys only."""
    targets = model.state_dict()
    saved = _saved_shapes(storage, rel, targets)
    if saved is None:
        return
    tied = _tied_to_saved(targets, saved)  # safetensors files keep one name of tied weights
    targets = {k: t for k, t in targets.items() if k not in tied}
    if not strict:
        targets = {k: t for k, t in targets.items() if k in saved}
        saved = {k: v for k, v in saved.items() if k in targets}
    check_fit(f"model {e.key!r} ({storage.url_of(rel)}; nothing was loaded)", targets, saved)


def _check_object_fit(storage: Storage, e: Any, rel: str, state: Any, names: Any) -> None:
    """An optimizer's or scheduler's saved state against the live object (other kinds pass)."""
    if e.kind == "optimizer":
        check_optimizer_fit(f"optimizer {e.key!r} ({storage.url_of(rel)})", e.obj, state, names)
    elif e.kind == "scheduler":
        check_scheduler_fit(f"scheduler {e.key!r} ({storage.url_of(rel)})", e.obj, state)


def _tied_to_saved(targets: Any, saved: Any) -> dict[str, str]:
    """The model's keys missing from ``saved`` that are tied to a saved one, each with that key."""
    groups: dict[tuple[int, int, tuple[int, ...]], list[str]] = {}
    for k, t in targets.items():
        if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.numel():
            groups.setdefault((t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)), []).append(k)
    tied = {}
    for keys in groups.values():
        source = next((n for n in keys if n in saved), None)
        if source is not None:
            tied.update({k: source for k in keys if k not in saved})
    return tied


def _saved_shapes(storage: Storage, rel: str, targets: Any) -> dict[str, tuple[Any, Any]] | None:
    """``name -> (shape, dtype)`` of a model file (prefixes stripped), from metadata only."""
    if rel.endswith(".safetensors"):
        with storage.open_read(rel) as f:
            header = fmt.read_header(f, storage.url_of(rel), storage.size(rel))
        by_name = {e.name: e for e in header.entries}
        shapes = {e.name: (tuple(e.shape), e.dtype) for e in header.entries}
        shapes.update({a: (tuple(by_name[n].shape), by_name[n].dtype) for a, n in header.aliases.items()})
        return strip_wrapper_prefixes(shapes, targets)
    state = _peek_pickle(storage, rel)
    if not isinstance(state, dict):
        return None
    state = strip_wrapper_prefixes(state, targets)
    return {k: (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else (None, None) for k, v in state.items()}


def _peek_pickle(storage: Storage, rel: str) -> Any:
    """A local torch file's object, tensors memory-mapped, or None when the restricted unpickler
    refuses it; raises ``CorruptCheckpointError`` when it cannot be read.
    """
    try:
        return torch.load(storage.path_of(rel), map_location="cpu", mmap=True, weights_only=True)
    except pickle.UnpicklingError:
        return None
    except (RuntimeError, ValueError, EOFError, OSError) as exc:
        if not zipfile.is_zipfile(storage.path_of(rel)) and "mmap" in str(exc):
            return None  # an old (non-zip) torch file cannot be memory-mapped: Accelerate reads it
        raise unreadable_pickle(storage.url_of(rel), exc) from exc


def _apply_all_or_nothing(storage: Storage, staged: list[tuple[Any, str, Any]], rng_states: dict[str, Any] | None) -> None:
    """Apply staged states: objects that can refuse first, each with a snapshot to undo,
    then the random states, then the already checked models."""
    undo: list[Any] = []
    rng_before = rng_snapshot()
    try:
        for e, rel, state in staged:
            if isinstance(e, torch.nn.Module):
                continue
            if e.kind == "dataloader":
                if rel.startswith("dl_state_dict") and callable(getattr(e.obj, "load_state_dict", None)):
                    e.obj.load_state_dict(state)
                continue
            # an optimizer's load_state_dict replaces its state tensors (it never writes
            # into them), so its current state_dict() is a snapshot without a copy
            before = e.obj.state_dict() if e.kind == "optimizer" else copy.deepcopy(e.obj.state_dict())
            undo.append((e.obj, before))  # before the call: a load_state_dict may fail halfway
            e.obj.load_state_dict(state)
        if rng_states is not None:
            restore_rng(rng_states, f"Accelerate checkpoint {storage.url}")
    except Exception as exc:
        for obj, before in reversed(undo):
            obj.load_state_dict(before)
        restore_rng(rng_before)
        raise StateMismatchError(
            f"Accelerate checkpoint {storage.url}: {type(exc).__name__}: {exc} (every object was put back as it was)"
        ) from exc
    with torch.no_grad():
        for model, _, state in staged:
            if isinstance(model, torch.nn.Module):
                model.load_state_dict(state)


ACCELERATE_RNG = "accelerate_rng"
"""Key of the random states a converted Accelerate checkpoint carries (per rank); the
core restores them on load as Accelerate's ``load_state`` would."""
