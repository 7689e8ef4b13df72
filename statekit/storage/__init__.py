"""Storage: fsspec URLs and the commit protocol, the O_DIRECT writer, in-use markers."""

from statekit.storage.direct_write import DirectWriter
from statekit.storage.fs import Storage, fsync_path, storage_errors, url_to_fs

__all__ = ["DirectWriter", "Storage", "fsync_path", "storage_errors", "url_to_fs"]
