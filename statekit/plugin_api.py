"""The plugin API: the one module of statekit a plugin imports from
(``from statekit.plugin_api import hookimpl, Checkpoint, StatekitError``).

Every name of ``__all__`` is re-exported from the module that owns it (none is implemented
here), stays importable here under that name whichever module owns it, and its docstring is
what a plugin may rely on; everything else in statekit is reachable but not promised.
``tests/unit/test_plugin_api.py`` fails on any other statekit import in this repository's
plugins. The names by topic, and why there is no checksum helper: docs/plugin-api.md.
"""

from __future__ import annotations

from statekit.devices import (
    DeviceRngModule,
    accelerator_generators,
    current_accelerator_type,
    restore_random_states,
    snapshot_random_states,
)
from statekit.distributed import broadcast_from_rank0, rank_and_world_size, statekit_group
from statekit.engine.context import CORE, Checkpoint
from statekit.engine.export_source import ExportTensor, ModelSource, TensorFiles
from statekit.engine.file_writer import WrittenFile
from statekit.engine.read import custom_load, model_tensor_files
from statekit.engine.locking import end_copy_in_progress, mark_copy_in_progress
from statekit.engine.references import CarriedCopy, carry_references
from statekit.loaders.samplers import sampler_of
from statekit.engine.entries import check_fit, unwrap_model
from statekit.errors import (
    AsyncSaveError,
    CollectiveTimeoutError,
    CheckpointExistsError,
    CheckpointInUseError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FormatVersionError,
    IncompleteCheckpointError,
    InvalidOptionError,
    PickleNotAllowedError,
    PluginError,
    PluginMissingError,
    ResumeAuditError,
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
    seconds_from_env,
    warn_user,
)
from statekit.format import (
    CHUNK_BYTES,
    DTYPE_FROM_CODE,
    NATIVE_DTYPES,
    SAFETENSORS_CODES,
    TensorEntry,
    TensorHeader,
    build_header,
    encode_header,
    read_exactly_into,
    read_header,
    read_tensors,
    tensor_bytes,
)
from statekit.format.codec import encode
from statekit.format.header import view_identity
from statekit.format.layout import parse_rank_path, rank_name, rank_path
from statekit.format.manifest import MANIFEST_NAME, read_manifest
from statekit.format.manifest_types import FileEntry, Manifest
from statekit.hooks.hookspecs import ManagerView, Tier
from statekit.hooks.registry import CopyListing, hookimpl
from statekit.manager.lineage import retention_view
from statekit.manager.listing import CheckpointDir, delete_all_but, list_checkpoints
from statekit.storage import Storage, storage_errors
from statekit.storage.hashing import VerifyingReader, checksum_bytes
from statekit.storage.inuse import (
    InUseMarker,
    hold_in_use,
    in_use_markers,
    is_in_use,
    mark_in_use,
    release_in_use,
    remove_stale_markers,
)

__all__ = [
    # lineage: what a tier's retention counts under branches
    "retention_view",
    # hooks and the checkpoint context
    "CORE",
    "Checkpoint",
    "WrittenFile",
    "hookimpl",
    # errors
    "AsyncSaveError",
    "CollectiveTimeoutError",
    "CheckpointExistsError",
    "CheckpointInUseError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "FormatVersionError",
    "IncompleteCheckpointError",
    "InvalidOptionError",
    "PickleNotAllowedError",
    "PluginError",
    "PluginMissingError",
    "ResumeAuditError",
    "ResumeAuditWarning",
    "StateCheckWarning",
    "ResumeFingerprintWarning",
    "ResumeMismatchError",
    "StateMismatchError",
    "StatekitError",
    "StatekitWarning",
    "StorageError",
    "UnsupportedDtypeError",
    "UnsupportedValueError",
    "warn_user",
    # storage
    "Storage",
    "storage_errors",
    # the format
    "CHUNK_BYTES",
    "DTYPE_FROM_CODE",
    "NATIVE_DTYPES",
    "SAFETENSORS_CODES",
    "TensorEntry",
    "TensorHeader",
    "build_header",
    "encode_header",
    "encode",
    "parse_rank_path",
    "model_tensor_files",
    "seconds_from_env",
    "rank_name",
    "rank_path",
    "read_exactly_into",
    "read_header",
    "read_manifest",
    "FileEntry",
    "Manifest",
    "read_tensors",
    "tensor_bytes",
    "view_identity",
    # the manager hooks and the checkpoints under a root
    "CheckpointDir",
    "CopyListing",
    "ManagerView",
    "Tier",
    "delete_all_but",
    "list_checkpoints",
    # copying a committed checkpoint to another root
    "MANIFEST_NAME",
    "VerifyingReader",
    "CarriedCopy",
    "carry_references",
    "checksum_bytes",
    "end_copy_in_progress",
    "hold_in_use",
    "mark_copy_in_progress",
    # models and data
    "ExportTensor",
    "ModelSource",
    "TensorFiles",
    "check_fit",
    "custom_load",
    "sampler_of",
    "unwrap_model",
    # in-use markers
    "InUseMarker",
    "in_use_markers",
    "is_in_use",
    "mark_in_use",
    "release_in_use",
    "remove_stale_markers",
    # processes
    "broadcast_from_rank0",
    "DeviceRngModule",
    "accelerator_generators",
    "current_accelerator_type",
    "restore_random_states",
    "snapshot_random_states",
    "rank_and_world_size",
    "statekit_group",
]
