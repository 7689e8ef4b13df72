"""The statekit exception hierarchy: one base, leaves that refine a builtin where one fits.

Every error statekit raises on purpose is a :class:`StatekitError`, so callers can catch
one type. Each leaf also subclasses the builtin it refines (``FileNotFoundError``,
``FileExistsError``, ``ValueError``...), following orbax's ``NoEntryError(KeyError)``.
"""

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
    """A setting the exactness of a resume depends on differs between the saved run and
    the resuming one (the manifest's ``fingerprint``); the message names the setting, the
    saved and the live value, and what it does to the resume."""

    __module__ = "statekit"


class ResumeMismatchError(StatekitError, ValueError):
    """The resuming run differs from the saved one in a way that breaks an exact resume,
    with ``strict_resume=True`` (or, always, a gradient accumulation change while the
    checkpoint holds gradients saved mid-accumulation). Raised before anything is loaded.

    Args:
        url: the checkpoint (named first in the message).
        differences: one message per difference: ``"<setting> <saved> -> <live>: <effect>"``.

    Attributes:
        differences: those messages, as a list.
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
    """The resume audit found a restored data loader that does not continue where the
    saved run stood (``docs/concepts.md``, Resume audit): the message names the loader, the
    step resumed from, and the expected and actual indices (or content, or epoch)."""

    __module__ = "statekit"


class OtherRunWarning(StatekitWarning):
    """A ``statekit.CheckpointManager`` with a ``run_id`` resumed its own newest
    checkpoint while a newer one of another run (or one written before lineage) is under
    the same root (a restart of a run sharing its root): the message names both
    checkpoints and both runs. ``resume(other_runs="ignore")`` resumes the run's own
    without it; ``other_runs="resume"`` continues the other run's instead."""

    __module__ = "statekit"


class StateCheckWarning(StatekitWarning):
    """The state check after a load found live tensors that differ from the state saved
    (``docs/concepts.md``, State check): the message names the object, the tensor and what
    differs (``"optimizer 'optimizer_0': exp_avg of 'layers.3.weight' is all zeros, ..."``).
    With ``strict_resume=True`` it is a :class:`StateMismatchError` instead."""

    __module__ = "statekit"


class ResumeAuditError(ResumeMismatchError):
    """A :class:`ResumeAuditWarning`'s finding under ``strict_resume=True``, raised from the
    data loader's ``for`` loop (the first batch after the resume) or from the next save (a
    restored position never consumed). The model and optimizer are loaded already; the
    batch in question was not handed to the training loop.

    Args:
        message: the finding (names the loader, the step resumed from, what differs).

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
    """A file of a committed checkpoint does not match its manifest entry or cannot be parsed.

    Args:
        message: names the file and what is wrong with it.
        path: the URL or relative path of the file at fault, when there is one.

    Attributes:
        path: the URL or relative path of the file at fault.
    """

    __module__ = "statekit"

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class FormatVersionError(StatekitError, ValueError):
    """The manifest declares a format this statekit cannot read (for example a newer one)."""

    __module__ = "statekit"


class StateMismatchError(StatekitError, ValueError):
    """Saved state does not fit the object it is loaded into.

    Args:
        what: the object or checkpoint, as the message names it (``"'model' (URL)"``).
        missing: as the attribute (the message lists it).
        unexpected: as the attribute.
        mismatched: as the attribute.
        reason: as the attribute.

    Attributes:
        missing: keys the object expects and the checkpoint lacks.
        unexpected: keys the checkpoint has and the object does not expect.
        mismatched: ``key -> "saved ... vs expected ..."`` for shape or dtype differences.
        reason: any other difference, in words (a saved Enum class this process has not
            imported), or None.
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
    """A plugin failed, or broke the hook contract.

    Args:
        message: what happened, naming the plugin and the hook.
        plugin_name: as the attribute.
        hook_name: as the attribute.

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
    """A checkpoint needs a plugin that is not installed (or is blocked).

    Args:
        message: names the object, the plugin and what to install or unblock.
        plugin_name: the plugin's name.
        distribution: as the attribute.

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
    """A background (async) save failed; ``__cause__`` is the original error, its traceback kept.

    Args:
        message: names the save (its step and URL) and the failure.
        url: as the attribute.

    Attributes:
        url: the checkpoint URL.
    """

    __module__ = "statekit"

    def __init__(self, message: str, url: str | None = None) -> None:
        super().__init__(message)
        self.url = url


class CollectiveTimeoutError(StatekitError, TimeoutError):
    """One of statekit's collectives (on its own gloo group, inside a save or a load) did
    not complete within ``STATEKIT_COLLECTIVE_TIMEOUT`` seconds: a rank never reached it
    (it crashed, or it is stuck elsewhere). The save or load it was part of did not commit
    or finish on this rank; statekit's group is unusable afterwards, so end the process.

    Args:
        message: names the collective, the save or load, and the ranks when known.
        collective: as the attribute.
        timeout_s: as the attribute.
        ranks: as the attribute.

    Attributes:
        collective: the collective's name (``"gather_to_rank0"``, ``"broadcast_from_rank0"``,
            ``"barrier"``).
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
    """A setting given to statekit is invalid (a retention count that is not a positive
    integer, a remote-tier option without ``replicate_to``, a ``CheckpointHook`` that would
    never save); the message names the option and the value. Raised before anything is
    created or written."""

    __module__ = "statekit"


def seconds_from_env(name: str, default: float, *, what: str, zero_allowed: bool) -> float:
    """A duration set by an environment variable, checked: the one parser of statekit's
    ``STATEKIT_*`` seconds (``STATEKIT_COLLECTIVE_TIMEOUT``, ``STATEKIT_REPLICATION_EXIT_TIMEOUT``).

    Args:
        name: the variable's name.
        default: seconds when it is unset or empty.
        what: what the duration is, for the message (``"the timeout of statekit's collectives"``).
        zero_allowed: whether 0 is valid (>= 0) or not (> 0).

    Returns:
        Seconds, a finite number.

    Raises:
        InvalidOptionError: the value is not a finite number of seconds in range (naming
            the variable, its value and the default).
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
    """An fsspec/OS error during I/O, with the URL it concerned.

    Args:
        message: names the URL and the operation (reading, writing, listing...).
        url: as the attribute.

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
    """The ``stacklevel`` for a ``warnings.warn`` made by the function calling this one
    that points at the first frame outside statekit, its plugins, Accelerate and torch:
    the user's line. ``warnings.warn(msg, cat, stacklevel=user_stacklevel())``.

    Returns:
        The stack level to give ``warnings.warn``; where every frame is library code (a
        background thread), the outermost frame's.
    """
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_globals.get("__name__", "").startswith(_NOT_USER_CODE):
        frame, level = frame.f_back, level + 1
    return level


def warn_user(message: str, category: type[Warning] = StatekitWarning) -> None:
    """Warn with the ``stacklevel`` of the first frame outside statekit, so the warning
    points at the user's line (their ``save()``/``resume()``/``load_state()`` call, or
    ``accelerator.save_state()`` in attach mode), however deep inside statekit, a plugin or
    Accelerate it is raised. Every warning on a path a user calls goes through it.

    Args:
        message: the warning's text.
        category: the warning class (a :class:`StatekitWarning` subclass).
    """
    warnings.warn(message, category, stacklevel=user_stacklevel())


def _preview(items: list[str], limit: int = 20) -> str:
    shown = ", ".join(items[:limit])
    return shown if len(items) <= limit else f"{shown}, ... ({len(items) - limit} more)"
