"""Fresh Python processes for the import tests (``unit/test_import.py``,
``integration/processes/test_module_imports.py``): the environment without statekit's
settings, a ``python -c`` runner, and the list of statekit's modules."""

from __future__ import annotations

import os
import pkgutil
import subprocess
import sys

import statekit


def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STATEKIT_", "PYTHONWARNINGS"))}
    env.pop("PYTHONPATH", None)
    return env


def run_python(code, *flags, timeout=180):
    return subprocess.run(
        [sys.executable, *flags, "-c", code], capture_output=True, text=True, env=_env(), timeout=timeout, check=False
    )


def statekit_modules():
    names = ["statekit"]
    names += [m.name for m in pkgutil.walk_packages(statekit.__path__, "statekit.") if not m.name.endswith("__main__")]
    return names
