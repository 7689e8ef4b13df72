"""Pickle files of foreign checkpoints: the one ``allow_pickle`` gate (without it
:class:`statekit.PickleNotAllowedError` names the file before a byte is read) and the one
unpickler (``torch.load(weights_only=True)`` first, the full one where that refuses).
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from typing import Any

import torch

from statekit.engine.entries import strip_wrapper_prefixes
from statekit.checks.state_check import flatten
from statekit.errors import CorruptCheckpointError, PickleNotAllowedError
from statekit.storage import Storage


def refuse_pickle(url: str, allow_pickle: bool, what: str | None = None, remedy: str = "--allow-pickle") -> None:
    """The gate: raise unless the caller allowed unpickling ``url`` (``what`` the file is and
    the ``remedy`` go into the message).

    Raises:
        PickleNotAllowedError: ``allow_pickle`` is False.
    """
    if not allow_pickle:
        kind = f" ({what})" if what else ""
        raise PickleNotAllowedError(
            f"{url} is a pickle file{kind}; pickle can run arbitrary code on load, so statekit reads it only with "
            f"allow_pickle=True ({remedy})"
        )


def load_pickle(
    storage: Storage,
    rel: str,
    allow_pickle: bool,
    *,
    what: str | None = None,
    remedy: str = "--allow-pickle",
    mmap: bool = False,
) -> Any:
    """Unpickle one file ``rel`` of a foreign checkpoint (``""``: the file itself) if
    ``allow_pickle``; tensors on the CPU. ``mmap``: memory-map a local file (read-only use).

    Raises:
        PickleNotAllowedError: ``allow_pickle`` is False (names the file; nothing is read).
        CorruptCheckpointError: the file cannot be unpickled (truncated or damaged; names it).
    """
    refuse_pickle(storage.url_of(rel), allow_pickle, what, remedy)
    path = storage.local_path(rel) if mmap else None
    if path is not None:
        for kwargs in ({"weights_only": True, "mmap": True}, {"weights_only": True}, {"weights_only": False}):
            try:
                return torch.load(path, map_location="cpu", **kwargs)
            except (pickle.UnpicklingError, RuntimeError, ValueError, EOFError) as exc:
                if kwargs["weights_only"] is False:
                    raise unreadable_pickle(storage.url_of(rel), exc) from exc
        raise AssertionError("unreachable")  # pragma: no cover
    data = storage.read_bytes(rel)
    try:
        try:
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
    except (RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as exc:
        raise unreadable_pickle(storage.url_of(rel), exc) from exc


def unreadable_pickle(url: str, exc: BaseException) -> CorruptCheckpointError:
    """The :class:`CorruptCheckpointError` naming ``url`` (``.path``) for a torch file that cannot
    be unpickled: ``torch.load`` says ``negative seek value`` or ``PytorchStreamReader failed ...``, naming no file."""
    return CorruptCheckpointError(
        f"{url}: cannot be read as a torch file (truncated or damaged): {type(exc).__name__}: {exc}",
        path=url,
    )


class PickleFiles:
    """Lazily unpickled torch files, flattened to ``name -> tensor`` (one cache per reader).

    Args:
        load: ``load(rel)`` unpickles one file (and applies the ``allow_pickle`` gate).
        is_model: ``is_model(rel)`` is True for files holding a model state dict, whose
            wrapper prefixes (``_orig_mod.``, ``module.``) are removed from the names.
    """

    def __init__(self, load: Callable[[str], Any], is_model: Callable[[str], bool] = lambda rel: False) -> None:
        self._load = load
        self._is_model = is_model
        self._cache: dict[str, dict[str, torch.Tensor]] = {}

    def tensors(self, rel: str) -> dict[str, torch.Tensor]:
        """``name -> tensor`` of one file (unpickled on first use)."""
        if rel not in self._cache:
            flat: dict[str, torch.Tensor] = {}
            flatten(self._load(rel), "", flat)
            self._cache[rel] = strip_wrapper_prefixes(flat) if self._is_model(rel) else flat
        return self._cache[rel]
