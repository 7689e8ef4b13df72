#!/usr/bin/env bash
# Real packaging check: build a wheel and an sdist of statekit, of every plugin under
# plugins/ and of examples/plugin-template with `python -m build`, install the wheels into
# a FRESH virtual environment (torch==2.13.0 first: an unpinned torch pulls a multi-GB CUDA
# build; no editable installs), then smoke-test there: `statekit plugins` lists every
# plugin with its version, the sdists hold what the wheels hold, and a save/load round
# trip works.
#
# Usage: .ci/package.sh            (uses .venv/bin/python to build; PY=... to override)
#        KEEP=1 .ci/package.sh     keeps the temporary directory (printed at the end)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PY:-$ROOT/.venv/bin/python}
BASE_PYTHON=${BASE_PYTHON:-python3}
start=$(date +%s)

if ! "$PY" -c "import build" 2>/dev/null; then
    echo "== installing build into $("$PY" -c 'import sys; print(sys.prefix)')"
    "$PY" -m pip install -q build 2>&1 | grep -v "^WARNING: Location" || true
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/statekit-package.XXXXXX")
cleanup() { if [ "${KEEP:-0}" = 1 ]; then echo "kept $WORK"; else rm -rf "$WORK"; fi; }
trap cleanup EXIT
DIST=$WORK/dist
mkdir -p "$DIST"
# run a noisy command with its output in a log, shown only when it fails
quiet() { "$@" >"$WORK/step.log" 2>&1 || { cat "$WORK/step.log"; echo "failed: $*" >&2; return 1; }; }

PROJECTS=(. plugins/*/ examples/plugin-template)
EXPECTED=()      # "plugin-name distribution version" of every plugin
for project in "${PROJECTS[@]}"; do
    project=${project%/}
    echo "== build $project"
    # build the sdist, then the wheel from the sdist (the default): proves the sdist is complete
    quiet "$PY" -m build --outdir "$DIST" "$project"
    rm -rf "$project/build"   # setuptools' scratch directory inside the source tree
done
ls -l "$DIST"

# Every project gave one wheel and one sdist; metadata of each names version, license,
# classifiers and URLs; every wheel ships py.typed.
"$PY" - "$DIST" "${PROJECTS[@]}" <<'EOF'
import sys, tomllib, zipfile, tarfile, pathlib
from email.parser import Parser

dist = pathlib.Path(sys.argv[1])
problems = []
for project in sys.argv[2:]:
    meta = tomllib.loads((pathlib.Path(project) / "pyproject.toml").read_text())["project"]
    name, version = meta["name"], meta["version"]
    norm = name.replace("-", "_")
    wheels = list(dist.glob(f"{norm}-{version}-*.whl"))
    sdists = list(dist.glob(f"{norm}-{version}.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        problems.append(f"{name}: expected one wheel and one sdist of {version}, got {wheels} {sdists}")
        continue
    with zipfile.ZipFile(wheels[0]) as zf:
        names = zf.namelist()
        info = Parser().parsestr(zf.read(f"{norm}-{version}.dist-info/METADATA").decode())
    for field in ("Version", "Summary", "License-Expression", "Requires-Python"):
        if not info.get(field):
            problems.append(f"{name}: wheel metadata lacks {field}")
    if not info.get_all("Classifier"):
        problems.append(f"{name}: no classifiers")
    if not info.get_all("Project-URL"):
        problems.append(f"{name}: no project URLs")
    if not any(n.endswith("/py.typed") for n in names):
        problems.append(f"{name}: wheel has no py.typed")
    if name == "statekit" and "statekit/manifest.schema.json" not in names:
        problems.append("statekit: wheel lacks statekit/manifest.schema.json")
    with tarfile.open(sdists[0]) as tf:
        members = tf.getnames()
    if not any(m.endswith("/pyproject.toml") for m in members) or not any(m.endswith("/README.md") for m in members):
        problems.append(f"{name}: sdist lacks pyproject.toml or README.md")
    print(f"  {name} {version}: wheel {len(names)} files, sdist {len(members)} members")
if problems:
    sys.exit("packaging problems:\n  " + "\n  ".join(problems))
EOF

echo "== fresh virtual environment in $WORK/venv"
"$BASE_PYTHON" -m venv "$WORK/venv"
VPY=$WORK/venv/bin/python
quiet "$VPY" -m pip install -q --upgrade pip
quiet "$VPY" -m pip install -q torch==2.13.0          # first: the pinned CPU build
quiet "$VPY" -m pip install -q "$DIST"/*.whl           # the wheels only; dependencies from the index
quiet "$VPY" -m pip check

echo "== smoke test (outside the source tree)"
cd "$WORK"
unset PYTHONPATH
"$WORK/venv/bin/statekit" --version
"$WORK/venv/bin/statekit" plugins
"$WORK/venv/bin/statekit" plugins --json >"$WORK/plugins.json"
"$VPY" - "$WORK/plugins.json" "$ROOT" "${PROJECTS[@]}" <<'EOF'
import json, sys, tomllib, pathlib

listed = {p["name"]: p for p in json.load(open(sys.argv[1]))}
root = pathlib.Path(sys.argv[2])
missing = []
for project in sys.argv[3:]:
    meta = tomllib.loads((root / project / "pyproject.toml").read_text())["project"]
    for ep_name in meta.get("entry-points", {}).get("statekit", {}):
        got = listed.get(ep_name)
        if got is None or got.get("distribution") != meta["name"] or got.get("version") != meta["version"]:
            missing.append(f"{ep_name} ({meta['name']} {meta['version']}): listed as {got}")
if missing:
    sys.exit("statekit plugins does not list:\n  " + "\n  ".join(missing))
print(f"statekit plugins lists all {len(listed)} plugins with their versions")
EOF

"$VPY" - <<'EOF'
import json, pathlib, tempfile
from importlib import resources

import torch
import statekit

assert "site-packages" in statekit.__file__, f"statekit imported from {statekit.__file__}, not the installed wheel"
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
model(torch.randn(3, 4)).sum().backward()
optimizer.step()
url = str(pathlib.Path(tempfile.mkdtemp(dir=".")).resolve() / "ckpt")
manifest = statekit.save(url, {"model": model, "optim": optimizer, "epoch": {"n": 3}}, step=7)
assert (pathlib.Path(url) / "statekit.json").is_file()

fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
epoch = {}
statekit.load(url, {"model": fresh, "optim": fresh_optimizer, "epoch": epoch})
for (k, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items()):
    assert torch.equal(a, b), k
for a, b in zip(optimizer.state_dict()["state"].values(), fresh_optimizer.state_dict()["state"].values()):
    assert all(torch.equal(a[k], b[k]) for k in a), "optimizer state differs"
assert epoch == {"n": 3}, epoch
statekit.verify(url)
schema = json.loads(resources.files("statekit").joinpath("manifest.schema.json").read_text())
assert schema["properties"]["format"]["enum"] == ["statekit/1", "statekit/2", "statekit/3"], schema["properties"]["format"]
plugins = json.loads((pathlib.Path(url) / "statekit.json").read_text())["plugins"]
print(f"round trip ok: {url} (plugins in manifest: {plugins})")
EOF

echo "== packaging passed in $(( $(date +%s) - start )) s"
