"""The plugin API: the one module of statekit a plugin imports from.

A statekit plugin (see ``docs/writing-a-plugin.md``) imports statekit names from here and
nowhere else: ``from statekit.plugin_api import hookimpl, Checkpoint, StatekitError``.
Every name below is re-exported from the module that owns it; none is implemented here.

What is promised, for every name in ``__all__``:

* it stays importable from ``statekit.plugin_api`` under that name, whatever module of
  the core owns it (the core's internal layout can change between releases; this module
  follows it);
* its documented behaviour (its docstring, rendered on the "Plugin API" page of the docs)
  is what a plugin may rely on; keyword arguments and attributes not documented there are
  not part of it.

Everything else in statekit (modules under ``statekit.engine``, ``statekit.api``,
``statekit.format``..., names starting with ``_``) is reachable but not promised to
plugins. The test ``tests/unit/test_plugin_api.py`` parses the plugins of this repository and
its plugin template and fails on any other statekit import. The API holds what those
plugins use, no more: every error class, and the names below.

The names, by topic:

* hooks: :data:`hookimpl`, the marker of hook implementations;
* the checkpoint context: :class:`Checkpoint` (I/O through the checkpoint, every file
  recorded in the manifest and verified on read), :class:`WrittenFile` (what its writes
  return) and :data:`CORE`, the owner and writer name of the core;
* errors: every statekit error class and :class:`StatekitWarning`;
* storage: :class:`Storage` (a checkpoint location: any fsspec URL) and
  :func:`storage_errors`;
* the format: safetensors headers and tensor streams (:func:`read_header`, the one
  header reader; :func:`build_header` and :func:`encode_header` (the one header writer), :func:`read_tensors`, :func:`read_exactly_into`, :func:`tensor_bytes`,
  :func:`view_identity` (the one tied-view test),
  :class:`TensorHeader`, :class:`TensorEntry`, :data:`CHUNK_BYTES`), the dtype tables
  (:data:`SAFETENSORS_CODES`, :data:`NATIVE_DTYPES`, :data:`DTYPE_FROM_CODE`), the state
  codec's :func:`encode`, :func:`read_manifest` and :class:`Manifest` (typed:
  ``checkpoint.manifest`` at load, read by attribute), and the per-rank path
  ``<key>/rank-<r:05d>`` (:func:`rank_path`, :func:`rank_name`, :func:`parse_rank_path`:
  every per-rank file of the core and of a plugin is named through them). There is no checksum helper: files
  read through the checkpoint (``checkpoint.open(rel, "rb")``, ``read_bytes``,
  ``load_tensors``...) are verified against the manifest's size and checksum as they are
  read, and files written through it are recorded with theirs (only a copy outside any
  checkpoint context verifies by hand, with :class:`VerifyingReader`, below);
* models and data: :func:`unwrap_model`, :func:`check_fit` (the one "does this state fit
  this model" check), :func:`custom_load` (whether a model has load code of its own, so a
  plugin loads it through ``load_state_dict`` rather than filling its tensors in place)
  and :func:`sampler_of` (the one sampler lookup);
* in-use markers of checkpoints read in place (retention, ``statekit gc`` and
  ``overwrite=True`` respect them): :func:`mark_in_use`, :func:`release_in_use`,
  :func:`in_use_markers`, :func:`is_in_use`, :func:`remove_stale_markers`,
  :class:`InUseMarker`;
* warnings: :func:`warn_user` (a warning that points at the user's line, not the plugin's:
  every warning on a save/load path goes through it);
* tier plugins (a copy of every committed checkpoint on another root): :class:`Tier`, what
  the core asks of the object such a plugin keeps in ``manager.plugin_state`` (backlog,
  what is copied, the exit deadline), and ``STATEKIT_COPY_MARKERS`` (a plugin attribute:
  the ``by`` of the in-use markers it holds on a checkpoint it is copying, which
  ``statekit ls --replica`` shows as "copying");
* the manager hooks (``docs/hooks.md``, Manager hooks): :class:`ManagerView`, what a hook
  may rely on of the ``CheckpointManager`` it is handed (root URL, storage options,
  ``manager_options``, ``list()``, ``url_of(name)``, ``resumed_from``, ``plugin_state``),
  and the checkpoints under a root: :class:`CheckpointDir`, :func:`list_checkpoints`,
  :func:`delete_all_but` (retention's one deletion loop);
* copying a committed checkpoint to another root (the ``replicate`` plugin):
  :data:`MANIFEST_NAME` (written last: the commit), :class:`Manifest` (parse manifest
  bytes), :class:`VerifyingReader` and :func:`checksum_bytes` (verify a copy at its
  destination against the manifest), :func:`mark_copy_in_progress` and
  :func:`end_copy_in_progress` (``statekit gc`` keeps a copy being filled), and
  :func:`hold_in_use` (an in-use marker that lives as long as an object);
* processes: :func:`rank_and_world_size`, :func:`statekit_group` (statekit's own gloo
  group, for a plugin's collectives) and :func:`broadcast_from_rank0`, and :func:`current_accelerator_type` (the one
  accelerator lookup: the core's resume fingerprint and RNG guard use it too);
* random states: :func:`accelerator_generators` (the accelerator and the module holding its
  generators, :class:`DeviceRngModule`), :func:`snapshot_random_states` and
  :func:`restore_random_states` (Python, NumPy, torch CPU and the accelerator's
  generators: the one snapshot and restore, which the core's RNG guard uses too).
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
from statekit.engine.file_writer import WrittenFile
from statekit.engine.read import custom_load, model_tensor_files
from statekit.engine.locking import end_copy_in_progress, mark_copy_in_progress
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
from statekit.hooks.registry import hookimpl
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
    "ManagerView",
    "Tier",
    "delete_all_but",
    "list_checkpoints",
    # copying a committed checkpoint to another root
    "MANIFEST_NAME",
    "VerifyingReader",
    "checksum_bytes",
    "end_copy_in_progress",
    "hold_in_use",
    "mark_copy_in_progress",
    # models and data
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
