"""fsspec URLs, file I/O with fsync and checksums, and the commit of a checkpoint.

Every location is a URL understood by fsspec (``/local/path``, ``file://``, ``memory://``,
``s3://``...): fsspec is the backend registry (``fsspec.core.url_to_fs``). Local files
are opened with the builtin ``open`` so they can be fsynced; remote files are streamed
through fsspec (s3fs uploads in multipart blocks: no local staging copy).

Commit protocol (DESIGN.md section 5): data files first (fsynced on local disk), then the
manifest: on local disk written to a temporary name, fsynced, moved into place with
``os.replace`` (or ``os.link`` for an exclusive create) and the directory fsynced; on an
object store one single PUT.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import uuid
from collections.abc import Iterator
from typing import Any, BinaryIO

import fsspec
from fsspec.implementations.local import LocalFileSystem

from statekit.errors import CheckpointExistsError, StatekitError, StorageError


S3_CLIENT_DEFAULTS: dict[str, Any] = {
    "connect_timeout": 10,
    "read_timeout": 60,
    "retries": {"max_attempts": 3, "mode": "standard"},
}
"""botocore client settings statekit uses for ``s3://`` unless ``storage_options`` has
``config_kwargs``: botocore's own defaults wait 60 s to connect and retry more, so a dead
endpoint would stall a save for many minutes before the error reaches the training loop."""


def url_to_fs(url: str, storage_options: dict[str, Any] | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """Resolve a URL to ``(filesystem, path)`` with ``fsspec.core.url_to_fs``.

    Args:
        url: any fsspec URL or a plain local path.
        storage_options: keyword arguments for the filesystem (``{"key": ..., "client_kwargs": ...}``);
            for ``s3://`` without ``config_kwargs``, :data:`S3_CLIENT_DEFAULTS` are applied.

    Returns:
        The filesystem and the path within it.

    Raises:
        StorageError: unknown scheme, or the backend package is missing (the message names it).
    """
    if not isinstance(url, (str, os.PathLike)):
        raise StorageError(f"checkpoint location must be a URL or path string, got {type(url).__name__}", url=str(url))
    url = os.fspath(url)
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
    """Re-raise non-statekit errors of the block as :class:`StorageError` naming ``url``.

    ``FileNotFoundError`` passes through unchanged (callers turn it into the right
    statekit error), as do statekit's own errors.
    """
    try:
        yield
    except (StatekitError, FileNotFoundError):
        raise
    except Exception as exc:  # fsspec backends raise OSError, botocore errors, aiohttp errors...
        raise StorageError(f"{action} {url} failed: {type(exc).__name__}: {exc}", url=url) from exc


DIRECT_BUFFER_BYTES = 16 * 1024 * 1024
"""Size of each aligned buffer of a :class:`DirectWriter` (two per writer, pooled)."""

_DIRECT_ALIGN = 4096
_buffer_pool: list[mmap.mmap] = []
_buffer_lock = threading.Lock()


def _take_buffer() -> mmap.mmap:
    with _buffer_lock:
        if _buffer_pool:
            return _buffer_pool.pop()
    return mmap.mmap(-1, DIRECT_BUFFER_BYTES)  # page-aligned, as O_DIRECT needs


def _give_buffer(buf: mmap.mmap) -> None:
    with _buffer_lock:
        if len(_buffer_pool) < 4:
            _buffer_pool.append(buf)
            return
    with contextlib.suppress(BufferError):
        buf.close()


class DirectWriter:
    """A write-only local file that bypasses the page cache (``O_DIRECT``) where allowed.

    Bytes given to :meth:`write` are copied into one of two page-aligned buffers
    (:data:`DIRECT_BUFFER_BYTES` each, reused across files); a full buffer is written by a
    helper thread (``os.write`` releases the GIL) while the caller fills the other, so the
    copy overlaps the I/O. The last, partial block is written padded to 4 KiB and the
    file truncated to its true size. Where the file system refuses ``O_DIRECT`` (tmpfs,
    some network file systems) the same code writes through the page cache. On this VM
    buffered writes of 1 GiB ran at 0.11-0.29 GB/s (dirty-page throttling), ``O_DIRECT``
    at about 1 GB/s (see docs/benchmark.md).

    Args:
        path: the file to create (truncated if it exists).
    """

    def __init__(self, path: str) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        direct = getattr(os, "O_DIRECT", 0)
        self.direct = bool(direct)
        try:
            self._fd = os.open(path, flags | direct, 0o644)
        except OSError:
            if not direct:
                raise
            self.direct = False
            self._fd = os.open(path, flags, 0o644)
        self._bufs = [_take_buffer(), _take_buffer()]
        self._views = [memoryview(b) for b in self._bufs]
        self._view = self._views[0]
        self._fill = 0
        self._size = 0
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._allocated = 0
        self.closed = False

    def fileno(self) -> int:
        """The OS file descriptor."""
        return self._fd

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def tell(self) -> int:
        """Bytes written so far."""
        return self._size

    def write(self, data: Any) -> int:
        """Copy ``data`` (any bytes-like) into the buffers; full buffers go to the disk."""
        view = memoryview(data).cast("B")
        n = len(view)
        pos = 0
        while pos < n:
            take = min(n - pos, DIRECT_BUFFER_BYTES - self._fill)
            self._view[self._fill : self._fill + take] = view[pos : pos + take]
            self._fill += take
            pos += take
            if self._fill == DIRECT_BUFFER_BYTES:
                self._submit(DIRECT_BUFFER_BYTES)
        self._size += n
        return n

    def flush(self) -> None:
        """No-op: data reaches the file in whole buffers and at :meth:`close`."""

    def preallocate(self, size: int) -> None:
        """Reserve ``size`` bytes on disk up front (``posix_fallocate``; best effort) so the
        file gets contiguous extents: ``O_DIRECT`` writes in 16 MiB pieces otherwise leave a
        file fragmented enough to read back 2x slower cold on ext4 (docs/benchmark.md)."""
        if size <= 0 or not hasattr(os, "posix_fallocate"):
            return
        try:
            os.posix_fallocate(self._fd, 0, size)
            self._allocated = size
        except OSError:
            pass

    def _wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _submit(self, length: int) -> None:
        self._wait()
        view = self._view[:length]
        self._thread = threading.Thread(target=self._write_all, args=(view,), daemon=True)
        self._thread.start()
        self._views.reverse()
        self._view = self._views[0]
        self._fill = 0

    def _write_all(self, view: memoryview) -> None:
        try:
            done = 0
            while done < len(view):
                try:
                    done += os.write(self._fd, view[done:])
                except OSError as exc:
                    if not self.direct or exc.errno != 22:  # EINVAL: O_DIRECT refused here
                        raise
                    import fcntl

                    fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~os.O_DIRECT)
                    self.direct = False
        except BaseException as exc:  # noqa: BLE001 - raised on the caller's thread
            self._error = exc

    def close(self) -> None:
        """Write the tail, truncate to the true size, fsync, close. Idempotent."""
        if self.closed:
            return
        self.closed = True
        try:
            tail = self._fill
            if tail:
                padded = -(-tail // _DIRECT_ALIGN) * _DIRECT_ALIGN if self.direct else tail
                if padded != tail:
                    self._view[tail:padded] = bytes(padded - tail)
                self._submit(padded)
                self._wait()
                if padded != tail:
                    os.ftruncate(self._fd, self._size)
            self._wait()
            if self._allocated > self._size:
                os.ftruncate(self._fd, self._size)
            os.fsync(self._fd)
        finally:
            self._release()

    def abort(self) -> None:
        """Close without fsync after a failure (the caller removes or ignores the file)."""
        if self.closed:
            return
        self.closed = True
        self._release()

    def _release(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        os.close(self._fd)
        self._view = None  # type: ignore[assignment]
        for view in self._views:
            view.release()
        for buf in self._bufs:
            _give_buffer(buf)
        self._views, self._bufs = [], []

    def __enter__(self) -> DirectWriter:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if exc_info[0] is None:
            self.close()
        else:
            self.abort()


def fsync_dir(path: str) -> None:
    """fsync a local directory so a rename or create in it is durable (no-op where unsupported)."""
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


class Storage:
    """One directory (checkpoint or manager root) on an fsspec filesystem.

    Args:
        url: the directory's URL.
        storage_options: passed to fsspec.
        fs: an existing filesystem to reuse (then ``url`` must be on it).

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

    def open_read(self, rel: str) -> BinaryIO:
        """Open a file for reading (binary).

        Raises:
            FileNotFoundError: no such file.
            StorageError: any other storage failure.
        """
        path = self.path_of(rel)
        with storage_errors(self.url_of(rel), "opening"):
            if self.is_local:
                return open(path, "rb")  # noqa: SIM115 - caller closes
            return self.fs.open(path, "rb")

    def read_bytes(self, rel: str) -> bytes:
        """Read a whole (small) file."""
        with storage_errors(self.url_of(rel), "reading"), self.open_read(rel) as f:
            return f.read()

    # ---------------------------------------------------------------- writing

    @contextlib.contextmanager
    def open_write(self, rel: str) -> Iterator[BinaryIO]:
        """Open a file for writing; on success it is flushed and (locally) fsynced.

        Local files are written with a :class:`DirectWriter` (``O_DIRECT`` where the
        file system allows it, large aligned writes, fsync on close).

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

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Write a whole (small) file, durably."""
        with self.open_write(rel) as f:
            f.write(data)

    def _makedirs(self, path: str) -> None:
        if path in self._made_dirs:
            return
        if self.is_local:
            os.makedirs(path, exist_ok=True)
        else:
            self.fs.makedirs(path, exist_ok=True)
        self._made_dirs.add(path)

    def commit(self, rel: str, data: bytes, exclusive: bool = False) -> None:
        """Write the commit marker (the manifest) atomically, after all data files.

        Args:
            rel: the manifest's relative path.
            data: its bytes.
            exclusive: fail if it exists already (two savers racing for one step).

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
                fsync_dir(directory)  # the data files' directory entries first
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
                fsync_dir(directory)
            elif exclusive:
                if not self.create_exclusive(rel, data):
                    raise CheckpointExistsError(f"{url} already exists: another save committed it first")
            else:
                self.fs.pipe_file(path, data)

    def create_exclusive(self, rel: str, data: bytes) -> bool:
        """Create a small file only if it does not exist (``O_EXCL`` locally; a conditional
        PUT, ``If-None-Match: *``, on stores that support it through fsspec's
        ``pipe_file(mode="create")``).

        Returns:
            True if this call created it, False if it existed.
        """
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
