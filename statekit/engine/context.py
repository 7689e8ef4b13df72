"""The checkpoint context handed to hooks: one save's or load's identity; writes go to its
:class:`~statekit.engine.file_writer.FileWriter`, reads to its
:class:`~statekit.engine.file_reader.FileReader` (docs/design-notes.md, "Where a save and a
load live").
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from statekit import format as fmt
from statekit.engine.file_reader import FileReader
from statekit.engine.file_writer import FileWriter, WrittenFile
from statekit.engine.incremental import ReuseBase
from statekit.engine.pretrained import source_of
from statekit.engine.references import ResolvedReference
from statekit.engine.staging import StagingPool
from statekit.format.manifest_types import FileEntry, Manifest, Reference
from statekit.errors import StatekitError
from statekit.storage import Storage

CORE = "statekit"
"""Writer/owner name used for the core's own files and objects."""

ACCELERATE_WRITER = "accelerate"
"""Writer/owner name an attached accelerator's manifest records for the files
``Accelerator.save_state`` wrote itself (not a plugin: nothing to install)."""


class _TextFile(io.TextIOWrapper):
    """Text view of a checkpoint file: ``close()`` flushes and lets go of the binary file,
    which the checkpoint closes (and records in the manifest) itself."""

    def close(self) -> None:
        with contextlib.suppress(ValueError):  # already let go of
            self.detach()


class Checkpoint:
    """The context of one save or load, passed to hooks as ``checkpoint``.

    Attributes:
        url (str): the checkpoint's URL.
        fs: its fsspec filesystem.
        rank (int): this process's rank (0 without torch.distributed).
        world_size (int): number of processes.
        step (int | None): the training step being saved or loaded.
        accelerator: the ``accelerate.Accelerator``, or None.
        options (dict): keyword options not known to the core (``device_map=``...).
        plugin (str | None): the plugin being called; None while the core runs.
        objects (dict): stateful objects other than models, by stable key; a plugin that
            handles one pops it (and owns it).
        manifest (Manifest | None): on load, the manifest read; after a save, the committed one.
        mode (str): ``"save"`` or ``"load"``.
        verify (bool): on load, check sizes and checksums while reading.
        incremental (bool): on save, an incremental save (docs/incremental.md):
            :meth:`save_tensors` reuses unchanged files by itself.
        reader (FileReader): the load's files, checked against the manifest.
    """

    def __init__(
        self,
        storage: Storage,
        *,
        mode: str,
        rank: int = 0,
        world_size: int = 1,
        step: int | None = None,
        accelerator: Any = None,
        options: dict[str, Any] | None = None,
        objects: dict[str, Any] | None = None,
        model_keys: dict[int, str] | None = None,
        manifest: Manifest | None = None,
        verify: bool = True,
        staging: StagingPool | None = None,
        incremental: bool = False,
        reuse_base: ReuseBase | None = None,
        moment: Any = None,
    ) -> None:
        self.storage = storage
        self.moment = moment
        """A save of a step boundary's state (:class:`statekit.engine.moment.Moment`: the save on
        a signal from the watcher thread), or None: the live state. Plugins read theirs with
        :meth:`boundary_state`."""
        self.url = storage.url
        self.fs = storage.fs
        self.mode = mode
        self.rank = rank
        self.world_size = world_size
        self.step = step
        self.accelerator = accelerator
        self.options = dict(options or {})
        self.objects: dict[str, Any] = objects if objects is not None else {}
        self.plugin: str | None = None
        self.handles_rng = False
        # Accelerate's registered pre-hooks: attach mode leaves them to Accelerate; a
        # writer name here makes the commit record files written around the checkpoint.
        self.accelerate_runs_hooks = False
        self.record_unlisted_at_commit: str | None = None
        self.references: dict[str, Reference] = dict(manifest.references or {}) if manifest is not None else {}
        """Model key -> the frozen tensors referenced in a pretrained folder, not written
        (:mod:`statekit.engine.references`): filled by the save, read from the manifest on load."""
        self._resolved: dict[str, ResolvedReference] = {}
        self._model_keys = dict(model_keys or {})
        self._records: dict[str, dict[str, Any]] = (
            {k: dict(v) for k, v in manifest.records.items()} if manifest is not None else {}
        )
        self.reader = FileReader(storage, manifest, verify)
        self._writer: FileWriter | None = None
        self._writer_args = {"staging": staging, "incremental": incremental, "reuse_base": reuse_base}
        if mode == "save":
            self._writer = FileWriter(storage, rank=rank, mode=mode, **self._writer_args)

    def referenced(self, key: str, model: torch.nn.Module | None = None) -> ResolvedReference | None:
        """On load, the pretrained folder of model ``key``'s referenced frozen tensors,
        found and its headers checked once per load.

        Args:
            key: the model's stable key.
            model: the model being loaded, on the first call: the folder it declares or
                learned from ``from_pretrained`` is tried after the recorded one.

        Returns:
            Its :class:`~statekit.engine.references.ResolvedReference`, or None when the
            checkpoint references none for it.

        Raises:
            MissingBaseError: the folder (and any carried copy) is gone; names it.
            ChangedBaseError: a file of it differs from the record; names it.
        """
        reference = self.references.get(key)
        if reference is None:
            return None
        if key not in self._resolved:
            also = source_of([model]) if model is not None else None
            self._resolved[key] = ResolvedReference(reference, self.storage, key, self.storage.storage_options, also)
        return self._resolved[key]

    @property
    def writer(self) -> FileWriter:
        """The save's :class:`~statekit.engine.file_writer.FileWriter` (a load's is made on
        first use, to refuse a write)."""
        if self._writer is None:
            self._writer = FileWriter(self.storage, rank=self.rank, mode=self.mode, **self._writer_args)
        return self._writer

    # ---------------------------------------------------------------- identity

    @property
    def manifest(self) -> Manifest | None:
        """On load, the manifest read (what reads are checked against); after a save, the committed one."""
        return self.reader.manifest

    @manifest.setter
    def manifest(self, manifest: Manifest | None) -> None:
        self.reader.manifest = manifest

    @property
    def verify(self) -> bool:
        """On load, whether sizes and checksums are checked while reading."""
        return self.reader.verify

    @verify.setter
    def verify(self, verify: bool) -> None:
        self.reader.verify = verify

    @property
    def incremental(self) -> bool:
        """On save, an incremental save (see the class's attributes)."""
        return self.writer.incremental

    @property
    def reuse_base(self) -> ReuseBase | None:
        """On an incremental save, the committed checkpoint whose unchanged files are reused."""
        return self.writer.reuse.base

    @property
    def files(self) -> dict[str, FileEntry]:
        """On save, relative path -> :class:`~statekit.format.manifest_types.FileEntry` of
        every file written so far (what the commit puts in the manifest)."""
        return self.writer.files

    @property
    def records(self) -> dict[str, Any]:
        """This plugin's records: on save a JSON-able dict stored in the manifest under
        ``records[<plugin>]``; on load what the plugin stored at save time."""
        return self._records.setdefault(self.plugin or CORE, {})

    def all_records(self) -> dict[str, dict[str, Any]]:
        """Records of every plugin, for the manifest.

        Returns:
            ``{plugin name: records}`` of every plugin whose records are not empty.
        """
        return {k: v for k, v in self._records.items() if v}

    def boundary_state(self) -> Any:
        """In a save of a step boundary's state (:attr:`moment`): what the calling plugin's
        ``statekit_boundary_state`` returned at that boundary (save it instead of the live
        state: the main thread has gone on since); None otherwise (save the live state).

        Returns:
            The plugin's boundary state, or None.

        Raises:
            StatekitError: called outside a plugin's hook (``plugin`` is None).
        """
        if self.moment is None:
            return None
        if self.plugin is None:
            raise StatekitError("checkpoint.boundary_state() is for a plugin's hook (checkpoint.plugin is None)")
        return self.moment.plugin_states.get(self.plugin)

    @property
    def model_keys(self) -> list[str]:
        """Stable keys of every model of this save/load, in order."""
        return list(dict.fromkeys(self._model_keys.values()))

    def key_of(self, model: torch.nn.Module) -> str:
        """Stable key of a model of this save/load.

        Args:
            model: a model of this save or load (matched by identity).

        Returns:
            ``"model_0"`` with Accelerate, ``"model"`` for ``statekit.save(url, {"model": m})``.

        Raises:
            KeyError: the model is not part of this save/load.
        """
        return self._model_keys[id(model)]

    def owner_of(self, key: str) -> str | None:
        """On load: who saved an object.

        Args:
            key: a stable key (``"model_0"``, ``"optimizer_0"``, a mapping key...).

        Returns:
            The owner's plugin name, ``"statekit"`` for the core; None when the manifest does
            not list ``key``, or on save.
        """
        entry = self.manifest.objects.get(key) if self.manifest is not None else None
        return entry.owner if entry is not None else None

    @property
    def _writer_name(self) -> str:
        return self.plugin or CORE

    # ---------------------------------------------------------------- writing

    def record_unlisted(self, writer: str) -> list[str]:
        """Checksum every file written around the checkpoint (not through :meth:`open` or
        ``save_*``: Accelerate's ``save_state`` and its pre-hooks) and record it as written by
        ``writer``; hidden names and the manifest are skipped.

        Args:
            writer: the ``writer`` recorded for these files (``"accelerate"``...).

        Returns:
            The relative paths recorded, sorted.

        Raises:
            StorageError: a file cannot be listed or read (names the URL).
        """
        return self.writer.record_unlisted(writer)

    @property
    def staging(self) -> bool:
        """True during an async save: writers copy what they are given and defer the I/O
        to :meth:`flush` (run by the background thread)."""
        return self.writer.staging is not None

    def flush(self) -> None:
        """Perform the deferred writes of an async save, in the order they were made."""
        self.writer.flush()

    @contextlib.contextmanager
    def open(self, rel: str, mode: str = "rb") -> Iterator[Any]:
        """Open a file of the checkpoint, in binary or UTF-8 text mode (as fsspec's ``open``).

        Args:
            rel: relative path (no ``..``, no scheme, not absolute).
            mode: ``"wb"`` or ``"w"`` (save only; size and checksum, of the encoded bytes,
                are recorded when the block ends), ``"rb"`` or ``"r"``.

        Yields:
            A file object. On load with ``verify`` on, a file read sequentially to its end is
            checked against the manifest (a :class:`CorruptCheckpointError` from ``read``);
            after a ``seek`` it is not.

        Raises:
            ValueError: ``mode`` is none of the four.
            StatekitError: writing during a load, or the same path written twice.
            CorruptCheckpointError: ``rel`` escapes the checkpoint; on read, the file is
                listed in the manifest but missing.
            StorageError: the storage failed (names the URL).
        """
        if mode not in ("rb", "wb", "r", "w"):
            raise ValueError(f"mode must be 'rb', 'wb', 'r' or 'w', got {mode!r}")
        opened = self.writer.writing(rel, self._writer_name) if mode.startswith("w") else self.reader.reading(rel)
        with opened as f:
            if mode.endswith("b"):
                yield f
                return
            text = _TextFile(f, encoding="utf-8")
            try:
                yield text
            finally:
                text.close()  # flushes into f; f itself is closed (and recorded) by its opener

    def reuse_if_same(self, rel: str, size_bytes: int, chunks: Callable[[], Iterable[Any]]) -> WrittenFile | None:
        """Incremental save of a file the caller streams itself (docs/plugin-api.md): reuse
        the base checkpoint's file ``rel`` of the same writer when the bytes ``chunks``
        yields are exactly its bytes (XXH3-64 against its ``prefixes``, docs/incremental.md).

        Args:
            rel: the file's relative path, as for :meth:`open`.
            size_bytes: the size the file would have, bytes; a committed file of another
                size is not compared and ``chunks`` is not called.
            chunks: returns the file's bytes in order, as bytes-like pieces of any size;
                called at most once.

        Returns:
            A :class:`WrittenFile` with ``entry.reused_from`` set when reused, or None:
            the caller writes ``rel`` with :meth:`open`.

        Raises:
            StatekitError: not a save, a bad path, or ``rel`` already written in this save.
            StorageError: the reuse failed for another reason than a missing source.
        """
        return self.writer.reuse_if_same(rel, size_bytes, chunks, self._writer_name)

    def save_tensors(
        self, rel: str, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
    ) -> WrittenFile:
        """Write a safetensors file, streaming, checksummed in the same pass.

        Args:
            rel: relative path, normally ending in ``.safetensors``.
            tensors: ``name -> tensor`` (any device; tied views stored once).
            metadata: extra ``__metadata__`` (str -> str).

        Returns:
            A :class:`WrittenFile` (its ``entry`` None during an async save).

        Raises:
            UnsupportedDtypeError: a tensor cannot be stored (names the key).
            StorageError: the write failed.
        """
        return self.writer.save_tensors(rel, tensors, metadata, self._writer_name)

    @contextlib.contextmanager
    def comparing_ahead(self, files: Mapping[str, Mapping[str, torch.Tensor]]) -> Iterator[frozenset[str]]:
        """Within the block, an incremental save compares those of ``files`` that the base
        holds with their committed files on worker threads, while the caller writes others;
        :meth:`save_tensors` of such a path with the same mapping and no ``metadata`` waits
        for its comparison (docs/design-notes.md, "Incremental checkpoints"). The block's
        end returns once no worker reads a tensor any more.

        Args:
            files: ``relative path -> {name: tensor}`` that the block saves.

        Yields:
            The paths compared ahead: save them last, so their hashing overlaps the other writes.

        Raises:
            UnsupportedDtypeError: from :meth:`save_tensors` of a compared path, when a
                tensor cannot be stored (names the key).
        """
        with self.writer.reuse.comparing_ahead(files, self._writer_name) as compared:
            yield compared

    def save_json(self, rel: str, obj: Any) -> WrittenFile:
        """Write a strict JSON file (no NaN; :meth:`save_state` for rich values), indented up
        to :data:`READABLE_JSON_BYTES`, compact beyond.

        Args:
            rel: relative path (``"mine/config.json"``).
            obj: a JSON-serialisable value.

        Returns:
            A :class:`WrittenFile` (its ``entry`` None during an async save).

        Raises:
            StatekitError: ``obj`` is not strict JSON, or the path is not a valid
                relative path.
        """
        return self.writer.save_json(rel, obj, self._writer_name)

    def save_state(self, base: str, state: Any) -> list[str]:
        """Store any codec-able state (:mod:`statekit.format.codec`): ``<base>.json`` holds
        the skeleton, ``<base>.safetensors`` the tensors, if any.

        Args:
            base: relative path without extension (``"mine/state"``).
            state: nested dicts, lists, tuples, scalars, tensors, NumPy arrays.

        Returns:
            The relative paths written.

        Raises:
            UnsupportedValueError: a value cannot be stored with its exact type without pickle
                (names its key path, ``<base>/config/mode``, and its type), before any file is written.
        """
        return self.writer.save_state(base, state, self.save_tensors, self.save_json)

    # ---------------------------------------------------------------- reading

    @contextlib.contextmanager
    def reading_each_file_once(self) -> Iterator[None]:
        """Within the block, each file of the checkpoint is opened and its header parsed once:
        a tensor file whose header was read stays open at its data section until
        :meth:`load_tensors` reads it (docs/plugin-api.md). No tensor data is kept; the
        block's end closes every file still open.

        Yields:
            None.

        Raises:
            StorageError: closing a file failed (the others are closed first; raised only
                when the block itself did not raise).
        """
        with self.reader.session():
            yield

    @contextlib.contextmanager
    def fresh_memory_ahead(self, rels: list[str]) -> Iterator[None]:
        """Within the block, tensor files read later into fresh memory get their buffers made
        and faulted in ahead on a helper thread (:class:`statekit.engine.read_ahead.FreshAhead`);
        a file that cannot be opened or parsed gets none (its own read reports the fault).

        Args:
            rels: relative paths, in read order (files under 16 MiB and remote ones skipped).

        Yields:
            None.
        """
        with self.reader.fresh_memory_ahead(rels):
            yield

    def tensor_header(self, rel: str) -> fmt.TensorHeader:
        """The parsed header of a tensor file; no tensor data is read. Inside
        :meth:`reading_each_file_once` the file stays open for the read of its data.

        Args:
            rel: relative path of a safetensors file.

        Returns:
            Its entries (names, dtypes, shapes, offsets), aliases and metadata.

        Raises:
            CorruptCheckpointError: missing file or malformed header (names the file).
            StorageError: the storage failed (names the URL).
        """
        return self.reader.tensor_header(rel)

    def read_bytes(self, rel: str) -> bytes:
        """Read a whole file, verified against the manifest when ``verify`` is on.

        Args:
            rel: relative path.

        Returns:
            The file's bytes.

        Raises:
            CorruptCheckpointError: missing, or size/checksum mismatch (names the file).
        """
        return self.reader.read_bytes(rel)

    def load_tensors(
        self,
        rel: str,
        into: Mapping[str, torch.Tensor] | None = None,
        names: list[str] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Read a safetensors file of the checkpoint (verified when ``verify`` is on).

        Args:
            rel: relative path.
            into: tensors to fill in place (:func:`statekit.format.read_tensors`).
            names: read only these names (ignored while verifying, which reads every byte).

        Returns:
            ``name -> tensor`` (CPU tensors, or the ``into`` targets).

        Raises:
            CorruptCheckpointError: missing file, malformed header, truncated data, size or
                checksum mismatch (names the file). With ``into``, targets read before the
                fault hold new values; the message says the load is incomplete.
        """
        return self.reader.load_tensors(rel, into, names)

    def load_json(self, rel: str) -> Any:
        """Read a JSON file (verified when ``verify`` is on).

        Args:
            rel: relative path.

        Returns:
            The decoded value.

        Raises:
            CorruptCheckpointError: missing, mismatched or not JSON (names the file).
        """
        return self.reader.load_json(rel)

    def load_state(self, base: str, shapes_only: bool = False) -> Any:
        """Read what :meth:`save_state` wrote under ``base``.

        Args:
            base: the ``base`` given to :meth:`save_state`.
            shapes_only: tensors come back as meta tensors of the saved shapes and dtypes,
                from the header, with no tensor data read; a value that needs its data (a
                NumPy array) raises ``TypeError`` or ``RuntimeError``.

        Returns:
            The state, with the same types as saved.

        Raises:
            CorruptCheckpointError: a file is missing, malformed or fails verification.
            StateMismatchError: a saved Enum or namedtuple class is not imported in this
                process (loading never imports code), or lacks the saved value.
            FormatVersionError: the file's codec version is newer than this statekit reads.
        """
        return self.reader.load_state(base, shapes_only)
