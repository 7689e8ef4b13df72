"""statekit: a plugin-based checkpoint and training-state manager for PyTorch.

The public API is re-exported here (``__all__``); everything else is reachable but not
promised. Importing statekit imports torch, pluggy, fsspec and safetensors' helpers, but
never accelerate, diffusers or s3fs, and builds no plugin manager (that happens on first
use, in :func:`get_plugin_manager`).
"""

from __future__ import annotations

import logging

from statekit._version import __version__

from statekit.api.attach import Attachment, attach
from statekit.api.bridge import load_state, save_state
from statekit.api.export import ExportResult, export_pretrained
from statekit.engine.context import Checkpoint
from statekit.foreign.base import ForeignObject, ForeignSummary
from statekit.format.manifest_types import Manifest
from statekit.api.loading import load
from statekit.api.saveload import save
from statekit.engine.read import verify
from statekit.engine.pretrained import reference_pretrained
from statekit.api.materialize import materialize
from statekit.errors import (
    AsyncSaveError,
    CollectiveTimeoutError,
    CheckpointExistsError,
    CheckpointInUseError,
    BaseReferenceError,
    ChangedBaseError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FormatVersionError,
    IncompleteCheckpointError,
    InvalidOptionError,
    MissingBaseError,
    PickleNotAllowedError,
    PluginError,
    PluginMissingError,
    ResumeAuditError,
    OtherRunWarning,
    ResumeAuditWarning,
    StateCheckWarning,
    ResumeFingerprintWarning,
    ResumeMismatchError,
    StatekitError,
    StatekitWarning,
    StateMismatchError,
    StorageError,
    UnsupportedDtypeError,
    UnsupportedValueError,
)
from statekit.manager.listing import CheckpointDir, list_checkpoints
from statekit.manager.manager import CheckpointManager
from statekit.manager.policies import AsyncPolicy, PreemptionPolicy, RetentionPolicy
from statekit.manager.trainer_hook import CheckpointHook, TrainerProgress
from statekit.hooks.registry import get_plugin_manager, hookimpl

__all__ = [
    "__version__",
    "AsyncSaveError",
    "CollectiveTimeoutError",
    "Attachment",
    "Checkpoint",
    "Manifest",
    "ExportResult",
    "export_pretrained",
    "ForeignSummary",
    "ForeignObject",
    "CheckpointDir",
    "list_checkpoints",
    "CheckpointManager",
    "RetentionPolicy",
    "AsyncPolicy",
    "PreemptionPolicy",
    "CheckpointHook",
    "CheckpointExistsError",
    "CheckpointInUseError",
    "BaseReferenceError",
    "ChangedBaseError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "FormatVersionError",
    "IncompleteCheckpointError",
    "InvalidOptionError",
    "MissingBaseError",
    "PickleNotAllowedError",
    "PluginError",
    "PluginMissingError",
    "ResumeAuditError",
    "OtherRunWarning",
    "ResumeAuditWarning",
    "StateCheckWarning",
    "ResumeFingerprintWarning",
    "ResumeMismatchError",
    "StateMismatchError",
    "StatekitError",
    "StatekitWarning",
    "StorageError",
    "TrainerProgress",
    "UnsupportedDtypeError",
    "UnsupportedValueError",
    "attach",
    "get_plugin_manager",
    "hookimpl",
    "load",
    "load_state",
    "materialize",
    "reference_pretrained",
    "save",
    "save_state",
    "verify",
]

# A library's logging convention: statekit's INFO lines (saves, loads, resumes, skipped
# checkpoints) go to the "statekit" logger and its children; nothing is printed unless the
# application configures logging (logging.basicConfig(level=logging.INFO)).
logging.getLogger(__name__).addHandler(logging.NullHandler())
