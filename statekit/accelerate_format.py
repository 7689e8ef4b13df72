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


def load(storage: Storage, entries: list[Any], *, allow_pickle: bool, accelerator: Any = None) -> dict[str, Any]:
    """Restore entries (stable keys ``model_0``, ``optimizer_0``...) from an Accelerate directory.

    Every needed file is located, and pickle permission checked, before anything is
    loaded, so a refused load leaves every object untouched.

    Returns:
        A manifest-like dict: ``{"format": "accelerate", "step": ..., "objects": {...}}``.

    Raises:
        PickleNotAllowedError: a needed file is pickle and ``allow_pickle`` is False.
        StateMismatchError: an object has no file, or its state does not fit.
    """
    from statekit.engine import unwrap_model

    names = set(storage.listdir())
    plan: list[tuple[Any, str]] = []
    missing = []
    for e in entries:
        kind = "custom" if e.kind in ("custom", "dict", "tensor") else e.kind
        if e.key == "accelerator":
            continue
        index = int(e.key.rsplit("_", 1)[1]) if re.search(r"_\d+$", e.key) else 0
        rel = file_for(kind, index, names)
        if rel is None:
            if kind == "dataloader":
                continue  # Accelerate writes loader state only for stateful/seedable samplers
            missing.append(e.key)
            continue
        plan.append((e, rel))
    if missing:
        raise StateMismatchError(f"Accelerate checkpoint {storage.url}", missing=missing)
    rank = 0
    if accelerator is not None:
        rank = accelerator.process_index
    rng_file = file_for("rng", 0, names, rank)
    pickled = [rel for _, rel in plan if not rel.endswith(".safetensors")] + ([rng_file] if rng_file else [])
    if pickled and not allow_pickle:
        read_pickle(storage, pickled[0], allow_pickle)  # raises, naming the file
    for e, rel in plan:
        if e.kind == "model":
            model = unwrap_model(e.obj, accelerator)
            state = read_model(storage, rel, allow_pickle)
            result = model.load_state_dict(state, strict=False)
            if result.missing_keys or result.unexpected_keys:
                raise StateMismatchError(f"model {e.key!r} ({storage.url_of(rel)})", result.missing_keys, result.unexpected_keys)
        elif e.kind == "dataloader":
            state = read_pickle(storage, rel, allow_pickle)
            if rel.startswith("dl_state_dict") and callable(getattr(e.obj, "load_state_dict", None)):
                e.obj.load_state_dict(state)
        else:
            e.obj.load_state_dict(read_pickle(storage, rel, allow_pickle))
    step = None
    if rng_file:
        states = read_pickle(storage, rng_file, allow_pickle)
        step = states.get("step")
        random.setstate(states["random_state"])
        np_random = sys.modules.get("numpy.random")
        if np_random is not None and "numpy_random_seed" in states:
            np_random.set_state(states["numpy_random_seed"])
        torch.set_rng_state(states["torch_manual_seed"])
        if torch.cuda.is_available() and "torch_cuda_manual_seed" in states:
            torch.cuda.set_rng_state_all(states["torch_cuda_manual_seed"])
    if accelerator is not None and step is not None:
        accelerator.step = step
    return {"format": "accelerate", "step": step, "objects": {e.key: {"kind": e.kind, "file": rel} for e, rel in plan}}


def convert(src_url: str, out_url: str, *, allow_pickle: bool = False, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Rewrite a directory written by ``Accelerator.save_state`` in the statekit format.

    Models are streamed tensor file to tensor file (``model_<i>.safetensors``); optimizer,
    scheduler, scaler, custom and StatefulDataLoader states are unpickled (only with
    ``allow_pickle=True``) and stored through the codec. Accelerate's
    ``random_states_<rank>.pkl`` are stored as ``accelerate_rng/rank-<r>`` state files for
    reference; statekit-rng does not restore them.

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
    import json

    from statekit._version import __version__
    from statekit.context import CORE, Checkpoint
    from statekit.locking import prepare_target
    from statekit.errors import StatekitError

    src = Storage(src_url, storage_options)
    if not is_accelerate_checkpoint(src):
        raise StatekitError(f"{src_url} is not a directory written by Accelerator.save_state")
    names = sorted(n for n in src.listdir() if _ACCELERATE_FILE.match(n))
    pickled = [n for n in names if not n.endswith(".safetensors")]
    if pickled and not allow_pickle:
        read_pickle(src, pickled[0], allow_pickle)
    out = Storage(out_url, storage_options)
    prepare_target(out, overwrite=False)
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
            checkpoint.save_state(f"accelerate_rng/rank-{int(index):05d}", states)
            continue
        elif base in kinds:
            kind = kinds[base]
            key = f"{kind}_{index}"
        else:
            continue  # sampler.bin holds a pickled sampler object, not state: nothing to convert
        if kind == "model":
            tensors = read_model(src, name, allow_pickle)
            checkpoint.save_tensors(f"{key}.safetensors", tensors)
        else:
            checkpoint.save_state(f"{key}/rank-00000" if kind == "dataloader" else key, read_pickle(src, name, allow_pickle))
        objects[key] = {"kind": kind, "owner": CORE, "per_rank": kind == "dataloader",
                        "files": sorted(p for p in checkpoint.files if p.startswith((f"{key}.", f"{key}/")))}
    manifest = {
        "format": fmt.FORMAT,
        "statekit_version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z"),
        "step": step,
        "world_size": 1,
        "plugins": {},
        "objects": objects,
        "records": {},
        "files": checkpoint.files,
        "metadata": {"converted_from": src.url, "source_format": "accelerate"},
    }
    out.commit(fmt.MANIFEST_NAME, json.dumps(manifest, indent=1, allow_nan=False).encode("utf-8"))
    return manifest
