"""fsspec URLs (``/local/path``, ``file://``, ``memory://``, ``s3://``...), file I/O with fsync,
and the commit of a checkpoint: data files first, then the manifest (local: temporary file,
fsync, ``os.replace`` or ``os.link``, directory fsync; object store: one PUT). Local files are
fsynced; remote ones streamed through fsspec. docs/concepts.md and docs/design-notes.md, "Storage"."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from typing import Any, BinaryIO

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.registry import known_implementations

from statekit.errors import CheckpointExistsError, InvalidOptionError, StatekitError, StorageError
from statekit.storage.direct import DirectReader
from statekit.storage.direct_write import DirectWriter

SAVE_RESERVE_BYTES = 1024 * 1024
"""Added by :meth:`Storage.refuse_if_no_space` for what a save's tensor bytes leave out:
safetensors headers, JSON state files, the manifest, RNG state (a few KiB each)."""


_SCHEME_WITHOUT_SLASHES = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):(?!//|:)")
# "s3:/bucket/run": fsspec resolves it to the local path ./s3:/bucket/run, so a run would
# write its "remote" copies to the local disk. One-letter schemes are left alone (Windows drives).

BUCKET_PROTOCOLS = ("s3", "s3a", "gs", "gcs", "abfs", "az")
"""Object stores whose first path component is a bucket (container) that their fsspec
backend would create on ``makedirs``; :class:`Storage` checks it exists instead."""

S3_CLIENT_DEFAULTS: dict[str, Any] = {
    "connect_timeout": 10,
    "read_timeout": 60,
    "retries": {"max_attempts": 3, "mode": "standard"},
}
"""botocore client settings statekit uses for ``s3://`` unless ``storage_options`` has
``config_kwargs``: botocore's own defaults wait 60 s to connect and retry more, so a dead
endpoint would stall a save for many minutes before the error reaches the training loop."""


def url_to_fs(url: str, storage_options: dict[str, Any] | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """Resolve a URL (any fsspec URL or local path) to ``(filesystem, path)`` with
    ``fsspec.core.url_to_fs``; ``s3://`` without ``config_kwargs`` gets :data:`S3_CLIENT_DEFAULTS`.

    Raises:
        StorageError: unknown scheme, the backend package is missing (named), or a scheme with one
            slash (``s3:/bucket``), which fsspec would take for a local directory ``s3:``.
    """
    if not isinstance(url, (str, os.PathLike)):
        raise StorageError(f"checkpoint location must be a URL or path string, got {type(url).__name__}", url=str(url))
    url = os.fspath(url)
    typo = _SCHEME_WITHOUT_SLASHES.match(url)
    if typo and typo.group(1).lower() in known_implementations and typo.group(1).lower() != "file":
        fixed = f"{typo.group(1)}://{url[typo.end():].lstrip('/')}"
        raise StorageError(f"{url}: a {typo.group(1)!r} URL needs '://' (did you mean {fixed!r}?); "
                           "as written it would be a local directory", url=url)
    options = dict(storage_options or {})
    if url.startswith(("s3://", "s3a://")):
        options.setdefault("config_kwargs", S3_CLIENT_DEFAULTS)
    try:
        return fsspec.core.url_to_fs(url, **options)
    except ImportError as exc:
        raise StorageError(f"{url}: the storage backend is not installed: {exc}", url=url) from exc
    except ValueError as exc:
        raise StorageError(f"{url}: unsupported URL: {exc}", url=url) from exc


@contextlib.contextmanager
def storage_errors(url: str, action: str) -> Iterator[None]:
    """Re-raise the block's errors as :class:`StorageError` naming ``url``, except
    ``FileNotFoundError`` (callers turn it into the right statekit error) and statekit's own."""
    try:
        yield
    except (StatekitError, FileNotFoundError):
        raise
    except Exception as exc:  # fsspec backends raise OSError, botocore errors, aiohttp errors...
        raise StorageError(f"{action} {url} failed: {type(exc).__name__}: {exc}", url=url) from exc


class Storage:
    """One directory (checkpoint or manager root) on an fsspec filesystem: ``url``, its
    ``storage_options``, or an existing ``fs`` to reuse (``url`` must be on it).

    Raises:
        StorageError: as :func:`url_to_fs`.
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, fs: Any = None) -> None:
        url = os.fspath(url)
        if fs is None:
            fs, path = url_to_fs(url, storage_options)
        else:
            path = fs._strip_protocol(url)
        self.url = url.rstrip("/") or url
        self.fs: fsspec.AbstractFileSystem = fs
        self.path: str = path.rstrip("/") or path
        self.storage_options = storage_options
        self.is_local = isinstance(fs, LocalFileSystem)
        self._made_dirs: set[str] = set()

    @property
    def protocol(self) -> str:
        """The filesystem's first protocol name (``"file"``, ``"memory"``, ``"s3"``)."""
        proto = self.fs.protocol
        return proto[0] if isinstance(proto, (tuple, list)) else proto

    @classmethod
    def of(cls, url: str | os.PathLike[str] | Storage, storage_options: dict[str, Any] | None = None) -> Storage:
        """The :class:`Storage` of a URL with its fsspec options, or ``url`` itself when it is a
        ``Storage`` (which carries its own options, so the two never travel apart).

        Raises:
            InvalidOptionError: a ``Storage`` and ``storage_options`` both given.
            StorageError: as :func:`url_to_fs`.
        """
        if isinstance(url, Storage):
            if storage_options is not None:
                raise InvalidOptionError(
                    f"{url.url}: storage_options given with a Storage, which carries its own; pass one or the other")
            return url
        return cls(url, storage_options)

    # ------------------------------------------------------- capabilities
    # What callers outside storage/ may ask of a location, so that none of them reads
    # is_local or a protocol name to decide how to do I/O.

    def local_path(self, rel: str = "") -> str | None:
        """The OS path of ``rel`` (``""``: the directory) on the local filesystem (for ``mmap``,
        ``os.fsync``, path-taking libraries), else None (object stores, ``memory://``)."""
        return self.path_of(rel) if self.is_local else None

    @property
    def shared_between_processes(self) -> bool:
        """False where each process sees its own copy (``memory://``): a checkpoint that
        several ranks write together cannot live there."""
        return self.protocol != "memory"

    def make_durable(self, rels: list[str]) -> None:
        """Fsync files someone else wrote (``rels``, relative paths), then their directories, before
        a commit names them; locally only (an object store's write is durable when it returns)."""
        if not self.is_local:
            return
        directories = set()
        for rel in rels:
            path = self.path_of(rel)
            fsync_path(path)
            directories.add(os.path.dirname(path))
        for directory in sorted(directories):
            fsync_path(directory)

    def child(self, rel: str) -> Storage:
        """A :class:`Storage` for a subdirectory, sharing this filesystem."""
        return Storage(self.url_of(rel), self.storage_options, fs=self.fs)

    def url_of(self, rel: str) -> str:
        """URL of a relative path inside this directory."""
        return f"{self.url}/{rel}" if rel else self.url

    def path_of(self, rel: str) -> str:
        """Filesystem path of a relative path inside this directory."""
        return f"{self.path}/{rel}" if rel else self.path

    # ---------------------------------------------------------------- queries

    def exists(self, rel: str = "") -> bool:
        """True if the file or directory exists."""
        with storage_errors(self.url_of(rel), "checking"):
            return self.fs.exists(self.path_of(rel))

    def free_bytes(self) -> tuple[int, str] | None:
        """``(bytes, path measured)``: what an unprivileged writer may still use on this local
        directory's file system (``statvfs``, at its nearest existing ancestor); None for remote.
        """
        if not self.is_local or not hasattr(os, "statvfs"):
            return None
        path = os.path.abspath(self.path)
        while not os.path.exists(path) and os.path.dirname(path) != path:
            path = os.path.dirname(path)
        try:
            st = os.statvfs(path)
        except OSError:
            return None
        return st.f_bavail * st.f_frsize, path

    def refuse_if_no_space(self, needed: int, overwrite: bool = False) -> None:
        """Raise before anything is written when ``needed`` bytes do not fit in
        :meth:`free_bytes` (a save failing half-way on a full disk wastes its time and
        leaves a half-written directory). Remote storage is not checked; with ``overwrite``
        the directory's files count as free.

        Args:
            needed: bytes about to be written (tensor bytes; :data:`SAVE_RESERVE_BYTES` is added).
            overwrite: the save replaces this directory.

        Raises:
            StorageError: it does not fit; the message names the URL, the path measured and
                both numbers.
        """
        free = self.free_bytes()
        if free is None:
            return
        available, measured = free
        reclaimable = sum(self.size(rel) for rel in self.find()) if overwrite and self.exists() else 0
        needed += SAVE_RESERVE_BYTES
        if needed > available + reclaimable:
            raise StorageError(
                f"{self.url}: No space left for this save: it needs about {needed:,} bytes "
                f"and {measured} has {available:,} bytes free"
                + (f" (+{reclaimable:,} bytes of the checkpoint it overwrites)" if reclaimable else "")
                + "; nothing was written (free space, or save elsewhere)",
                url=self.url,
            )

    def size(self, rel: str) -> int:
        """Size of a file in bytes.

        Raises:
            FileNotFoundError: no such file.
        """
        with storage_errors(self.url_of(rel), "stat of"):
            return int(self.fs.size(self.path_of(rel)))

    def listdir(self, rel: str = "") -> list[str]:
        """Names (not paths) directly under a directory; empty if it does not exist."""
        path = self.path_of(rel)
        with storage_errors(self.url_of(rel), "listing"):
            try:
                entries = self.fs.ls(path, detail=False, refresh=True) if not self.is_local else os.listdir(path)
            except (FileNotFoundError, NotADirectoryError):
                return []
        return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries} - {""})

    def find(self) -> list[str]:
        """Every file under this directory, as relative paths."""
        with storage_errors(self.url, "listing"):
            try:
                found = self.fs.find(self.path)
            except FileNotFoundError:
                return []
        prefix = self.fs._strip_protocol(self.path).rstrip("/") + "/"
        return sorted(p[len(prefix) :] if p.startswith(prefix) else p.lstrip("/")[len(prefix.lstrip("/")) :] for p in found)

    def invalidate(self) -> None:
        """Drop fsspec's listing cache for this directory (other writers may have changed it)."""
        with contextlib.suppress(Exception):
            self.fs.invalidate_cache(self.path)

    # ---------------------------------------------------------------- reading

    def open_read(self, rel: str, *, bulk: bool = False) -> BinaryIO:
        """Open ``rel`` for binary reading; ``bulk`` (tensor data, read front to back): a local file is
        a :class:`~statekit.storage.direct.DirectReader` where it can be (why: docs/design-notes.md,
        "Reading tensor files").

        Raises:
            FileNotFoundError: no such file.
            StorageError: any other storage failure.
        """
        path = self.path_of(rel)
        with storage_errors(self.url_of(rel), "opening"):
            if self.is_local:
                if bulk:
                    try:
                        return DirectReader(path)
                    except FileNotFoundError:
                        raise
                    except OSError:
                        pass  # opened below through the page cache (or its error raised there)
                return open(path, "rb")  # noqa: SIM115 - caller closes
            return self.fs.open(path, "rb")

    def read_bytes(self, rel: str) -> bytes:
        """Read a whole (small) file (remote: one GET, no HEAD first).

        Raises:
            FileNotFoundError: no such file.
            StorageError: any other storage failure.
        """
        if not self.is_local:
            with storage_errors(self.url_of(rel), "reading"):
                return bytes(self.fs.cat_file(self.path_of(rel)))
        with storage_errors(self.url_of(rel), "reading"), self.open_read(rel) as f:
            return f.read()

    # ---------------------------------------------------------------- writing

    @contextlib.contextmanager
    def open_write(self, rel: str) -> Iterator[BinaryIO]:
        """Open ``rel`` for writing; on success flushed and (locally) fsynced. Local files are written
        with a :class:`DirectWriter` (``O_DIRECT`` where allowed, large aligned writes).

        Raises:
            StorageError: the file cannot be created or written (names its URL).
        """
        path = self.path_of(rel)
        url = self.url_of(rel)
        with storage_errors(url, "writing"):
            self._makedirs(path.rsplit("/", 1)[0])
            if self.is_local:
                with DirectWriter(path) as f:
                    yield f  # type: ignore[misc]
            else:
                with self.fs.open(path, "wb") as f:
                    yield f

    def reuse(self, rel: str, source: Storage) -> str:
        """Make ``rel`` here the same bytes as ``rel`` in ``source`` without sending them again: a hard
        link locally (a copy where refused), ``fs.copy`` on one fsspec filesystem. docs/incremental.md.

        Returns:
            ``"link"``, ``"copy"`` (local, link refused) or ``"server-copy"``.

        Raises:
            FileNotFoundError: ``source`` has no such file: the caller writes it instead.
            StorageError: the link or copy failed otherwise (names both URLs).
        """
        src, dst = source.path_of(rel), self.path_of(rel)
        with storage_errors(self.url_of(rel), f"reusing {source.url_of(rel)} for"):
            self._makedirs(dst.rsplit("/", 1)[0])
            if self.is_local and source.is_local:
                try:
                    os.link(src, dst)
                    return "link"
                except FileNotFoundError:
                    raise
                except OSError:  # EXDEV, EPERM, EMLINK: the bytes are copied instead, still durably
                    shutil.copyfile(src, dst)
                    fsync_path(dst)
                    return "copy"
            if type(self.fs) is not type(source.fs):
                raise StorageError(f"cannot reuse {source.url_of(rel)} for {self.url_of(rel)}: another filesystem", url=self.url_of(rel))
            self.fs.copy(src, dst)  # a missing source raises FileNotFoundError (s3fs, memory: their info() first)
            return "server-copy"

    @property
    def writes_whole_files(self) -> bool:
        """True on object stores (:data:`BUCKET_PROTOCOLS`), where a file appears only once written
        whole (so two writers of the same bytes cannot leave a mix); False on file systems."""
        return self.protocol in BUCKET_PROTOCOLS

    def rename(self, rel: str, to: str) -> None:
        """Publish the finished file ``rel`` under ``to`` in one step, replacing a file of that name:
        ``os.replace`` and a directory fsync locally; ``fs.mv`` elsewhere (object stores: server-side
        copy then delete, so ``to`` appears whole or not at all).

        Raises:
            FileNotFoundError: ``rel`` does not exist.
            StorageError: the rename failed otherwise (names both URLs).
        """
        src, dst = self.path_of(rel), self.path_of(to)
        with storage_errors(self.url_of(to), f"renaming {self.url_of(rel)} to"):
            self._makedirs(dst.rsplit("/", 1)[0])
            if self.is_local:
                os.replace(src, dst)
                fsync_path(os.path.dirname(dst))
            else:
                self.fs.mv(src, dst)

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Write a whole (small) file, durably."""
        with self.open_write(rel) as f:
            f.write(data)

    def _makedirs(self, path: str) -> None:
        if path in self._made_dirs:
            return
        if self.is_local:
            os.makedirs(path, exist_ok=True)
        elif self.protocol in BUCKET_PROTOCOLS:
            self._check_bucket(path)  # object stores have no directories to make
        else:
            self.fs.makedirs(path, exist_ok=True)
        self._made_dirs.add(path)

    def check_bucket(self) -> None:
        """On an object store, refuse a URL whose bucket does not exist (it would list as an empty
        root, and a resume start a fresh run); nothing elsewhere.

        Raises:
            StorageError: the bucket does not exist (names it), or the check itself failed.
        """
        if self.protocol in BUCKET_PROTOCOLS:
            self._check_bucket(self.path)

    def _check_bucket(self, path: str) -> None:
        """Refuse to write into a missing bucket (s3fs's ``makedirs`` would create it); raises ``StorageError``."""
        bucket = path.lstrip("/").split("/", 1)[0]
        with storage_errors(self.url, f"checking bucket {bucket!r} of"):
            found = self.fs.exists(bucket)
        if not found:
            raise StorageError(
                f"{self.url}: bucket {bucket!r} does not exist; statekit never creates buckets "
                f"(create it first, e.g. `aws s3 mb s3://{bucket}`, or fix the name)",
                url=self.url,
            )

    def commit(self, rel: str, data: bytes, exclusive: bool = False) -> None:
        """Write the manifest ``data`` at ``rel`` atomically, after all data files; ``exclusive``:
        fail if it exists (two savers racing for one step).

        Raises:
            CheckpointExistsError: ``exclusive`` and the manifest exists.
            StorageError: the write failed; no manifest is left behind.
        """
        path = self.path_of(rel)
        url = self.url_of(rel)
        with storage_errors(url, "committing"):
            self._makedirs(path.rsplit("/", 1)[0])
            if self.is_local:
                directory = os.path.dirname(path)
                fsync_path(directory)  # the data files' directory entries first
                tmp = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
                try:
                    with open(tmp, "wb") as f:
                        f.write(data)
                        f.flush()
                        os.fsync(f.fileno())
                    if exclusive:
                        try:
                            os.link(tmp, path)
                        except FileExistsError:
                            raise CheckpointExistsError(f"{url} already exists: another save committed it first") from None
                    else:
                        os.replace(tmp, path)
                finally:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(tmp)
                fsync_path(directory)
            elif exclusive:
                if not self.create_exclusive(rel, data):
                    raise CheckpointExistsError(f"{url} already exists: another save committed it first")
            else:
                self.fs.pipe_file(path, data)

    def create_exclusive(self, rel: str, data: bytes) -> bool:
        """Create a small file only if it does not exist (``O_EXCL`` locally; a conditional PUT,
        ``If-None-Match: *``, through fsspec's ``pipe_file(mode="create")``); True if this call created it."""
        path = self.path_of(rel)
        with storage_errors(self.url_of(rel), "creating"):
            self._makedirs(path.rsplit("/", 1)[0])
            if self.is_local:
                # Written under a temporary name, then hard-linked: the link is atomic and
                # exclusive, so no reader ever sees the file created but still empty.
                tmp = f"{path}.{uuid.uuid4().hex}.tmp"
                try:
                    with open(tmp, "wb") as f:
                        f.write(data)
                        f.flush()
                        os.fsync(f.fileno())
                    try:
                        os.link(tmp, path)
                    except (FileExistsError, FileNotFoundError):  # lost the race (or the directory was cleared)
                        return False
                finally:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(tmp)
                return True
            try:
                self.fs.pipe_file(path, data, mode="create")
            except FileExistsError:
                return False
            except Exception as exc:
                if "PreconditionFailed" in repr(exc) or "412" in str(exc):
                    return False
                raise
            return True

    def remove(self, rel: str) -> None:
        """Remove one file if it exists."""
        with storage_errors(self.url_of(rel), "removing"), contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self.path_of(rel))

    def remove_tree(self) -> None:
        """Remove this directory and everything under it (only under its own prefix)."""
        with storage_errors(self.url, "removing"), contextlib.suppress(FileNotFoundError):
            if self.fs.exists(self.path):
                self.fs.rm(self.path, recursive=True)
        self._made_dirs.clear()


def fsync_path(path: str) -> None:
    """fsync a local file (its data) or directory (a rename or create in it) so it is
    durable; a no-op where unsupported or when ``path`` is gone."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
