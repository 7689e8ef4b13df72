"""Background writes of async saves (:class:`PendingSave`, a non-daemon thread), and what
happens to them at interpreter exit (docs/design-notes.md, "Async saves").
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import traceback
import weakref
from typing import Any, Callable

from statekit.errors import AsyncSaveError
from statekit.format.manifest_types import Manifest

_pending: weakref.WeakSet[PendingSave] = weakref.WeakSet()


class PendingSave:
    """An async save in flight: ``finish()`` writes and commits on the thread; ``wait()``
    returns the committed manifest, after running ``post(manifest)`` (the post-hooks) once."""

    def __init__(self, url: str, finish: Callable[[], Manifest], post: Callable[[Manifest], None]) -> None:
        self.url = url
        self._finish = finish
        self._post = post
        self._manifest: Manifest | None = None
        self._error: BaseException | None = None
        self._collected = False
        self._thread = threading.Thread(target=self._run, name=f"statekit-save {url}", daemon=False)
        _pending.add(self)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._manifest = self._finish()
        except BaseException as exc:  # noqa: BLE001 - reported by wait() or at exit
            self._error = exc

    def done(self) -> bool:
        """True once the background write finished (committed or failed)."""
        return not self._thread.is_alive()

    def join(self, timeout: float | None = None) -> bool:
        """Wait at most ``timeout`` seconds (None: until it ends) for the background write,
        without collecting it (no error raised, no post-hooks); True when it has ended."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def wait(self) -> Manifest:
        """Join the write; run the post-hooks once; return the manifest.

        Raises:
            AsyncSaveError: the write failed; ``__cause__`` is the original exception.
            PluginError: a post-hook, or a ``statekit_checkpoint_committed`` hook of the
                manager's after-commit work, failed (the checkpoint is committed).
            StatekitError: the manager's after-commit work (``latest``, retention) failed;
                the message says the checkpoint is committed, ``__cause__`` is the error.
        """
        self._thread.join()
        first = not self._collected
        self._collected = True
        if self._error is not None:
            raise AsyncSaveError(
                f"background save to {self.url} failed: {type(self._error).__name__}: {self._error}", self.url
            ) from self._error
        if first:
            self._post(self._manifest)  # type: ignore[arg-type]
        return self._manifest  # type: ignore[return-value]


@atexit.register
def wait_all_at_exit() -> None:
    """At exit, wait for every background save not yet collected; a failed one is printed
    to stderr and the interpreter exits with status 1 (raising can no longer change it)."""
    for pending in list(_pending):
        if pending._collected:
            continue
        try:
            pending.wait()
        except BaseException:  # noqa: BLE001 - nobody else can report it now
            print(f"statekit: the background save to {pending.url} failed:", file=sys.stderr)
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
