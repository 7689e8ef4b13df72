"""The statekit exception hierarchy: one base, :class:`StatekitError`, and leaves that also
subclass the builtin they refine (as orbax's ``NoEntryError(KeyError)``). When each is raised:
docs/errors.md."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterable

__all__ = [
    "StatekitError",
    "StatekitWarning",
    "CheckpointNotFoundError",
    "IncompleteCheckpointError",
    "CorruptCheckpointError",
    "BaseReferenceError",
    "MissingBaseError",
    "ChangedBaseError",
    "FormatVersionError",
    "StateMismatchError",
    "PluginError",
    "PluginMissingError",
    "PickleNotAllowedError",
    "CheckpointExistsError",
    "CheckpointInUseError",
    "AsyncSaveError",
    "CollectiveTimeoutError",
    "UnsupportedDtypeError",
    "UnsupportedValueError",
    "InvalidOptionError",
    "StorageError",
    "ResumeFingerprintWarning",
    "OtherRunWarning",
    "ResumeMismatchError",
]


class StatekitError(Exception):
    """Base class of every error statekit raises on purpose."""

    __module__ = "statekit"

    def __reduce__(self) -> tuple:
        # Rebuild from the final message and attributes without calling a subclass's
        # __init__ (whose signature differs): errors cross processes (multiprocessing,
        # gathering failures across ranks) intact.
        return (_rebuild, (type(self), self.args, self.__dict__))


def _rebuild(cls: type, args: tuple, attributes: dict) -> StatekitError:
    error = cls.__new__(cls, *args)  # OSError subclasses need their own __new__
    BaseException.__init__(error, *args)
    error.__dict__.update(attributes)
    return error


class StatekitWarning(UserWarning):
    """Warned when statekit restores less than was saved, or a resume cannot be exact."""

    __module__ = "statekit"


class ResumeFingerprintWarning(StatekitWarning):
    """A setting an exact resume depends on differs between the saved run and the resuming one
    (the manifest's ``fingerprint``); names the setting, both values and the effect."""

    __module__ = "statekit"


class ResumeMismatchError(StatekitError, ValueError):
    """The resuming run differs from the saved one so that the resume cannot be exact, with
    ``strict_resume=True`` (docs/errors.md); raised before anything is loaded.

    Attributes:
        differences: one message per difference: ``"<setting> <saved> -> <live>: <effect>"``
            (``url``, the checkpoint, is named first in the message).
    """

    __module__ = "statekit"

    def __init__(self, url: str, differences: Iterable[str]) -> None:
        self.differences = list(differences)
        lines = "\n".join(f"  - {d}" for d in self.differences)
        super().__init__(
            f"{url}: the resuming run differs from the saved one ({len(self.differences)} "
            f"difference(s)); nothing was loaded:\n{lines}"
        )


class ResumeAuditWarning(StatekitWarning):
    """The resume audit found a restored data loader that does not continue where the saved run
    stood (docs/concepts.md, "Resume audit"); names the loader, the step resumed from, what differs."""

    __module__ = "statekit"


class OtherRunWarning(StatekitWarning):
    """A ``CheckpointManager`` with a ``run_id`` resumed its own newest checkpoint while a newer one
    of another run is under the same root; names both. ``resume(other_runs="ignore")`` silences it,
    ``other_runs="resume"`` continues the other run."""

    __module__ = "statekit"


class StateCheckWarning(StatekitWarning):
    """The state check after a load found live tensors that differ from the state saved
    (docs/concepts.md, "State check"); a :class:`StateMismatchError` with ``strict_resume=True``."""

    __module__ = "statekit"


class ResumeAuditError(ResumeMismatchError):
    """A :class:`ResumeAuditWarning`'s finding under ``strict_resume=True``, raised from the loader's
    ``for`` loop (before the batch reaches the training loop) or from the next save; the model and
    optimizer are loaded already.

    Attributes:
        differences: the finding, as one message.
    """

    __module__ = "statekit"

    def __init__(self, message: str) -> None:
        self.differences = [message]
        Exception.__init__(self, message)


class CheckpointNotFoundError(StatekitError, FileNotFoundError):
    """No checkpoint (and no directory) exists at the URL."""

    __module__ = "statekit"


class IncompleteCheckpointError(StatekitError):
    """The directory exists but holds no manifest: a save that never committed."""

    __module__ = "statekit"


class CorruptCheckpointError(StatekitError, ValueError):
    """A file of a committed checkpoint does not match its manifest entry or cannot be parsed;
    ``message`` names the file and what is wrong.

    Attributes:
        path: the URL or relative path of the file at fault, when there is one.
    """

    __module__ = "statekit"

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class BaseReferenceError(StatekitError):
    """A checkpoint references a model's frozen tensors in a pretrained folder
    (docs/export.md, "A frozen base is referenced") and that folder is gone, or no longer
    holds the same bytes; the message names the folder, the file and the tensor. Never a
    silent different base: make checkpoints self-contained with ``statekit convert CKPT OUT
    --to statekit --materialize`` while the folder exists.

    Attributes:
        url: the folder, or the file in it, at fault.
    """

    __module__ = "statekit"

    def __init__(self, message: str, url: str | None = None) -> None:
        super().__init__(message)
        self.url = url


class MissingBaseError(BaseReferenceError, FileNotFoundError):
    """The referenced folder, or a file of it, does not exist (moved, deleted, not mounted)."""

    __module__ = "statekit"


class ChangedBaseError(BaseReferenceError, ValueError):
    """A referenced file exists but differs from what the checkpoint recorded: its size, its
    header (names, dtypes, shapes, offsets) or a referenced tensor's bytes."""

    __module__ = "statekit"


class FormatVersionError(StatekitError, ValueError):
    """The manifest declares a format this statekit cannot read (for example a newer one)."""

    __module__ = "statekit"


class StateMismatchError(StatekitError, ValueError):
    """Saved state does not fit the object it is loaded into; ``what`` names the object or checkpoint
    (``"'model' (URL)"``), and the message lists the attributes.

    Attributes:
        missing: keys the object expects and the checkpoint lacks.
        unexpected: keys the checkpoint has and the object does not expect.
        mismatched: ``key -> "saved ... vs expected ..."`` for shape or dtype differences.
        reason: any other difference, in words, or None.
    """

    __module__ = "statekit"

    def __init__(
        self,
        what: str,
        missing: Iterable[str] = (),
        unexpected: Iterable[str] = (),
        mismatched: dict[str, str] | None = None,
        reason: str | None = None,
    ) -> None:
        self.missing = sorted(missing)
        self.unexpected = sorted(unexpected)
        self.mismatched = dict(mismatched or {})
        parts = [f"state of {what} does not match the checkpoint"]
        if self.missing:
            parts.append(f"missing keys: {_preview(self.missing)}")
        if self.unexpected:
            parts.append(f"unexpected keys: {_preview(self.unexpected)}")
        if self.mismatched:
            parts.append(
                "shape/dtype differences: "
                + _preview([f"{k} ({v})" for k, v in sorted(self.mismatched.items())])
            )
        self.reason = reason
        if reason:
            parts.append(reason)
        super().__init__("; ".join(parts))


class PluginError(StatekitError):
    """A plugin failed, or broke the hook contract; the message names the plugin and the hook.

    Attributes:
        plugin_name: the name the plugin is registered under (its entry point name).
        hook_name: the hook being called, or None when the plugin failed to load.
    """

    __module__ = "statekit"

    def __init__(self, message: str, plugin_name: str | None = None, hook_name: str | None = None):
        super().__init__(message)
        self.plugin_name = plugin_name
        self.hook_name = hook_name


class PluginMissingError(PluginError):
    """A checkpoint needs a plugin that is not installed (or is blocked); the message names the
    object, ``plugin_name`` and what to install or unblock.

    Attributes:
        distribution: the distribution to ``pip install``.
    """

    __module__ = "statekit"

    def __init__(self, message: str, plugin_name: str, distribution: str | None = None):
        super().__init__(message, plugin_name=plugin_name)
        self.distribution = distribution


class PickleNotAllowedError(StatekitError, PermissionError):
    """A foreign checkpoint holds pickle files and the caller did not pass ``allow_pickle=True``."""

    __module__ = "statekit"


class CheckpointExistsError(StatekitError, FileExistsError):
    """A committed checkpoint already exists at the URL and ``overwrite`` was not given."""

    __module__ = "statekit"


class CheckpointInUseError(StatekitError, PermissionError):
    """A live process reads the checkpoint in place (an in-use marker, see
    :mod:`statekit.storage.inuse`): it is not deleted or overwritten."""

    __module__ = "statekit"


class AsyncSaveError(StatekitError):
    """A background (async) save failed; the message names its step and URL, ``__cause__`` is the
    original error with its traceback.

    Attributes:
        url: the checkpoint URL.
    """

    __module__ = "statekit"

    def __init__(self, message: str, url: str | None = None) -> None:
        super().__init__(message)
        self.url = url


class CollectiveTimeoutError(StatekitError, TimeoutError):
    """One of statekit's collectives (its own gloo group) did not complete within
    ``STATEKIT_COLLECTIVE_TIMEOUT`` seconds: a rank never reached it. Nothing was committed; the
    group is unusable afterwards, so end the process (docs/backpressure.md).

    Attributes:
        collective: ``"gather_to_rank0"``, ``"broadcast_from_rank0"``, ``"barrier"``...
        timeout_s: the timeout, seconds.
        ranks: the ranks that did not answer, when gloo said so; None when unknown.
    """

    __module__ = "statekit"

    def __init__(self, message: str, collective: str, timeout_s: float, ranks: list[int] | None = None) -> None:
        super().__init__(message)
        self.collective = collective
        self.timeout_s = timeout_s
        self.ranks = ranks


class UnsupportedValueError(StatekitError, TypeError):
    """The codec cannot represent a value without pickle; the message names its key path."""

    __module__ = "statekit"


class UnsupportedDtypeError(UnsupportedValueError):
    """A tensor dtype has no safetensors code and no byte-view encoding; names the key."""

    __module__ = "statekit"


class InvalidOptionError(StatekitError, ValueError):
    """A setting given to statekit is invalid (docs/errors.md); the message names the option and
    the value. Raised before anything is created or written."""

    __module__ = "statekit"


def seconds_from_env(name: str, default: float, *, what: str, zero_allowed: bool) -> float:
    """Seconds from the environment variable ``name`` (``default`` when unset or empty): the one
    parser of ``STATEKIT_*`` durations. ``what`` names the duration in the message; ``zero_allowed``:
    >= 0 instead of > 0.

    Raises:
        InvalidOptionError: not a finite number of seconds in range (names the variable, its value
            and the default).
    """
    import math
    import os

    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not zero_allowed):
        raise InvalidOptionError(
            f"{name}={value!r} is not a number of seconds {'>=' if zero_allowed else '>'} 0 ({what}; "
            f"unset it for the default {default:g} s)"
        )
    return seconds


class StorageError(StatekitError, OSError):
    """An fsspec/OS error during I/O; the message names the URL and the operation.

    Attributes:
        url: the URL of the file or directory.
    """

    __module__ = "statekit"

    def __init__(self, message: str, url: str | None = None) -> None:
        super().__init__(message)
        self.url = url


_NOT_USER_CODE = ("statekit", "accelerate", "torch", "contextlib", "functools")
"""Module-name prefixes :func:`warn_user` walks past: statekit and its plugins
(``statekit_*``), Accelerate (attach mode: ``accelerator.save_state`` calls statekit's
hooks), torch (hooks, data loader iteration) and the stdlib's call wrappers."""


def user_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` by the caller of this function that points at the
    first frame outside statekit, its plugins, Accelerate and torch (the user's line); where every
    frame is library code (a background thread), the outermost frame's."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_globals.get("__name__", "").startswith(_NOT_USER_CODE):
        frame, level = frame.f_back, level + 1
    return level


def warn_user(message: str, category: type[Warning] = StatekitWarning) -> None:
    """Warn ``message`` as ``category`` (a :class:`StatekitWarning` subclass) with the stacklevel of
    the first frame outside statekit (:func:`user_stacklevel`), so it points at the user's line
    however deep it is raised. Every warning on a path a user calls goes through it."""
    warnings.warn(message, category, stacklevel=user_stacklevel())


def _preview(items: list[str], limit: int = 20) -> str:
    shown = ", ".join(items[:limit])
    return shown if len(items) <= limit else f"{shown}, ... ({len(items) - limit} more)"
