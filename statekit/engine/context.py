"""The checkpoint context handed to hooks: identity of the save/load, and I/O through it.

Every file written through a :class:`Checkpoint` is recorded for the manifest with its
size, XXH3-64 checksum, rank and writer (the plugin being called, or ``"statekit"``), in
the same pass as the write. Reads check size and checksum against the manifest while
reading when ``verify`` is on, in the same pass as the read, by
:class:`statekit.storage.hashing.VerifyingReader` or by the hasher handed to
:func:`statekit.format.read_tensors`.

One class, one responsibility: the I/O of one save or load through the manifest (what a
hook is handed as ``checkpoint``). Writing records each file for the manifest, reading
checks each file against it; both halves share the identity (URL, rank, records) and the
manifest, and a hook sees one object.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from statekit import devices
from statekit import format as fmt
from statekit.engine.incremental import ReuseBase
from statekit.engine.read_ahead import FreshAhead, worth_reading_ahead
from statekit.engine.staging import StagingPool
from statekit.errors import CorruptCheckpointError, StatekitError
from statekit.format import codec
from statekit.format.manifest_types import FileEntry, Manifest
from statekit.format.tensors import is_accelerator
from statekit.storage import Storage, storage_errors
from statekit.storage.fs import fsync_path
from statekit.storage.hashing import HashingWriter, PrefixHasher, VerifyingReader, check_against

logger = logging.getLogger("statekit")

CORE = "statekit"
"""Writer/owner name used for the core's own files and objects."""

ACCELERATE_WRITER = "accelerate"
"""Writer/owner name an attached accelerator's manifest records for the files
``Accelerator.save_state`` wrote itself (not a plugin: nothing to install)."""

READABLE_JSON_BYTES = 64 * 1024
"""JSON files up to this many characters are indented for people to read; larger ones
(an optimizer skeleton of thousands of parameters) are written compact, because indenting
takes Python's pure-Python encoder: 0.052 s against 0.008 s for the 1.3 MB skeleton of
2,500 layers' AdamW state."""


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, where the platform has one;
    ``os.cpu_count()`` counts the whole machine's)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


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
        incremental (bool): on save, an incremental save (``CheckpointManager``'s
            default, docs/incremental.md): :meth:`save_tensors` reuses a file whose bytes
            equal the run's last committed checkpoint's file of the same path and writer.
            A plugin may use it to put tensors that rarely change (frozen parameters) in
            files of their own; it never needs it to decide reuse.
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
    ) -> None:
        self.storage = storage
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
        self.manifest = manifest
        self.verify = verify
        self.files: dict[str, dict[str, Any]] = {}
        self.handles_rng = False
        # Accelerate's registered pre-hooks: attach mode leaves them to Accelerate; a
        # writer name here makes the commit record files written around the checkpoint.
        self.accelerate_runs_hooks = False
        self.record_unlisted_at_commit: str | None = None
        self._model_keys = dict(model_keys or {})
        self._records: dict[str, dict[str, Any]] = (
            {k: dict(v) for k, v in manifest.records.items()} if manifest is not None else {}
        )
        self._writable = mode == "save"
        self._staging = staging
        self._deferred: list[Callable[[], None]] = []
        self._planned: set[str] = set()
        self._ahead: FreshAhead | None = None
        self._held: dict[str, _OpenTensorFile] | None = None  # inside reading_each_file_once
        self._kept_json: dict[str, bytes] | None = None
        # incremental saves (statekit.engine.incremental): record running checksums in
        # every tensor file; reuse a committed file of reuse_base whose bytes are the same
        self.incremental = incremental
        self.reuse_base = reuse_base
        self._compared: dict[str, tuple[Mapping[str, torch.Tensor], concurrent.futures.Future[tuple[bool, str | None]]]] = {}
        self._digests: dict[str, str] = {}  # device digests computed by a comparison, for the write that follows

    # ---------------------------------------------------------------- identity

    @property
    def records(self) -> dict[str, Any]:
        """This plugin's records: on save a JSON-able dict stored in the manifest under
        ``records[<plugin>]``; on load what the plugin stored at save time."""
        return self._records.setdefault(self.plugin or CORE, {})

    def all_records(self) -> dict[str, dict[str, Any]]:
        """Records of every plugin (non-empty ones), for the manifest.

        Returns:
            ``{plugin name: records}`` for every plugin whose records are not empty.
        """
        return {k: v for k, v in self._records.items() if v}

    @property
    def model_keys(self) -> list[str]:
        """Stable keys of every model of this save/load, in order."""
        return list(dict.fromkeys(self._model_keys.values()))

    def key_of(self, model: torch.nn.Module) -> str:
        """Stable key of a model of this save/load (``model_0``, or the mapping key).

        Args:
            model: a model of this save or load (matched by identity).

        Returns:
            The stable key, e.g. ``"model_0"`` with Accelerate or ``"model"`` for
            ``statekit.save(url, {"model": m})``.

        Raises:
            KeyError: the model is not part of this save/load.
        """
        return self._model_keys[id(model)]

    def owner_of(self, key: str) -> str | None:
        """On load: the plugin (or ``"statekit"``) that saved object ``key``, or None.

        Args:
            key: a stable key (``model_0``, ``optimizer_0``, a mapping key...).

        Returns:
            The owner's plugin name, ``"statekit"`` for the core, or None when the
            manifest does not list ``key`` (or on save).
        """
        entry = self.manifest.objects.get(key) if self.manifest is not None else None
        return entry.owner if entry is not None else None

    # ---------------------------------------------------------------- writing

    def _check_writable(self, rel: str) -> str:
        if not self._writable:
            raise StatekitError(f"{self.url}: checkpoint is not open for writing ({self.mode}); cannot write {rel!r}")
        fmt.check_relpath(rel, source=self.url, error=StatekitError)
        if rel in self._planned or rel == fmt.MANIFEST_NAME:
            raise StatekitError(f"{self.url}/{rel}: written twice in one save (or reserved name)")
        self._planned.add(rel)
        return rel

    def _record(self, rel: str, size_bytes: int, checksum: str, writer: str | None = None, **more: Any) -> dict[str, Any]:
        """Keep a written file's manifest entry; ``more``: the optional fields of an
        incremental save (``prefixes``, ``reused_from``, ``digest``)."""
        entry = {"size_bytes": size_bytes, "checksum": checksum, "rank": self.rank, "writer": writer or self.plugin or CORE}
        entry.update({k: v for k, v in more.items() if v})
        self.files[rel] = entry
        return entry

    def record_unlisted(self, writer: str) -> list[str]:
        """Checksum every file under the checkpoint that was written around it (not through
        :meth:`open`/``save_*``) and record it for the manifest as written by ``writer``.

        Used where foreign code writes into the directory itself: Accelerate's own
        ``save_state`` in attach mode, functions registered with Accelerate's
        ``register_save_state_pre_hook``. Hidden names (the save lock, temporary files,
        in-use markers) and the manifest are skipped. Reads each new file once.

        Args:
            writer: the ``writer`` recorded for these files (``"accelerate"``...).

        Returns:
            The relative paths recorded, sorted.

        Raises:
            StorageError: a file cannot be listed or read (names the URL).
        """
        added = []
        for rel in self.storage.find():
            if rel in self.files or rel == fmt.MANIFEST_NAME or rel.rsplit("/", 1)[-1].startswith("."):
                continue
            hasher = fmt.new_hasher()
            size = 0
            with self.storage.open_read(rel) as f, storage_errors(self.storage.url_of(rel), "reading"):
                while chunk := f.read(fmt.CHUNK_BYTES):
                    hasher.update(chunk)
                    size += len(chunk)
            self.files[rel] = {"size_bytes": size, "checksum": fmt.checksum_string(hasher), "rank": self.rank, "writer": writer}
            added.append(rel)
        if self.storage.is_local:  # foreign writers do not fsync: make their files durable before the commit
            directories = set()
            for rel in added:
                path = self.storage.path_of(rel)
                fsync_path(path)
                directories.add(os.path.dirname(path))
            for directory in sorted(directories):
                fsync_path(directory)
        return added

    @property
    def staging(self) -> bool:
        """True during an async save: writers copy what they are given and defer the I/O
        to :meth:`flush` (run by the background thread)."""
        return self._staging is not None

    def flush(self) -> None:
        """Perform the deferred writes of an async save, in the order they were made."""
        deferred, self._deferred = self._deferred, []
        for write in deferred:
            write()

    @contextlib.contextmanager
    def open(self, rel: str, mode: str = "rb") -> Iterator[Any]:
        """Open a file of the checkpoint by relative path, in binary or text mode.

        Text modes work as fsspec's ``open`` does: the binary file is wrapped in an
        ``io.TextIOWrapper`` (UTF-8 here, universal newlines); size and checksum are those
        of the encoded bytes. Every mode works during an async save too (the bytes are
        written by the background thread).

        Args:
            rel: relative path (no ``..``, no scheme, not absolute).
            mode: ``"wb"`` or ``"w"`` (save only: size and checksum are recorded when the
                block ends), ``"rb"`` or ``"r"``.

        Yields:
            A binary file object (``"wb"``, ``"rb"``) or a UTF-8 text file object (``"w"``,
            ``"r"``). On load with ``verify`` on, a file read sequentially to its end is
            checked against the manifest's size and checksum (a
            :class:`CorruptCheckpointError` from ``read``); after a ``seek`` it is not.
            Closing a text file object inside the block only flushes it.

        Raises:
            ValueError: ``mode`` is none of the four.
            StatekitError: writing during a load, or the same path written twice.
            CorruptCheckpointError: ``rel`` escapes the checkpoint; on read, the file is
                listed in the manifest but missing.
            StorageError: the storage failed (names the URL).
        """
        if mode not in ("rb", "wb", "r", "w"):
            raise ValueError(f"mode must be 'rb', 'wb', 'r' or 'w', got {mode!r}")
        with (self._writing(rel) if mode.startswith("w") else self._reading(rel)) as f:
            if mode.endswith("b"):
                yield f
                return
            text = _TextFile(f, encoding="utf-8")
            try:
                yield text
            finally:
                text.close()  # flushes into f; f itself is closed (and recorded) by its opener

    @contextlib.contextmanager
    def _writing(self, rel: str) -> Iterator[Any]:
        self._check_writable(rel)
        if self._staging is not None:
            buffer = io.BytesIO()
            yield buffer
            self._defer_bytes(rel, buffer.getvalue())
            return
        with self.storage.open_write(rel) as f:
            writer = HashingWriter(f)
            if self.incremental:  # running checksums: the next save's reuse_if_same stops at a difference
                writer.hasher = PrefixHasher()
            yield writer
        prefixes = [list(p) for p in writer.hasher.prefixes] if self.incremental else None
        self._record(rel, writer.size_bytes, fmt.checksum_string(writer.hasher), prefixes=prefixes)

    def reuse_if_same(self, rel: str, size_bytes: int, chunks: Callable[[], Iterable[Any]]) -> dict[str, Any] | None:
        """Incremental save of a file the caller streams itself: reuse the run's last
        committed checkpoint's file ``rel`` when the bytes ``chunks`` yields are exactly its
        bytes; otherwise leave ``rel`` to be written with :meth:`open` (``"wb"``).

        :meth:`save_tensors` does this by itself; this is for a writer that streams a file
        from elsewhere (statekit-offload copies offloaded weights from their files on
        disk). Identity is decided as for :meth:`save_tensors`, from the bytes: they are
        hashed (XXH3-64) and compared with the committed file's running checksums
        (``prefixes``, recorded by :meth:`open` and :meth:`save_tensors` in an incremental
        save) and its checksum, stopping at the first record that differs, so a changed
        file costs reading up to about 64 MiB past its first difference. The committed
        file must have been written by the same writer (plugin) at the same path. The
        reuse is a hard link on local disk, a server-side copy on object stores
        (docs/incremental.md), recorded with ``reused_from``.

        Args:
            rel: the file's relative path (as it would be given to :meth:`open`).
            size_bytes: the size the file would have, bytes: a committed file of another
                size is not compared, and ``chunks`` is not called.
            chunks: returns the file's bytes, in order, as bytes-like pieces of any size;
                called at most once, and only when there is a committed file to compare with.

        Returns:
            The file's manifest entry when it was reused (``reused_from`` set; an async
            save returns ``{"staged": True, ...}`` and links it when its writes run), or
            None: nothing was reused (not an incremental save, no committed file, other
            bytes), and the caller writes ``rel`` with :meth:`open`.

        Raises:
            StatekitError: not a save, a bad path, or ``rel`` already written in this save.
            StorageError: the reuse failed for another reason than a missing source.
        """
        if not self._writable:
            raise StatekitError(f"{self.url}: checkpoint is not open for writing ({self.mode}); cannot reuse {rel!r}")
        fmt.check_relpath(rel, source=self.url, error=StatekitError)
        if rel in self._planned:
            raise StatekitError(f"{self.url}/{rel}: written twice in one save (or reserved name)")
        base = self.reuse_base
        writer = self.plugin or CORE
        committed = base.entry_for(rel, writer) if base is not None else None
        if committed is None or committed.size_bytes != size_bytes:
            return None
        if not fmt.same_stream_bytes(chunks(), committed.size_bytes, committed.checksum, committed.prefixes or ()):
            return None
        entry = self._reuse(rel, base, committed, writer)
        if entry is not None:
            self._planned.add(rel)
        return entry

    def save_tensors(
        self, rel: str, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
    ) -> dict[str, Any]:
        """Write a safetensors file, streaming, checksummed in the same pass.

        Args:
            rel: relative path, normally ending in ``.safetensors``.
            tensors: ``name -> tensor`` (any device; tied views stored once).
            metadata: extra ``__metadata__`` (str -> str).

        Returns:
            The manifest entry (``size_bytes``, ``checksum``, ``rank``, ``writer``).

        Raises:
            UnsupportedDtypeError: a tensor cannot be stored (names the key).
            StorageError: the write failed.
        """
        self._check_writable(rel)
        reused = self._reuse_if_unchanged(rel, tensors, metadata)
        if reused is not None:
            return reused
        # an incremental save of accelerator tensors records their device digest, computed
        # before the bytes leave the device (the next save compares it there)
        digest = self._digests.pop(rel, None)
        if digest is None and self.incremental:
            digest = fmt.digest_on_device(tensors, metadata)
        if self._staging is not None:
            fmt.build_header(tensors, metadata)  # fail now, on the caller's thread, for bad dtypes
            staged = self._staging.stage(rel, tensors)
            writer = self.plugin
            self._deferred.append(lambda: self._write_tensors(rel, staged, metadata, writer, digest))
            return {"rank": self.rank, "writer": writer or CORE, "staged": True}
        return self._write_tensors(rel, tensors, metadata, self.plugin, digest)

    def _write_tensors(
        self,
        rel: str,
        tensors: Mapping[str, torch.Tensor],
        metadata: Mapping[str, str] | None,
        writer: str | None,
        digest: str | None = None,
    ) -> dict[str, Any]:
        hasher = PrefixHasher() if self.incremental else fmt.new_hasher()
        with self.storage.open_write(rel) as f:
            size = fmt.write_tensors(f, tensors, metadata, hasher)
        prefixes = [list(p) for p in hasher.prefixes] if self.incremental else None
        return self._record(rel, size, fmt.checksum_string(hasher), writer, prefixes=prefixes, digest=digest)

    @contextlib.contextmanager
    def comparing_ahead(self, files: Mapping[str, Mapping[str, torch.Tensor]]) -> Iterator[frozenset[str]]:
        """Within the block, an incremental save compares those of ``files`` that the base
        checkpoint holds with their committed files on worker threads, all at once, while
        the caller writes other files.

        The comparison (:func:`statekit.format.tensors.compare_file`) is a hash of the
        file's bytes in memory, which XXH3 computes without holding the GIL (or, for
        accelerator tensors, a digest computed on the device): one file per core is hashed
        in parallel (at most two per accelerator, whose digests need temporaries in device
        memory), while the caller writes. Work queued on the caller's current streams is
        waited for first, so the workers read what it wrote
        (:func:`statekit.devices.wait_for_current_streams`). :meth:`save_tensors` of a path
        compared here, with the same ``tensors`` mapping and no ``metadata``, waits for its
        comparison instead of hashing; any other call compares as before. Nothing is
        compared outside an incremental save with a base, or for a file the base does not
        hold. Comparisons not waited for are cancelled (or finish unread) at the block's
        end, which returns only once no worker reads a tensor any more.

        Args:
            files: ``relative path -> {name: tensor}`` that the block saves
                (:func:`statekit.engine.write.tensor_files_of_model`).

        Yields:
            The paths compared ahead: save them last, so that their hashing overlaps the
            other writes.

        Raises:
            UnsupportedDtypeError: from :meth:`save_tensors` of a compared path, when a
                tensor cannot be stored (names the key).
        """
        base = self.reuse_base
        writer = self.plugin or CORE
        committed = {rel: base.entry_for(rel, writer) for rel in files} if base is not None else {}
        candidates = {rel: entry for rel, entry in committed.items() if entry is not None}
        if not candidates:
            yield frozenset()
            return
        on_devices = {t.device for rel in candidates for t in files[rel].values()
                      if isinstance(t, torch.Tensor) and is_accelerator(t.device)}
        devices.wait_for_current_streams(on_devices)
        workers = min(len(candidates), 2 * len(on_devices) if on_devices else usable_cpus())
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="statekit-compare") as pool:
            for rel, entry in candidates.items():
                self._compared[rel] = (files[rel], pool.submit(
                    fmt.compare_file, files[rel], None, entry.size_bytes, entry.checksum, entry.prefixes or (), entry.digest
                ))
            try:
                yield frozenset(candidates)
            finally:
                for _, future in self._compared.values():
                    future.cancel()
                self._compared.clear()

    def _same_as_committed(
        self, rel: str, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None, committed: FileEntry
    ) -> bool:
        """Whether ``rel`` would be written byte for byte as ``committed``: the comparison
        started by :meth:`comparing_ahead`, or one made now. A device digest computed on
        the way is kept for the write of a changed file."""
        ahead = self._compared.pop(rel, None)
        if ahead is not None and ahead[0] is tensors and not metadata:
            same, digest = ahead[1].result()
        else:  # (a file of a full save has no prefixes: compared whole, by its checksum)
            same, digest = fmt.compare_file(
                tensors, metadata, committed.size_bytes, committed.checksum, committed.prefixes or (), committed.digest
            )
        if digest is not None and not same:
            self._digests[rel] = digest
        return same

    def _reuse_if_unchanged(
        self, rel: str, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None
    ) -> dict[str, Any] | None:
        """Incremental save: reuse the base checkpoint's file ``rel`` when every byte this
        save would write is the same (:func:`statekit.format.tensors.compare_file`);
        returns its entry, or None to write the file."""
        base = self.reuse_base
        writer = self.plugin or CORE
        committed = base.entry_for(rel, writer) if base is not None else None
        if committed is None or not self._same_as_committed(rel, tensors, metadata, committed):
            return None
        return self._reuse(rel, base, committed, writer)

    def _reuse(self, rel: str, base: ReuseBase, committed: FileEntry, writer: str) -> dict[str, Any] | None:
        """Take ``base``'s file ``rel`` (known to hold the bytes this save would write) into
        this checkpoint and record it; None when the base lost the file (write it instead)."""
        entry = dict(
            size_bytes=committed.size_bytes, checksum=committed.checksum, writer=writer,
            prefixes=[list(p) for p in committed.prefixes or ()], reused_from=base.name, digest=committed.digest,
        )
        if self._staging is not None:  # the save's files are written later, in order: so is this one
            self._deferred.append(lambda: (self.storage.reuse(rel, base.storage), self._record(rel, **entry)))
            return {"rank": self.rank, "writer": writer, "staged": True}
        try:
            how = self.storage.reuse(rel, base.storage)
        except FileNotFoundError:  # the base lost the file meanwhile (a gc): write it
            logger.info("%s/%s: %s/%s is gone, writing the file", self.url, rel, base.storage.url, rel)
            return None
        logger.debug("%s/%s: unchanged since %s (%s)", self.url, rel, base.name, how)
        return self._record(rel, **entry)

    def _defer_bytes(self, rel: str, data: bytes) -> None:
        writer = self.plugin

        def write() -> None:
            self.storage.write_bytes(rel, data)
            self._record(rel, len(data), fmt.checksum_bytes(data), writer)

        self._deferred.append(write)

    def save_json(self, rel: str, obj: Any) -> dict[str, Any]:
        """Write a JSON file (strict JSON: no NaN; use :meth:`save_state` for rich values),
        indented up to :data:`READABLE_JSON_BYTES`, compact beyond.

        Args:
            rel: path relative to the checkpoint (``"mine/config.json"``).
            obj: a JSON-serialisable value.

        Returns:
            The manifest entry.

        Raises:
            StatekitError: ``obj`` is not strict JSON, or the path is not a valid
                relative path.
        """
        self._check_writable(rel)
        try:
            text = json.dumps(obj, allow_nan=False, separators=(",", ":"))
            if len(text) <= READABLE_JSON_BYTES:
                text = json.dumps(obj, indent=1, allow_nan=False)
            data = text.encode("utf-8")
        except (TypeError, ValueError) as exc:
            raise StatekitError(f"{self.url}/{rel}: value is not strict JSON: {exc}") from exc
        if self._staging is not None:
            self._defer_bytes(rel, data)
            return {"rank": self.rank, "writer": self.plugin or CORE, "staged": True}
        self.storage.write_bytes(rel, data)
        return self._record(rel, len(data), fmt.checksum_bytes(data))

    def save_state(self, base: str, state: Any) -> list[str]:
        """Store any codec-able state (see :mod:`statekit.format.codec`): ``<base>.json`` holds the
        skeleton, ``<base>.safetensors`` the tensors (only if there are any).

        Args:
            base: relative path without extension (``"mine/state"``).
            state: nested state (dicts, lists, tuples, scalars, tensors, NumPy arrays).

        Returns:
            The relative paths written.

        Raises:
            UnsupportedValueError: a value cannot be stored with its exact type without pickle
                (names its key path, ``<base>/config/mode``, and its type), before any file is written.
        """
        skeleton, tensors = codec.encode(state, root=base)
        written = []
        if tensors:
            self.save_tensors(f"{base}.safetensors", tensors)
            written.append(f"{base}.safetensors")
        doc = {"format": fmt.FORMAT, "codec": codec.VERSION, "tensors": bool(tensors), "state": skeleton}
        self.save_json(f"{base}.json", doc)
        written.append(f"{base}.json")
        return written

    # ---------------------------------------------------------------- reading

    @contextlib.contextmanager
    def reading_each_file_once(self) -> Iterator[None]:
        """Within the block, each file of the checkpoint is opened once and its header parsed
        once, however many steps of the load look at it.

        A tensor file whose header is read (a fit check: ``load_state(shapes_only=True)``,
        :meth:`tensor_header`) stays open, positioned at its data section, with its parsed
        header and (with ``verify``) the checksum of the bytes read so far, until
        :meth:`load_tensors` reads its data from that same open file; a state file's JSON
        skeleton read for a fit check is kept until ``load_state`` of the same base. No
        tensor data is kept. The block's end closes every file still open, also when the
        load fails half-way (a file whose data was never read).

        Yields:
            None.

        Raises:
            StorageError: closing a file failed (the others are closed first; raised only
                when the block itself did not raise).
        """
        if self._held is not None:
            yield
            return
        self._held, self._kept_json = {}, {}
        failed = True
        try:
            yield
            failed = False
        finally:
            held, self._held, self._kept_json = self._held, None, None
            errors = []
            for rel, opened in held.items():
                try:
                    with storage_errors(f"{self.url}/{rel}", "closing"):
                        opened.file.close()
                except Exception as exc:  # noqa: BLE001 - close the others first
                    errors.append(exc)
            if errors and not failed:  # (after a failure, that failure is what the caller sees)
                raise errors[0]

    @contextlib.contextmanager
    def fresh_memory_ahead(self, rels: list[str]) -> Iterator[None]:
        """Within the block, the large local tensor files among ``rels`` (read later in
        the block into fresh memory, in this order) get their buffers made and faulted
        in ahead, on a helper thread (:class:`statekit.engine.read_ahead.FreshAhead`).

        The buffers are made from the files' headers (:meth:`tensor_header`: inside
        :meth:`reading_each_file_once` the headers the fit checks parsed, or the file
        opened here and kept open for its read). A file that cannot be opened or parsed
        gets no buffers: its own read reports the fault.

        Args:
            rels: relative paths of the tensor files read later in the block, in order
                (files under 16 MiB and remote ones are skipped).

        Yields:
            None.
        """
        rels = [rel for rel in rels if self.storage.is_local and worth_reading_ahead(self.manifest, rel)]
        if not rels or self._ahead is not None:
            yield
            return
        headers = {}
        for rel in rels:
            with contextlib.suppress(StatekitError):  # CorruptCheckpointError, StorageError: reported by its read
                headers[rel] = self.tensor_header(rel)
        self._ahead = FreshAhead(headers)
        try:
            yield
        finally:
            self._ahead.close()
            self._ahead = None

    @contextlib.contextmanager
    def _reading(self, rel: str) -> Iterator[Any]:
        fmt.check_relpath(rel, source=self.url)
        expected = self._expected(rel)
        f = self._open_read(rel)
        try:
            yield f if expected is None else VerifyingReader(f, f"{self.url}/{rel}", expected)
        finally:
            f.close()

    def _open_read(self, rel: str, bulk: bool = False) -> BinaryIO:
        """``Storage.open_read`` (which chooses the I/O method); a missing file is a
        :class:`CorruptCheckpointError` naming it."""
        try:
            return self.storage.open_read(rel, bulk=bulk)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{self.url}/{rel}: file is missing", path=f"{self.url}/{rel}") from None

    def _open_tensor_file(self, rel: str) -> _OpenTensorFile:
        """Open a tensor file (``bulk``: the storage layer picks ``O_DIRECT`` locally) and
        parse its header, hashed when verifying; the file is left at its data section.

        Raises:
            CorruptCheckpointError: missing file or malformed header (names the file);
                the file is closed.
            StorageError: the storage failed (names the URL).
        """
        fmt.check_relpath(rel, source=self.url)
        expected = self._expected(rel)
        url = f"{self.url}/{rel}"
        f = self._open_read(rel, bulk=True)
        try:
            with storage_errors(url, "reading"):
                size = expected.size_bytes if expected is not None else self.storage.size(rel)
                hasher = fmt.new_hasher() if expected is not None else None
                header = fmt.read_header(f, url, size, hasher)
        except BaseException:
            f.close()
            raise
        return _OpenTensorFile(f, header, hasher, size, expected)

    def tensor_header(self, rel: str) -> fmt.TensorHeader:
        """The parsed header of a tensor file of the checkpoint (no tensor data is read).

        Inside :meth:`reading_each_file_once` the file stays open for the read of its data
        and the header is parsed once; outside it the file is closed again.

        Args:
            rel: relative path of a safetensors file.

        Returns:
            The header: entries (names, dtypes, shapes, offsets), aliases, metadata.

        Raises:
            CorruptCheckpointError: missing file or malformed header (names the file).
            StorageError: the storage failed (names the URL).
        """
        if self._held is not None and rel in self._held:
            return self._held[rel].header
        opened = self._open_tensor_file(rel)
        if self._held is not None:
            self._held[rel] = opened
        else:
            opened.file.close()
        return opened.header

    def _expected(self, rel: str) -> FileEntry | None:
        if not self.verify or self.manifest is None:
            return None
        entry = self.manifest.files.get(rel)
        if entry is None:
            raise CorruptCheckpointError(
                f"{self.url}/{rel}: file is not listed in the manifest", path=f"{self.url}/{rel}"
            )
        return entry

    def _check(self, rel: str, expected: FileEntry | None, size_bytes: int, hasher: Any) -> None:
        if expected is not None:
            check_against(f"{self.url}/{rel}", expected, size_bytes, hasher)

    def read_bytes(self, rel: str) -> bytes:
        """Read a whole file, verified against the manifest when ``verify`` is on.

        Args:
            rel: path relative to the checkpoint.

        Returns:
            The file's bytes.

        Raises:
            CorruptCheckpointError: missing, or size/checksum mismatch (names the file).
        """
        fmt.check_relpath(rel, source=self.url)
        expected = self._expected(rel)
        with self._open_read(rel) as f, storage_errors(f"{self.url}/{rel}", "reading"):
            data = f.read()
        if expected is not None:
            hasher = fmt.new_hasher()
            hasher.update(data)
            self._check(rel, expected, len(data), hasher)
        return data

    def load_tensors(
        self,
        rel: str,
        into: Mapping[str, torch.Tensor] | None = None,
        names: list[str] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Read a safetensors file of the checkpoint (verified when ``verify`` is on).

        Inside :meth:`reading_each_file_once`, a file whose header was read already is read
        on from where its header ended, through the same open file.

        Args:
            rel: relative path.
            into: tensors to fill in place (see :func:`statekit.format.read_tensors`).
            names: read only these names (ignored while verifying, which reads every byte).

        Returns:
            ``name -> tensor`` (CPU tensors, or the ``into`` targets).

        Raises:
            CorruptCheckpointError: missing file, malformed header, truncated data, size or
                checksum mismatch (names the file). With ``into``, targets read before the
                fault hold new values; the message says the load is incomplete.
        """
        opened = self._held.pop(rel, None) if self._held is not None else None
        if opened is None:
            opened = self._open_tensor_file(rel)
        url = f"{self.url}/{rel}"
        f, expected = opened.file, opened.expected
        try:
            with storage_errors(url, "reading"):
                fresh, ready = (self._ahead.take(rel), self._ahead.ready) if self._ahead is not None else (None, None)
                tensors, header = fmt.read_tensors(
                    f, url, opened.size, into=into, names=names, hasher=opened.hasher, fresh=fresh, ready=ready,
                    header=opened.header,
                )
                seen = header.data_start + header.data_bytes  # the bytes the header accounts for
                if expected is not None and seen == expected.size_bytes:
                    seen = f.seek(0, 2)  # bytes appended after them are never read: the open file's size says
        finally:
            f.close()
        if expected is not None:
            self._check(rel, expected, seen, opened.hasher)
        return tensors

    def load_json(self, rel: str) -> Any:
        """Read a JSON file (verified when ``verify`` is on).

        Args:
            rel: path relative to the checkpoint.

        Returns:
            The decoded JSON value.

        Raises:
            CorruptCheckpointError: missing, mismatched or not JSON (names the file).
        """
        return self._decode_json(rel, self.read_bytes(rel))

    def _decode_json(self, rel: str, data: bytes) -> Any:
        try:
            return json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CorruptCheckpointError(f"{self.url}/{rel}: not valid JSON: {exc}", path=f"{self.url}/{rel}") from None

    def load_state(self, base: str, shapes_only: bool = False) -> Any:
        """Read what :meth:`save_state` wrote under ``base``.

        Args:
            base: the ``base`` given to :meth:`save_state`.
            shapes_only: tensors come back as meta tensors of the saved shapes and dtypes,
                made from the tensor file's header: no tensor data is read (a load checks
                that a state fits before it reads it, :mod:`statekit.engine.optimizer_fit`).
                A value that needs its data to be rebuilt (a NumPy array) raises
                ``TypeError`` or ``RuntimeError``. Inside :meth:`reading_each_file_once`
                the skeleton's bytes and the tensor file (open, header parsed) are kept
                for the full read.

        Returns:
            The state, with the same types as saved.

        Raises:
            CorruptCheckpointError: a file is missing, malformed or fails verification.
            StateMismatchError: a saved Enum or namedtuple class is not imported in this
                process (loading never imports code), or lacks the saved value.
            FormatVersionError: the file's codec version is newer than this statekit reads.
        """
        rel = f"{base}.json"
        data = self._kept_json.pop(rel, None) if self._kept_json is not None else None
        if data is None:
            data = self.read_bytes(rel)
        if shapes_only and self._kept_json is not None:
            self._kept_json[rel] = data  # the skeleton (no tensor data), for the full read
        doc = self._decode_json(rel, data)
        if not isinstance(doc, dict) or "state" not in doc:
            raise CorruptCheckpointError(f"{self.url}/{rel}: not a statekit state file", path=f"{self.url}/{rel}")
        if not doc.get("tensors"):
            tensors = {}
        elif shapes_only:
            tensors = self._meta_tensors(f"{base}.safetensors")
        else:
            tensors = self.load_tensors(f"{base}.safetensors")
        return codec.decode(doc["state"], tensors, source=f"{self.url}/{rel}", root=base, version=doc.get("codec", 1))

    def _meta_tensors(self, rel: str) -> dict[str, torch.Tensor]:
        """``name -> meta tensor`` of a tensor file's header (aliases included); reads the header only.

        Raises:
            CorruptCheckpointError: missing file or malformed header (names the file).
        """
        header = self.tensor_header(rel)
        tensors = {e.name: torch.empty(e.shape, dtype=e.dtype, device="meta") for e in header.entries}
        tensors.update({alias: tensors[name] for alias, name in header.aliases.items()})
        return tensors


@dataclass
class _OpenTensorFile:
    """A tensor file opened for one load: positioned at its data section, header parsed.

    Attributes:
        file: the open file (from ``Storage.open_read(rel, bulk=True)``).
        header: its parsed header.
        hasher: the checksum of the bytes read so far (the header), when verifying; else None.
        size: the file's size in bytes (the manifest's when verifying).
        expected: its manifest entry when verifying, else None.
    """

    file: Any
    header: fmt.TensorHeader
    hasher: Any
    size: int
    expected: FileEntry | None
