"""Storage: where bytes go and come from (the layer just above the leaves).

Modules:

- :mod:`~statekit.storage.fs`: fsspec URLs and ``Storage`` (one directory): fsync'd I/O,
  errors as ``StorageError``, the commit protocol, the I/O method in both directions.
- :mod:`~statekit.storage.direct_write`: ``DirectWriter``, O_DIRECT local writes.
- :mod:`~statekit.storage.direct`: ``DirectReader``, O_DIRECT local reads.
- :mod:`~statekit.storage.hugepages`: aligned, huge-page-backed I/O buffers.
- :mod:`~statekit.storage.streams`: the file-like interface the format streams tensor bytes through.
- :mod:`~statekit.storage.prefault`: faulting in fresh load buffers ahead of the reads.
- :mod:`~statekit.storage.hashing`: the one checksum (XXH3-64), hashing writer, verifying reader.
- :mod:`~statekit.storage.inuse`: in-use markers of checkpoints a live process reads.

Not here: what a file contains (:mod:`statekit.format`), which files a checkpoint has
(:mod:`statekit.engine`).

Call sequences: docs/design-notes.md, "Call sequences through each package" (storage).
"""

from statekit.storage.direct_write import DirectWriter
from statekit.storage.fs import Storage, fsync_path, storage_errors, url_to_fs

__all__ = ["DirectWriter", "Storage", "fsync_path", "storage_errors", "url_to_fs"]
