"""What statekit-diffusers loads back: every model, EMA and noise scheduler it saved, in place.

Each ``prepare_*`` function checks one object against what was saved (keys, shapes and
dtypes with statekit's fit check, configs read) and returns the job that loads it; the
hook runs the jobs only once every object was checked, so a mismatch leaves every object
untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from statekit.plugin_api import (
    CorruptCheckpointError, StatekitError, StateMismatchError, check_fit, custom_load, read_header, unwrap_model,
)
from statekit_diffusers import layout
from statekit_diffusers.scheduler import NoiseScheduler


def _record(checkpoint: Any, key: str, kind: str) -> dict[str, Any]:
    rec = checkpoint.records.get(key)
    if not isinstance(rec, dict) or rec.get("kind") != kind or not isinstance(rec.get("folder"), str):
        raise CorruptCheckpointError(
            f"{checkpoint.url}: the manifest says statekit-diffusers saved {key!r} but has no valid {kind} record for it",
            path=checkpoint.url,
        )
    return rec


def _saved_shapes(checkpoint: Any, files: list[str]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for rel in files:
        url = f"{checkpoint.url}/{rel}"
        size = checkpoint.manifest.size_of(rel) if checkpoint.manifest is not None else None
        with checkpoint.open(rel, "rb") as f:
            header = read_header(f, url, size)
        shapes.update((e.name, (e.shape, e.dtype)) for e in header.entries)
        shapes.update((alias, shapes[name]) for alias, name in header.aliases.items())
    return shapes


def _check_fits(checkpoint: Any, what: str, targets: Mapping[str, torch.Tensor], files: list[str]) -> None:
    """statekit's fit check (:func:`statekit.plugin_api.check_fit`) before anything is loaded."""
    where = files[0].rsplit("/", 1)[0] if files else "?"
    check_fit(f"{what} ({checkpoint.url}/{where}/; nothing was loaded)", targets, _saved_shapes(checkpoint, files))


def _fill(checkpoint: Any, what: str, targets: Mapping[str, torch.Tensor], files: list[str]) -> None:
    try:
        with torch.no_grad():
            for rel in files:
                checkpoint.load_tensors(rel, into=targets)
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(
            f"{exc} ({what} is partly overwritten: load a good checkpoint into it before use)", path=exc.path
        ) from exc


_TRANSFORMERS_META = ("architectures", "transformers_version", "torch_dtype", "dtype")


def prepare_model(checkpoint: Any, key: str, wrapped: Any) -> Callable[[], None]:
    """Check model ``key`` against its saved folder; return the job that loads it in place.

    Raises:
        StateMismatchError: the model does not fit its saved weights (keys listed).
        CorruptCheckpointError: the record or config is missing or malformed.
    """
    rec = _record(checkpoint, key, "model")
    core = unwrap_model(wrapped, checkpoint.accelerator)
    what = f"model {key!r} ({type(core).__name__} in {rec['folder']}/)"
    targets = core.state_dict()
    files = list(rec.get("weights") or [])
    _check_fits(checkpoint, what, targets, files)
    saved_config = checkpoint.load_json(f"{rec['folder']}/{layout.CONFIG_NAME}")

    def run() -> None:
        if custom_load(core) is not None:  # its load hooks or _load_from_state_dict run, as in from_pretrained
            state: dict[str, torch.Tensor] = {}
            for rel in files:
                state.update(checkpoint.load_tensors(rel))
            core.load_state_dict(state)
        else:
            _fill(checkpoint, what, targets, files)
        library = layout.library_of(core)
        if library == layout.DIFFUSERS:
            changes = layout.config_changes(core.config, saved_config)
            if changes:
                core.register_to_config(**changes)
        elif library == layout.TRANSFORMERS:
            live = core.config.to_dict()
            changes = {k: v for k, v in layout.config_changes(live, saved_config).items() if k not in _TRANSFORMERS_META}
            if changes:
                core.config.update(changes)

    return run


def prepare_ema(checkpoint: Any, key: str, ema: Any) -> Callable[[], None]:
    """Check EMA ``key`` against its saved folder; return the job that loads it in place.

    Raises:
        StateMismatchError: the EMA does not fit its saved shadow parameters.
        CorruptCheckpointError: the record is missing or malformed.
    """
    rec = _record(checkpoint, key, "ema")
    names = list(rec.get("params") or [])
    shadow = list(ema.shadow_params)
    what = f"EMA {key!r} ({rec['folder']}/)"
    if len(names) != len(shadow):
        raise StateMismatchError(
            f"{what}: saved {len(names)} shadow parameters, the live EMA has {len(shadow)} (nothing was loaded)"
        )
    targets = dict(zip(names, shadow))
    files = list(rec.get("weights") or [])
    _check_fits(checkpoint, what, targets, files)
    counters = dict(rec.get("counters") or {})
    cur_decay = counters.pop("cur_decay_value", None)

    def run() -> None:
        _fill(checkpoint, what, targets, files)
        ema.load_state_dict(counters)  # EMAModel validates the counters itself
        ema.cur_decay_value = cur_decay

    return run


def prepare_scheduler(checkpoint: Any, key: str, wrapper: Any) -> Callable[[], None]:
    """Read noise scheduler ``key``'s config; return the job that loads it.

    Raises:
        StatekitError: ``wrapper`` is not a :class:`statekit_diffusers.NoiseScheduler`.
        CorruptCheckpointError: the record or config is missing or malformed.
    """
    rec = _record(checkpoint, key, "scheduler")
    config = checkpoint.load_json(f"{rec['folder']}/{layout.SCHEDULER_CONFIG_NAME}")
    if not isinstance(wrapper, NoiseScheduler):
        raise StatekitError(
            f"{checkpoint.url}: {key!r} holds a noise scheduler configuration; load it into a "
            f"statekit_diffusers.NoiseScheduler, not a {type(wrapper).__name__}"
        )
    return lambda: wrapper.load_state_dict({"class": rec.get("class"), "config": config})


def is_mine(checkpoint: Any, key: str, kinds: tuple[str, ...]) -> bool:
    """Whether this plugin saved ``key``: the manifest's owner says so; a directory that
    Accelerate wrote under ``statekit.attach`` has no objects table, so there the records do."""
    owner = checkpoint.owner_of(key)
    if owner is not None:
        return owner == checkpoint.plugin
    rec = checkpoint.records.get(key)
    return isinstance(rec, dict) and rec.get("kind") in kinds
