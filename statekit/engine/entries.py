"""The objects of a save or load: how each is classified, unwrapped and turned into state.

Stable keys name the files (``model_0`` for Accelerate's first model, or the mapping key
given to :func:`statekit.save`); see ``docs/format.md``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from statekit import format as fmt
from statekit.errors import StateMismatchError, UnsupportedValueError

_SAFE_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")


@dataclass
class Entry:
    """One stateful object of a save or load.

    Attributes:
        key: stable key, also the base of its file names (``model_0``, ``optim``).
        kind: ``model``, ``optimizer``, ``scheduler``, ``dataloader``, ``scaler``,
            ``tensor``, ``dict`` or ``custom``.
        obj: the object.
        per_rank: every rank writes its own copy (``<key>/rank-00000.*``).
        optional: a load leaves the object alone when the checkpoint does not hold it
            (state that exists only in some runs, such as gradients saved between
            optimizer steps); a missing non-optional object is an error.
        plugin_only: an object of a type the core cannot save (no ``state_dict`` /
            ``load_state_dict``; kind ``custom``): a plugin takes it out of
            ``checkpoint.objects`` in its pre-hook, or the save or load raises
            :class:`statekit.UnsupportedValueError` naming it (:func:`refuse_unclaimed`).
    """

    key: str
    kind: str
    obj: Any
    per_rank: bool = False
    optional: bool = False
    plugin_only: bool = False


def classify(key: str, obj: Any, per_rank: bool | None = None) -> Entry:
    """Decide how an object is stored (one without ``state_dict``/``load_state_dict`` that is
    not a tensor or dict is :attr:`Entry.plugin_only`).

    Raises:
        UnsupportedValueError: the key is not a safe file name.
    """
    if not isinstance(key, str) or not _SAFE_KEY.match(key) or key == fmt.MANIFEST_NAME.split(".")[0]:
        raise UnsupportedValueError(
            f"state key {key!r} must be a file-name-safe string (letters, digits, '_', '.', '-')"
        )
    if isinstance(obj, torch.nn.Module):
        kind = "model"
    elif isinstance(obj, torch.optim.Optimizer):
        kind = "optimizer"
    elif isinstance(obj, torch.optim.lr_scheduler.LRScheduler) or type(obj).__name__ == "AcceleratedScheduler":
        kind = "scheduler"
    elif isinstance(obj, torch.utils.data.DataLoader):
        kind = "dataloader"
    elif isinstance(obj, torch.amp.GradScaler):
        kind = "scaler"
    elif isinstance(obj, torch.Tensor):
        kind = "tensor"
    elif isinstance(obj, dict):
        kind = "dict"
    elif callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
        kind = "custom"
    else:  # only a plugin can take it (docs/hooks.md): decided after the pre-hooks
        return Entry(key, "custom", obj, bool(per_rank), plugin_only=True)
    return Entry(key, kind, obj, kind == "dataloader" if per_rank is None else per_rank)


def refuse_unclaimed(entries: list[Entry], objects: Any, verb: str) -> None:
    """Raise for a :attr:`Entry.plugin_only` object still in ``objects`` (``checkpoint.objects``
    after the pre-hooks); ``verb`` is ``"save"`` or ``"load"``, for the message.

    Raises:
        UnsupportedValueError: naming the key and the type; nothing was written (a save
            fails before the core's files) or loaded.
    """
    left = [e for e in entries if e.plugin_only and e.key in objects]
    if left:
        e = left[0]
        raise UnsupportedValueError(
            f"state[{e.key!r}] ({type(e.obj).__name__}) has no state_dict()/load_state_dict() and no installed plugin "
            f"took it in statekit_{verb}_state_pre; pass modules, optimizers, schedulers, data loaders, tensors, "
            "dicts or Stateful objects, or install the plugin that handles it (statekit plugins lists them)"
        )


def unwrap_model(model: torch.nn.Module, accelerator: Any = None) -> torch.nn.Module:
    """Strip DDP/DataParallel (``.module``) and ``torch.compile`` (``._orig_mod``) wrappers,
    so state dict keys do not depend on how many processes ran. FSDP models are returned
    as they are (statekit-fsdp handles them)."""
    while True:  # our own walk first: Accelerate's unwrap_model also strips FSDP1
        if _is_fsdp1(model):
            return model
        if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, torch.nn.Module):
            model = model._orig_mod
        else:
            break
    if accelerator is not None and not _is_fsdp1(model):
        try:
            return accelerator.unwrap_model(model, keep_fp32_wrapper=True)
        except TypeError:
            return accelerator.unwrap_model(model)
    return model


WRAPPER_PREFIXES = ("_orig_mod.", "module.")
"""State dict key prefixes of ``torch.compile`` (``OptimizedModule._orig_mod``) and
DDP/DataParallel (``.module``) wrappers, which Accelerate keeps in the files it writes."""


def strip_wrapper_prefixes(state: Mapping[str, Any], expected: Any = None) -> dict[str, Any]:
    """A new dict of ``state`` in the same order with the :data:`WRAPPER_PREFIXES` removed, as
    often as wrappers were nested, only while *every* key carries one and, with ``expected``
    (the target's state dict keys), only while the keys do not already fit them."""
    keys = list(state)
    wanted = set(expected) if expected is not None else None
    prefix_len = 0
    while keys:
        current = [k[prefix_len:] for k in keys]
        if wanted is not None and set(current) <= wanted:
            break
        prefix = next((p for p in WRAPPER_PREFIXES if all(k.startswith(p) for k in current)), None)
        if prefix is None:
            break
        prefix_len += len(prefix)
    return {k[prefix_len:]: v for k, v in state.items()} if prefix_len else dict(state)


def check_fit(where: str, targets: Mapping[str, Any], saved: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
    """The one "does this state fit this model" check, run before anything is written.

    Args:
        where: what is being loaded, for the message (``"model 'model_0' (<url>)"``).
        targets: the model's state dict (``name -> Tensor``; non-tensor extra state allowed).
        saved: ``name -> (shape, dtype)`` of every saved key (``(None, None)`` for non-tensors).

    Raises:
        StateMismatchError: keys missing or unexpected, or a tensor's shape or dtype
            differs; every difference is listed.
    """
    mismatched = {
        k: f"saved {list(saved[k][0])} {saved[k][1]} vs model {list(t.shape)} {t.dtype}"
        for k, t in targets.items()
        if isinstance(t, torch.Tensor) and saved.get(k, (None, None))[0] is not None
        and (tuple(t.shape) != tuple(saved[k][0]) or t.dtype != saved[k][1])
    }
    missing = set(targets) - set(saved)
    unexpected = set(saved) - set(targets)
    if missing or unexpected or mismatched:
        raise StateMismatchError(where, missing, unexpected, mismatched)


def _is_fsdp1(model: torch.nn.Module) -> bool:
    return type(model).__name__ == "FullyShardedDataParallel"


class LazyStateDict(Mapping):
    """A model's state dict computed on first access (``weights`` entries of the save hooks).

    Popping the entry from ``weights`` never computes it; no collective is run.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model
        self._state: dict[str, Any] | None = None

    def _get(self) -> dict[str, Any]:
        if self._state is None:
            self._state = self._model.state_dict()
        return self._state

    def __getitem__(self, key: str) -> Any:
        return self._get()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())

    def __setitem__(self, key: str, value: Any) -> None:  # Accelerate's weights are plain dicts hooks may edit
        self._get()[key] = value

    def __delitem__(self, key: str) -> None:
        del self._get()[key]

    def pop(self, key: str, *default: Any) -> Any:
        return self._get().pop(key, *default)

    @property
    def computed(self) -> bool:
        """True once the state dict has been computed."""
        return self._state is not None



def tensor_bytes(entries: Iterable[Entry], rank: int) -> int:
    """Estimated bytes of tensor data this rank writes for ``entries`` (its per-rank ones, on
    rank 0 the replicated ones too): model parameters and buffers (local shards; no ``meta``),
    optimizer state, tensor entries, shared storages once; other objects are a few KiB each
    (the free-space check's ``reserve_bytes``, :meth:`statekit.storage.Storage.refuse_if_no_space`)."""
    seen: set[tuple[Any, int]] = set()
    total = 0
    for e in entries:
        if rank != 0 and not e.per_rank:
            continue
        for t in _tensors_of(e):
            t = getattr(t, "_local_tensor", t)  # DTensor: this rank's shard
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            key = (t.device, t.data_ptr())  # not untyped_storage(): 8 us a tensor (header.view_identity)
            if key in seen:
                continue
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def _tensors_of(e: Entry) -> Iterable[Any]:
    if e.kind == "model":  # parameters, not state_dict(): FSDP1's gathers the full model
        return [*e.obj.parameters(), *e.obj.buffers()]
    if e.kind == "optimizer":
        return [v for state in e.obj.state.values() for v in state.values()]
    if e.kind == "tensor":
        return [e.obj]
    return []
