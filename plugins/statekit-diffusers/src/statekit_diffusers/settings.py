"""Settings given in code: folder names, EMA pairing, pipeline class, shard size.

A save's keyword options (``checkpoint.options``) win over the process-wide
:func:`configure` defaults, for saves that cannot pass options (``accelerator.save_state``).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from statekit.plugin_api import StatekitError

from statekit_diffusers import layout

OPTION_NAMES = "diffusers_names"
OPTION_EMA = "diffusers_ema"
OPTION_PIPELINE = "diffusers_pipeline"
OPTION_MAX_SHARD = "max_shard_size"
OPTIONS = (OPTION_NAMES, OPTION_EMA, OPTION_PIPELINE, OPTION_MAX_SHARD)
"""Every ``checkpoint.options`` key this plugin reads."""

_lock = threading.Lock()


@dataclass
class Settings:
    """Resolved settings of one save.

    Attributes:
        names: ``(stable key or object, folder name)`` pairs.
        ema: ``(EMA stable key or EMAModel, model stable key or model)`` pairs.
        pipeline: diffusers pipeline class name recorded for ``statekit convert``, or None.
        max_shard_bytes: largest weights file, bytes.
    """

    names: list[tuple[Any, str]] = field(default_factory=list)
    ema: list[tuple[Any, Any]] = field(default_factory=list)
    pipeline: str | None = None
    max_shard_bytes: int = layout.DEFAULT_MAX_SHARD_BYTES

    def name_for(self, key: str, *objs: Any) -> str | None:
        """The folder name given in code for the object with stable ``key`` (any of ``objs``
        may be the object itself: wrapped or unwrapped), or None."""
        return _lookup(self.names, key, objs)

    def ema_target(self, key: str, ema: Any) -> Any:
        """The model (stable key or object) an EMA was paired with in code, or None."""
        return _lookup(self.ema, key, (ema,))


def _lookup(pairs: list[tuple[Any, Any]], key: str, objs: tuple[Any, ...]) -> Any:
    for k, v in pairs:
        if isinstance(k, str):
            if k == key:
                return v
        elif any(k is o for o in objs):
            return v
    return None


def _pairs(value: Any, option: str) -> list[tuple[Any, Any]]:
    if value is None:
        return []
    if not isinstance(value, Mapping):
        raise StatekitError(f"statekit-diffusers: {option} must be a mapping, got {type(value).__name__}")
    return list(value.items())


_configured = Settings()


def configure(
    *,
    names: Mapping[Any, str] | None = None,
    ema: Mapping[Any, Any] | None = None,
    pipeline: str | None = None,
    max_shard_size: int | str | None = None,
) -> None:
    """Set process-wide defaults for saves that cannot pass options (``accelerator.save_state``).

    Each call replaces every setting (``configure()`` resets them); a save's options
    (``diffusers_names=``...) take precedence, key by key. See docs/plugins/diffusers.md.

    Args:
        names: folder name per model, EMA or noise scheduler, keyed by stable key or by
            the object (as prepared or unwrapped); naming a transformers model makes it a
            pipeline component.
        ema: ``{ema_key_or_object: model_key_or_object}``, when the plugin cannot tell.
        pipeline: pipeline class name for ``model_index.json`` (``"StableDiffusionPipeline"``).
        max_shard_size: largest weights file, bytes or a string (``"5GB"``, ``"200MiB"``).
            Default 5 GB.

    Raises:
        StatekitError: a folder name is not file-name-safe, or a size cannot be parsed.
    """
    global _configured
    new = Settings(
        names=_pairs(names, "names"),
        ema=_pairs(ema, "ema"),
        pipeline=_check_pipeline(pipeline),
        max_shard_bytes=layout.parse_size(max_shard_size) if max_shard_size is not None else layout.DEFAULT_MAX_SHARD_BYTES,
    )
    for _, name in new.names:
        layout.check_folder(name, "configure(names=...)")
    with _lock:
        _configured = new


def _check_pipeline(value: Any) -> str | None:
    if value is not None and (not isinstance(value, str) or not value.isidentifier()):
        raise StatekitError(f"statekit-diffusers: pipeline must be a pipeline class name, got {value!r}")
    return value


def resolve(options: Mapping[str, Any]) -> Settings:
    """Merge a save's ``checkpoint.options`` over the :func:`configure` defaults.

    Raises:
        StatekitError: a malformed option (names it).
    """
    with _lock:
        base = _configured
    names = _pairs(options.get(OPTION_NAMES), OPTION_NAMES)
    for _, name in names:
        layout.check_folder(name, OPTION_NAMES)
    shard = options.get(OPTION_MAX_SHARD)
    return Settings(
        names=names + base.names,
        ema=_pairs(options.get(OPTION_EMA), OPTION_EMA) + base.ema,
        pipeline=_check_pipeline(options.get(OPTION_PIPELINE)) or base.pipeline,
        max_shard_bytes=layout.parse_size(shard) if shard is not None else base.max_shard_bytes,
    )
