"""Fresh memory for a load's later tensor files (the optimizer state of a resume), made and
faulted in on a helper thread while the model files are read: the first touch of fresh
memory costs about half the time of reading it (docs/design-notes.md, "Reading tensor
files"). A buffer that does not fit what the read finds is not used.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from statekit import format as fmt
from statekit.storage.prefault import PREFAULT_MIN_BYTES, Prefaulter


class FreshAhead:
    """Buffers for the tensor files of ``headers`` (``rel -> parsed header``, in the order
    the load reads them), made on a daemon thread that never raises (a file whose buffers
    cannot be made gets none); :meth:`take` hands a file's buffers to its read."""

    def __init__(self, headers: dict[str, fmt.TensorHeader]) -> None:
        self._headers = dict(headers)
        self._ready = {rel: threading.Event() for rel in self._headers}
        self._buffers: dict[str, dict[str, torch.Tensor]] = {}
        self._prefaulter: Prefaulter | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._thread: threading.Thread | None = None
        if self._headers:
            self._thread = threading.Thread(target=self._run, name="statekit-fresh-ahead", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        made: list[torch.Tensor] = []
        try:
            for rel, header in self._headers.items():
                try:
                    if not self._closed:
                        buffers = fmt.fresh_buffers(header, list(header.entries))
                        self._buffers[rel] = buffers
                        made += buffers.values()
                except Exception:  # noqa: BLE001 - out of memory: the load's own read allocates
                    pass
            with self._lock:
                if not self._closed:
                    self._prefaulter = Prefaulter(made)
        finally:
            # buffers are handed out only once the prefaulter that writes into them exists,
            # so every read of them goes through its ready() hand-off
            for ready in self._ready.values():
                ready.set()
        if self._prefaulter is not None:
            self._prefaulter.run()

    def take(self, rel: str) -> dict[str, torch.Tensor] | None:
        """The buffers made for ``rel``, handed out once (waits until every file's are
        allocated, not faulted in), or None; pass each to :meth:`ready` before writing into it."""
        ready = self._ready.get(rel)
        if ready is None:
            return None
        ready.wait()
        return self._buffers.pop(rel, None)

    def ready(self, buffer: torch.Tensor) -> None:
        """Call before reading into a buffer from :meth:`take`: waits until the helper
        will not write into it again (:meth:`statekit.storage.prefault.Prefaulter.ready`)."""
        if self._prefaulter is not None:
            self._prefaulter.ready(buffer)

    def close(self) -> None:
        """Stop faulting in, join the thread, and drop buffers nobody took. Idempotent."""
        with self._lock:
            self._closed = True
            if self._prefaulter is not None:
                self._prefaulter.stop()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._buffers.clear()


def worth_reading_ahead(manifest: Manifest | None, rel: str) -> bool:
    """Whether ``rel`` is a tensor file large enough (:data:`PREFAULT_MIN_BYTES`, by the
    manifest's size) for fresh memory made ahead to pay."""
    if manifest is None or not rel.endswith(".safetensors"):
        return False
    entry = manifest.files.get(rel)
    return entry is not None and entry.size_bytes >= PREFAULT_MIN_BYTES
