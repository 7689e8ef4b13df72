"""Storage: where bytes go and come from (the layer just above the leaves).

Owns: fsspec URLs and the :class:`~statekit.storage.fs.Storage` of one directory
(``open_write``, ``open_read``, ``read_bytes``, ``listdir``, ``remove_tree``; errors become
:class:`statekit.errors.StorageError` naming the URL, :func:`~statekit.storage.fs.storage_errors`),
the commit protocol (``Storage.commit``: the manifest written last, atomically, ``exclusive``
for racing savers), the O_DIRECT writer and reader with their aligned, huge-page buffers
(:mod:`~statekit.storage.direct_write`, :mod:`~statekit.storage.direct`,
:mod:`~statekit.storage.hugepages`) and the choice of them in both directions
(``open_write``; ``open_read(rel, bulk=True)``), the file-like interface the format
streams tensor bytes through without knowing any of that
(:mod:`~statekit.storage.streams`: ``bulk_writer``, ``fill``), faulting in fresh load buffers
(:mod:`~statekit.storage.prefault`), the one checksum (XXH3-64) with its hashing writer and
verifying reader (:mod:`~statekit.storage.hashing`), and in-use markers
(:mod:`~statekit.storage.inuse`).

Not here: what a file contains (:mod:`statekit.format`), which files a checkpoint has (the
manifest, built by :mod:`statekit.engine.commit`).

Call sequence of a save: ``Storage(url)`` -> ``open_write(rel)`` (local: a
:class:`~statekit.storage.direct_write.DirectWriter`, fsync on close; remote: the fsspec
file) for each data file -> ``commit(manifest_name, bytes)`` (local: fsync the directory,
write a temporary file, rename or link it, fsync again; remote: one put, or a conditional create when ``exclusive``). Of a load:
``read_bytes`` of the manifest -> per file ``open_read`` (``bulk=True`` for tensor files:
locally a :class:`~statekit.storage.direct.DirectReader`; the storage layer chooses the I/O
method in both directions) -> ``check_against`` of size and checksum.
"""

from statekit.storage.direct_write import DirectWriter
from statekit.storage.fs import Storage, fsync_path, storage_errors, url_to_fs

__all__ = ["DirectWriter", "Storage", "fsync_path", "storage_errors", "url_to_fs"]
