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

from import_helpers import _env, run_python, statekit_modules

HEAVY = ["accelerate", "diffusers", "s3fs", "transformers", "moto", "boto3", "botocore", "aiobotocore"]


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
