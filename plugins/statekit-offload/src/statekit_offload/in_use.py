"""In-use markers (moved into the core as :mod:`statekit.storage.inuse`, which retention, ``gc`` and
``overwrite=True`` respect); re-exported here for the plugin's public API."""

from statekit.storage.inuse import (  # noqa: F401
    MARKER_PREFIX,
    MARKER_WRITER,
    InUseMarker,
    in_use_markers,
    is_in_use,
    local_dir,
    mark_in_use,
    release_in_use,
    remove_stale_markers,
)
from statekit.storage.inuse import _is_live, _pid_alive, _process_start  # noqa: F401
