"""Storage: where bytes go and come from (the layer just above the leaves): ``Storage`` and the
commit (:mod:`~statekit.storage.fs`), ``O_DIRECT`` writer and reader, huge-page buffers, the
streaming interface, prefaulting, checksums (:mod:`~statekit.storage.hashing`), in-use markers.
What a file contains is :mod:`statekit.format`'s; which files a checkpoint has, :mod:`statekit.engine`'s.
Call sequences: docs/design-notes.md, "Call sequences through each package" (storage)."""

from statekit.storage.direct_write import DirectWriter
from statekit.storage.fs import Storage, fsync_path, storage_errors, url_to_fs

__all__ = ["DirectWriter", "Storage", "fsync_path", "storage_errors", "url_to_fs"]
