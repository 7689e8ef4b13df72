"""Every statekit module imports on its own (after torch), without a warning: one process,
one fork per module (the cheap-import checks are in ``unit/test_import.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from import_helpers import _env, run_python, statekit_modules


FORK_IMPORTER = textwrap.dedent(
    """
    import importlib, os, sys, traceback
    import torch  # loaded once, shared by every child; statekit modules are not
    failed = []
    for name in sys.argv[1:]:
        pid = os.fork()
        if pid == 0:
            try:
                importlib.import_module(name)
            except BaseException:
                traceback.print_exc()
                os._exit(1)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        if status != 0:
            failed.append(name)
    print("failed:", " ".join(failed))
    sys.exit(1 if failed else 0)
    """
)


def test_every_module_imports_alone_without_warnings():
    modules = statekit_modules()
    assert {"statekit.format.codec", "statekit.api.saveload", "statekit.testing"} <= set(modules)
    if hasattr(os, "fork"):
        # one process, one fork per module: each child imports only that module (after torch)
        proc = subprocess.run(
            [sys.executable, "-W", "error", "-c", FORK_IMPORTER, *modules],
            capture_output=True,
            text=True,
            env=_env(),
            timeout=180,
            check=False,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr[-6000:]
    else:  # pragma: no cover - platforms without fork
        for name in modules:
            proc = run_python(f"import {name}", "-W", "error")
            assert proc.returncode == 0, f"{name}:\n{proc.stderr[-4000:]}"
