"""Importing statekit is cheap: no heavy optional packages, no plugin manager, no warnings.

The time it takes beyond ``import torch`` is measured by ``bench/import_time.py``, not
asserted here: a timed assertion fails on a loaded machine without a defect."""

from __future__ import annotations

import json
import os
import pkgutil
import subprocess
import sys
import textwrap

import statekit

HEAVY = ["accelerate", "diffusers", "s3fs", "transformers", "moto", "boto3", "botocore", "aiobotocore"]


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


def test_no_heavy_imports():
    code = (
        "import statekit, statekit.testing, statekit.hooks.registry, sys, json\n"
        "assert statekit.hooks.registry._manager is None, 'a plugin manager was built at import time'\n"
        "print(json.dumps(sorted(sys.modules)))"
    )
    proc = run_python(code, "-X", "importtime")
    assert proc.returncode == 0, proc.stderr[-4000:]
    modules = set(json.loads(proc.stdout.splitlines()[-1]))
    loaded = sorted(m for m in modules if m.split(".")[0] in HEAVY)
    assert not loaded, f"import statekit pulled in {loaded}"
    assert "statekit.testing" in modules
    # the import-time report, for the log: statekit's own slowest modules
    rows = []
    for line in proc.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            _, cumulative, name = (part.strip() for part in line.removeprefix("import time:").split("|"))
            if name.startswith("statekit") and cumulative.isdigit():
                rows.append((int(cumulative), name))
    print("slowest statekit modules (cumulative us):", sorted(rows, reverse=True)[:6])


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
