"""Reading directories written by ``Accelerator.save_state`` (no statekit manifest).

File names follow ``accelerate.checkpointing.save_accelerator_state`` and
``save_custom_state`` (accelerate 1.x): ``model[_i].safetensors`` or
``pytorch_model[_i].bin``, ``optimizer[_i].bin``, ``scheduler[_i].bin``,
``sampler[_i].bin``, ``dl_state_dict[_i].bin``, ``scaler.pt``,
``random_states_<rank>.pkl``, ``custom_checkpoint_<i>.pkl``. Everything but the
safetensors model files is pickle: it is read only with ``allow_pickle=True``
(``torch.load(weights_only=True)`` first, the full unpickler only where that fails),
and without it :class:`statekit.PickleNotAllowedError` names the file before anything
is loaded.
"""

from __future__ import annotations

import copy
import io
import pickle
import random
import re
import sys
from typing import Any

import torch

from statekit import format as fmt
from statekit.errors import PickleNotAllowedError, StateMismatchError
from statekit.storage import Storage

_ACCELERATE_FILE = re.compile(
    r"^(model(_\d+)?\.safetensors|pytorch_model(_\d+)?\.bin|optimizer(_\d+)?\.bin|scheduler(_\d+)?\.bin|"
    r"sampler(_\d+)?\.bin|dl_state_dict(_\d+)?\.bin|scaler\.pt|random_states_\d+\.pkl|custom_checkpoint_\d+\.pkl)$"
)


_ACCELERATE_ONLY = re.compile(
    r"^(model\.safetensors|pytorch_model(_\d+)?\.bin|optimizer(_\d+)?\.bin|scheduler(_\d+)?\.bin|"
    r"scaler\.pt|random_states_\d+\.pkl|custom_checkpoint_\d+\.pkl)$"
)


def is_accelerate_checkpoint(storage: Storage) -> bool:
    """True if the directory holds files only ``Accelerator.save_state`` writes (an
    interrupted statekit save, with ``model_0.safetensors`` or a lock, is not one)."""
    names = storage.listdir()
    return ".statekit-lock" not in names and any(_ACCELERATE_ONLY.match(name) for name in names)


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


def read_pickle(storage: Storage, rel: str, allow_pickle: bool) -> Any:
    """Unpickle one file of a foreign checkpoint, only if the caller allowed it.

    Raises:
        PickleNotAllowedError: ``allow_pickle`` is False (names the file; nothing is read).
    """
    url = storage.url_of(rel)
    if not allow_pickle:
        raise PickleNotAllowedError(
            f"{url} is a pickle file (Accelerate format); pickle can run arbitrary code on load, so statekit "
            "reads it only with allow_pickle=True (or convert the checkpoint with `statekit convert --allow-pickle`)"
        )
    data = storage.read_bytes(rel)
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


def read_model(storage: Storage, rel: str, allow_pickle: bool, into: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Read a model state dict (safetensors streamed, ``.bin`` through :func:`read_pickle`)."""
    if rel.endswith(".safetensors"):
        with storage.open_read(rel) as f:
            tensors, _ = fmt.read_tensors(f, storage.url_of(rel), storage.size(rel), into=into)
        return tensors
    return read_pickle(storage, rel, allow_pickle)


def restore_rng(states: dict[str, Any]) -> None:
    """Set the global generators from one ``random_states_<rank>.pkl`` dict, as
    ``accelerate.checkpointing.load_accelerator_state`` does (Python ``random``, NumPy,
    torch CPU, CUDA when present)."""
    random.setstate(states["random_state"])
    np_random = sys.modules.get("numpy.random")
    if np_random is not None and "numpy_random_seed" in states:
        np_random.set_state(states["numpy_random_seed"])
    torch.set_rng_state(states["torch_manual_seed"])
    if torch.cuda.is_available() and "torch_cuda_manual_seed" in states:
        torch.cuda.set_rng_state_all(states["torch_cuda_manual_seed"])


def _rng_snapshot() -> dict[str, Any]:
    states: dict[str, Any] = {"random_state": random.getstate(), "torch_manual_seed": torch.get_rng_state()}
    np_random = sys.modules.get("numpy.random")
    if np_random is not None:
        states["numpy_random_seed"] = np_random.get_state()
    if torch.cuda.is_available():
        states["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
    return states


def _index(key: str) -> int:
    return int(key.rsplit("_", 1)[1]) if re.search(r"_\d+$", key) else 0


def load(storage: Storage, entries: list[Any], *, allow_pickle: bool, accelerator: Any = None) -> dict[str, Any]:
    """Restore entries (stable keys ``model_0``, ``optimizer_0``...) from an Accelerate directory.

    All or nothing: every needed file is located, pickle permission checked, every file
    read and every model's keys, shapes and dtypes checked before anything is applied;
    the other objects are then applied with a snapshot each, and if one fails
    (an optimizer whose parameter groups differ, say) the ones already applied and the
    random generators are put back before the error is raised. Model state dict keys are
    matched after removing the ``_orig_mod.``/``module.`` prefixes Accelerate keeps
    (:func:`statekit.engine.entries.strip_wrapper_prefixes`).

    Returns:
        A manifest-like dict: ``{"format": "accelerate", "step": ..., "objects": {...}}``.

    Raises:
        PickleNotAllowedError: a needed file is pickle and ``allow_pickle`` is False.
        StateMismatchError: an object has no file, or its state does not fit; nothing
            was changed.
    """
    from statekit.engine.entries import check_fit, strip_wrapper_prefixes, unwrap_model

    names = set(storage.listdir())
    plan: list[tuple[Any, str]] = []
    missing = []
    for e in entries:
        kind = "custom" if e.kind in ("custom", "dict", "tensor") else e.kind
        if e.key == "accelerator":
            continue
        rel = file_for(kind, _index(e.key), names)
        if rel is None:
            if kind == "dataloader":
                continue  # Accelerate writes loader state only for stateful/seedable samplers
            missing.append(e.key)
            continue
        plan.append((e, rel))
    if missing:
        raise StateMismatchError(f"Accelerate checkpoint {storage.url} (nothing was loaded)", missing=missing)
    rank = accelerator.process_index if accelerator is not None else 0
    rng_file = file_for("rng", 0, names, rank)
    pickled = [rel for _, rel in plan if not rel.endswith(".safetensors")] + ([rng_file] if rng_file else [])
    if pickled and not allow_pickle:
        read_pickle(storage, pickled[0], allow_pickle)  # raises, naming the file

    # 1. read and check everything; nothing is applied yet
    staged: list[tuple[Any, str, Any]] = []
    for e, rel in plan:
        if e.kind == "model":
            model = unwrap_model(e.obj, accelerator)
            targets = model.state_dict()
            state = strip_wrapper_prefixes(read_model(storage, rel, allow_pickle), targets)
            saved = {k: (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else (None, None) for k, v in state.items()}
            check_fit(f"model {e.key!r} ({storage.url_of(rel)}; nothing was loaded)", targets, saved)
            staged.append((model, rel, state))
        else:
            staged.append((e, rel, read_pickle(storage, rel, allow_pickle)))
    rng_states = read_pickle(storage, rng_file, allow_pickle) if rng_file else None

    # 2. apply: objects that can refuse first (with undo), the checked models last
    undo: list[Any] = []
    rng_before = _rng_snapshot()
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
            restore_rng(rng_states)
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
    step = rng_states.get("step") if rng_states is not None else None
    if accelerator is not None and step is not None:
        accelerator.step = step
    return {"format": "accelerate", "step": step, "objects": {e.key: {"kind": e.kind, "file": rel} for e, rel in plan}}


ACCELERATE_RNG = "accelerate_rng"
"""Key of the random states a converted Accelerate checkpoint carries (per rank); the
core restores them on load as Accelerate's ``load_state`` would."""


def convert(src_url: str, out_url: str, *, allow_pickle: bool = False, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Rewrite a directory written by ``Accelerator.save_state`` in the statekit format.

    The result loads with :func:`statekit.load_state` and ``CheckpointManager.resume()``
    into the same run and restores what ``Accelerator.load_state`` of the source restores:
    models (streamed tensor file to tensor file as ``model_<i>.safetensors``, the
    ``_orig_mod.``/``module.`` prefixes removed), optimizers, schedulers, scaler, custom
    objects, StatefulDataLoader positions (``dl_state_dict``), the step counter
    (``accelerator``) and the random states of every rank (``accelerate_rng/rank-<r>``,
    restored by the core on load). Pickle files are unpickled only with
    ``allow_pickle=True`` and stored through the codec. ``sampler.bin`` (a pickled sampler
    object, not state) is not converted.

    Args:
        src_url: the Accelerate directory.
        out_url: the new checkpoint's URL (must not hold a committed checkpoint).
        allow_pickle: permit unpickling the source's pickle files.
        storage_options: fsspec options for both URLs.

    Returns:
        The committed manifest.

    Raises:
        PickleNotAllowedError: the source has pickle files and not ``allow_pickle``.
        CheckpointExistsError: ``out_url`` holds a committed checkpoint.
        StatekitError: ``src_url`` is not an Accelerate checkpoint.
    """
    import datetime

    from statekit._version import __version__
    from statekit.engine.context import CORE, Checkpoint
    from statekit.api.saveload import _commit
    from statekit.engine.entries import strip_wrapper_prefixes
    from statekit.errors import StatekitError
    from statekit.engine.locking import prepare_target, release_lock

    src = Storage(src_url, storage_options)
    if not is_accelerate_checkpoint(src):
        raise StatekitError(f"{src_url} is not a directory written by Accelerator.save_state")
    names = sorted(n for n in src.listdir() if _ACCELERATE_FILE.match(n))
    pickled = [n for n in names if not n.endswith(".safetensors")]
    if pickled and not allow_pickle:
        read_pickle(src, pickled[0], allow_pickle)
    out = Storage(out_url, storage_options)
    prepare_target(out, overwrite=False)
    try:
        checkpoint = Checkpoint(out, mode="save")
        objects: dict[str, Any] = {}
        kinds = {"model": "model", "pytorch_model": "model", "optimizer": "optimizer", "scheduler": "scheduler",
                 "dl_state_dict": "dataloader", "custom_checkpoint": "custom"}
        step = None
        for name in names:
            stem, _, ext = name.partition(".")
            base, _, index = stem.rpartition("_") if re.search(r"_\d+$", stem) else (stem, "", "0")
            if stem == "scaler":
                key, kind = "scaler", "scaler"
            elif base == "random_states":
                states = read_pickle(src, name, allow_pickle)
                step = states.get("step", step)
                checkpoint.save_state(f"{ACCELERATE_RNG}/rank-{int(index):05d}", states)
                continue
            elif base in kinds:
                kind = kinds[base]
                key = f"{kind}_{index}"
            else:
                continue  # sampler.bin holds a pickled sampler object, not state: nothing to convert
            if kind == "model":
                checkpoint.save_tensors(f"{key}.safetensors", strip_wrapper_prefixes(read_model(src, name, allow_pickle)))
            elif kind == "dataloader":  # the form statekit.engine.data.restore_loader takes for a stateful loader
                checkpoint.save_state(f"{key}/rank-00000", {"tracked": False, "stateful": read_pickle(src, name, allow_pickle)})
            else:
                checkpoint.save_state(key, read_pickle(src, name, allow_pickle))
            objects[key] = {"kind": kind, "owner": CORE, "per_rank": kind == "dataloader",
                            "files": sorted(p for p in checkpoint.files if p.startswith((f"{key}.", f"{key}/")))}
        counters = checkpoint.save_state("accelerator", {"step": int(step or 0), "iteration": 0})
        objects["accelerator"] = {"kind": "custom", "owner": CORE, "per_rank": False, "files": sorted(counters)}
        rng_files = sorted(p for p in checkpoint.files if p.startswith(f"{ACCELERATE_RNG}/"))
        if rng_files:
            objects[ACCELERATE_RNG] = {"kind": "rng", "owner": CORE, "per_rank": True, "files": rng_files}
        manifest = {
            "format": fmt.FORMAT,
            "statekit_version": __version__,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z"),
            "step": step,
            "world_size": max(1, sum(1 for n in names if n.startswith("random_states_"))),
            "plugins": {},
            "objects": objects,
            "records": {},
            "files": checkpoint.files,
            "metadata": {"converted_from": src.url, "source_format": "accelerate"},
        }
        return _commit(out, manifest, exclusive=True)
    except BaseException:
        release_lock(out, 0)
        raise
