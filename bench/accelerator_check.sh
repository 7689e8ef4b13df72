#!/usr/bin/env bash
# The checks of a GPU machine (issue 14, item 4), in one run that fits a short lease:
# installs statekit and the rng/offload/fsdp plugins into that machine's own Python (no
# index: its torch, accelerate, safetensors... are used as they are), runs the CUDA tests
# and the rng/offload/fsdp plugin tests side by side, then the accelerator rows of the
# benchmark alone, then the rest of the benchmark in the time left.
#
#   bash bench/accelerator_check.sh OUTDIR [SECONDS]    # SECONDS: the budget (default 540)
#
# Writes into OUTDIR: env.txt, tests.log, accelerator.log/.json, async_profile.txt, bench.log/.json.
# FSDP_SECONDS: the FSDP tests' time limit (default 200).
# The machine has no package index and no moto (so no S3 rows), and no fio (--skip-fio).
# Where its setuptools is too old for this pyproject, build the wheels here first and
# bring them along in .whl/: `pip wheel --no-deps -w .whl . plugins/statekit-{rng,offload,fsdp}`.
set -uo pipefail
out=${1:?usage: bench/accelerator_check.sh OUTDIR [SECONDS]}
budget=${2:-540}
start=$SECONDS
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
mkdir -p "$out"
left() { echo $((budget - (SECONDS - start))); }

{
    $PY -V; nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv
    $PY -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
    if ls .whl/*.whl >/dev/null 2>&1; then  # wheels built beforehand (no build backend needed there)
        $PY -m pip install -q --no-index --no-deps --force-reinstall .whl/*.whl 2>&1 | tail -5
    else
        $PY -m pip install -q --no-index --no-deps --no-build-isolation -e . -e plugins/statekit-rng \
            -e plugins/statekit-offload -e plugins/statekit-fsdp 2>&1 | tail -5
    fi
    $PY -m pip list 2>/dev/null | grep -iE "^(statekit|accelerate|safetensors|pluggy|fsspec|xxhash|numpy) "
    nproc; free -g | head -2; df -h . | tail -1
} >"$out/env.txt" 2>&1

pytest_in() {  # DIR LOG TIMEOUT ARGS...: one suite from its own directory, as `make test` runs it
    local dir=$1 log=$2 limit=$3; shift 3
    (cd "$dir" && timeout "$limit" $PY -m pytest -q -p no:cacheprovider "$@" >"$log" 2>&1; echo "exit $?" >>"$log")
}
# the FSDP tests start torch.distributed workers (a CUDA torch imports slowly): spread them
# over the machine's cores where pytest-xdist is installed there
spread=(); $PY -c "import xdist" 2>/dev/null && spread=(-n 6)
pytest_in . /tmp/core.log 150 tests/unit/engine/test_cuda.py tests/unit/engine/test_staging.py tests/unit/api/test_async_save.py tests/unit/engine/test_engine.py -rs &
pytest_in plugins/statekit-rng /tmp/rng.log 150 tests -rs &
pytest_in plugins/statekit-offload /tmp/offload.log 150 tests -rs &
pytest_in plugins/statekit-fsdp /tmp/fsdp.log "${FSDP_SECONDS:-200}" tests -rs "${spread[@]}" &
wait
for s in core rng offload fsdp; do echo "=== $s"; tail -120 /tmp/$s.log; done >"$out/tests.log"

timeout 120 $PY bench/run.py --size 1GiB --runs 3 --skip-local --skip-small --skip-training --skip-s3 --skip-scale \
    --json "$out/accelerator.json" >"$out/accelerator.log" 2>&1
echo "exit $? at $((SECONDS - start)) s" >>"$out/accelerator.log"

# where an async save's blocking time goes beyond the device-to-host copy: one profiled save
timeout 60 $PY - "$out/async_profile.txt" >"$out/async_profile.log" 2>&1 <<'PROFILE'
import cProfile, io, os, pstats, shutil, sys, tempfile, time
sys.path.insert(0, "bench")
import torch
from _workers import build
from statekit.api.saveload import save_objects
from statekit.engine.entries import classify
from statekit.engine.staging import StagingPool
model, optim = build(1 << 30, torch.float32, device="cuda")
entries, pool, d = [classify("model", model), classify("optim", optim)], StagingPool(), tempfile.mkdtemp(dir=".")
for i in range(3):  # warm: arenas, kernels, plugin discovery
    save_objects(os.path.join(d, f"w{i}"), entries, blocking=False, staging=pool).wait()
torch.cuda.synchronize()
profile = cProfile.Profile()
t0 = time.perf_counter()
profile.enable()
pending = save_objects(os.path.join(d, "p"), entries, blocking=False, staging=pool)
profile.disable()
block = time.perf_counter() - t0
pending.wait()
shutil.rmtree(d)
text = io.StringIO()
pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(40)
pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
open(sys.argv[1], "w").write(f"async save block {block:.4f} s (profiled)\n" + text.getvalue())
PROFILE

rest=$(( $(left) - 15 ))
if [ "$rest" -gt 60 ]; then
    timeout "$rest" $PY bench/run.py --size 1GiB --runs 3 --skip-s3 --skip-scale --skip-fio --skip-accelerator \
        --json "$out/bench.json" >"$out/bench.log" 2>&1
    echo "exit $? at $((SECONDS - start)) s" >>"$out/bench.log"
fi
echo "done in $((SECONDS - start)) s"
