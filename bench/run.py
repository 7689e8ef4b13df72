"""Checkpoint benchmark: statekit against Accelerate, torch.save, safetensors and DCP.

Usage::

    bash bench/setup.sh        # once: installs fio (run.py also calls it when fio is missing)
    python bench/run.py --size 256MiB|1GiB|3GiB [--dtype fp32|bf16] [--runs 3]
                        [--json out.json] [--skip-s3] [--skip-scale] [--s3-runs N]
                        [--skip-small] [--skip-training] [--skip-accelerator] [--skip-fio]

The state is a model of large ``nn.Linear`` layers plus its AdamW state after one step,
about ``--size`` bytes in all (weights one third, exp_avg and exp_avg_sq the rest). Every
measurement runs in a fresh interpreter (``bench/_workers.py``): peak RSS is
``ru_maxrss`` after the operation minus the RSS right before it. Saves are durable on
every side (statekit fsyncs itself; Accelerate's, torch.save's, safetensors' outputs are
fsynced after the call; DCP uses ``sync_files=True``). Loads restore into a fresh model
and optimizer with the files dropped from the page cache first.

The limits come from the same run: a sequential write of the same bytes with fsync (best
of buffered and ``O_DIRECT`` in-process, and fio with ``direct=1``, 16 MiB blocks, 8
requests in flight, ``bench/_fio.py``), a cold read back (the same methods), and one
memcpy of the state; the ``method`` field says which one gave each limit. The small-tensor
rows (storage ``small``, ``bench/_small.py``) save and load 2,500 ``nn.Linear(8, 8)`` +
AdamW with statekit and torch. The accelerator rows (storage ``accelerator``, only where
torch sees an accelerator: ``bench/_accelerator.py``) stage, save and load the same state living on
it, against one plain pinned device-to-host copy of the same bytes and torch. The training rows (storage ``training``) come from
``bench/async_training.py`` when it is present. S3 runs against a moto server started here on 127.0.0.1 at a
fixed 256 MiB. Scale runs statekit under ``torchrun`` (gloo) with 1, 2 and 4 ranks
writing one checkpoint of the same total size.

``--json FILE`` writes ``{"records": [...], "targets": [...]}``: one record per
measurement ``{"system", "op", "storage", "state_bytes", "seconds", "peak_rss_bytes",
"run"}`` and the targets of issue 14 (``bench/_targets.py``), each met or missed with its
ratio as min-median-max over runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _fio  # noqa: E402
from _units import parse_size  # noqa: E402
from _targets import compute_targets, format_targets  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "_workers.py")
SMALL = os.path.join(HERE, "_small.py")
SCALE = os.path.join(HERE, "_scale.py")
ACCELERATOR = os.path.join(HERE, "_accelerator.py")
S3_SIZE = 256 * 1024**2

LOCAL_PLAN = [
    # (system, op) in order; a load follows its save (it reads the files the save wrote)
    ("limit", "write"),
    ("limit", "read"),
    ("limit", "memcpy"),
    ("statekit", "save"),
    ("statekit", "load"),
    ("statekit", "async"),
    ("accelerate", "save"),
    ("accelerate", "load"),
    ("torch", "save"),
    ("torch", "load"),
    ("safetensors", "save"),
    ("safetensors", "load"),
    ("dcp", "save"),
    ("dcp", "load"),
]
SMALL_PLAN = [("statekit", "save"), ("statekit", "load"), ("torch", "save"), ("torch", "load")]
S3_PLAN = [("s3fs", "save"), ("s3fs", "load"), ("statekit", "save"), ("statekit", "load"), ("dcp", "save"), ("dcp", "load")]


def run_worker(system: str, op: str, directory: str, size: int, dtype: str, endpoint: str = "", cmd: list | None = None) -> dict:
    cmd = cmd or [sys.executable, WORKER, system, op, directory, str(size), dtype] + ([endpoint] if endpoint else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{system} {op} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def records_for(system: str, op: str, storage: str, res: dict, run: int) -> list[dict]:
    base = {"system": system, "storage": storage, "state_bytes": res["state_bytes"], "peak_rss_bytes": res["peak_rss_bytes"], "run": run}
    if op == "async":
        return [
            {**base, "op": "async_block", "seconds": res["blocking_seconds"]},
            {**base, "op": "async_total", "seconds": res["seconds"]},
        ]
    rec = {**base, "op": op, "seconds": res["seconds"]}
    if "method" in res:
        rec["method"] = res["method"]
    return [rec]


def limit_records(op: str, inproc: dict, fio: dict | None, run: int) -> list[dict]:
    """The run's disk limit for ``op`` (write/read): the fastest of the in-process
    measurement (``inproc``, a worker result) and fio's (``fio``: a side of
    :func:`_fio.measure_limits`, or None), with both candidates kept as rows
    ``limit-inproc`` and ``limit-fio``; ``method`` says which gave the limit."""
    base = {"op": op, "storage": "local", "state_bytes": inproc["state_bytes"], "run": run}
    cands = dict(inproc.get("candidates") or {inproc.get("method", "inproc"): inproc["seconds"]})
    out = [{**base, "system": "limit-inproc", "seconds": inproc["seconds"], "peak_rss_bytes": inproc["peak_rss_bytes"],
            "method": inproc.get("method", "inproc"), "candidates": dict(cands)}]
    if fio:
        cands.update(fio["candidates"])
        out.append({**base, "system": "limit-fio", "seconds": fio["seconds"], "peak_rss_bytes": 0, "method": fio["method"],
                    "candidates": fio["candidates"]})
    method, seconds = _fio.best_of(cands)
    out.insert(0, {**base, "system": "limit", "seconds": seconds, "peak_rss_bytes": 0, "method": method, "candidates": cands})
    return out


def bench_local(size: int, dtype: str, runs: int, workdir: str, log, fio: str | None = None) -> list[dict]:
    out = []
    for run in range(runs):
        fio_limits: dict = {}
        for system, op in LOCAL_PLAN:
            d = os.path.join(workdir, f"{system}-{run}")
            if op in ("save", "write", "memcpy", "async") or system == "limit":
                shutil.rmtree(d, ignore_errors=True)
                os.makedirs(d)
            res = run_worker(system, op, d, size, dtype)
            if system == "limit" and op in ("write", "read"):
                if fio and op == "write":
                    fio_limits = _fio.measure_limits(fio, d, res["state_bytes"])
                    for note in fio_limits["notes"]:
                        log(f"  fio: {note}")
                recs = limit_records(op, res, fio_limits.get(op), run)
            else:
                recs = records_for(system, op, "local", res, run)
            out += recs
            for r in recs:
                method = f"  ({r['method']})" if "method" in r else ""
                log(f"  run {run} {r['system']:12s} {r['op']:12s} {r['seconds']:8.3f} s  peak +{r['peak_rss_bytes'] / 2**20:8.1f} MiB{method}")
            if op == "load" or (system == "statekit" and op == "async"):
                shutil.rmtree(d, ignore_errors=True)
    return out


def bench_small(runs: int, workdir: str, log) -> list[dict]:
    """statekit and torch save/load of 2,500 ``Linear(8, 8)`` + AdamW (``bench/_small.py``),
    one fresh process each; storage ``small``."""
    out = []
    for run in range(runs):
        for system, op in SMALL_PLAN:
            d = os.path.join(workdir, f"small-{system}-{run}")
            if op == "save":
                shutil.rmtree(d, ignore_errors=True)
                os.makedirs(d)
            res = run_worker(system, op, d, 0, "", cmd=[sys.executable, SMALL, system, op, d])
            rec = {**records_for(system, op, "small", res, run)[0], "tensors": res["tensors"]}
            out.append(rec)
            log(f"  run {run} small {system:10s} {op:6s} {rec['seconds']:8.3f} s  ({res['tensors']} tensors)")
            if op == "load":
                shutil.rmtree(d, ignore_errors=True)
    return out


def bench_accelerator(size: int, dtype: str, runs: int, workdir: str, log) -> list[dict]:
    """Staging, async, sync saves and loads of a state on the accelerator against a plain
    pinned device-to-host copy and torch (``bench/_accelerator.py``, one process); storage
    ``accelerator``. Nothing when this process sees no accelerator."""
    from statekit.devices import current_accelerator_type

    if current_accelerator_type() is None:
        log(" accelerator: none in this process; skipped")
        return []
    d = os.path.join(workdir, "accelerator")
    proc = subprocess.run([sys.executable, ACCELERATOR, d, str(size), dtype, str(runs)], capture_output=True, text=True, cwd=REPO)
    out = [{**json.loads(line[7:]), "storage": "accelerator", "peak_rss_bytes": None}
           for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0:
        raise RuntimeError(f"accelerator rows failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    for r in out:
        log(f"  run {r['run']} {r['device']} {r['system']:12s} {r['op']:12s} {r['seconds']:8.4f} s  {r['state_bytes'] / r['seconds'] / 1e9:7.2f} GB/s")
    shutil.rmtree(d, ignore_errors=True)
    return out


def bench_training(size: int, runs: int, workdir: str, log) -> list[dict]:
    """``bench/async_training.py``'s ``measure`` (training during a background save), when
    that module is present; its records are relabelled storage ``training``."""
    try:
        import async_training
    except ImportError as exc:
        log(f" training: bench/async_training.py not available ({exc}); skipped")
        return []
    recs = async_training.measure(size, runs, workdir)
    for r in recs:
        r["storage"] = "training"
    for line in async_training.summarize(recs) if hasattr(async_training, "summarize") else []:
        log(f"  {line}")
    return recs


def bench_s3(dtype: str, runs: int, workdir: str, log) -> list[dict]:
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    out = []
    try:
        import s3fs

        sys.path.insert(0, HERE)
        from _workers import s3_options

        import boto3

        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="bench")
        fs = s3fs.S3FileSystem(**s3_options(endpoint))
        for run in range(runs):
            for system, op in S3_PLAN:
                res = run_worker(system, op, workdir, S3_SIZE, dtype, endpoint)
                recs = records_for(system, op, "s3", res, run)
                out += recs
                for r in recs:
                    log(f"  run {run} s3 {system:10s} {r['op']:8s} {r['seconds']:8.3f} s  peak +{r['peak_rss_bytes'] / 2**20:8.1f} MiB")
                if op == "load":  # moto keeps every object in memory: delete between runs
                    fs.invalidate_cache()
                    if fs.exists(f"bench/{system}"):
                        fs.rm(f"bench/{system}", recursive=True)
    finally:
        server.stop()
    return out


def bench_scale(size: int, dtype: str, runs: int, workdir: str, log) -> list[dict]:
    out = []
    for n in (1, 2, 4):
        for run in range(runs):
            d = os.path.join(workdir, f"scale-{n}-{run}")
            res_file = os.path.join(workdir, f"scale-{n}-{run}.json")
            cmd = [
                sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
                SCALE, d, str(size), dtype, res_file,
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
            if proc.returncode != 0:
                raise RuntimeError(f"scale {n} failed:\n{proc.stderr[-3000:]}")
            with open(res_file) as f:
                res = json.load(f)
            shutil.rmtree(d, ignore_errors=True)
            out.append(
                {"system": f"statekit-{n}rank", "op": "save", "storage": "local", "state_bytes": res["state_bytes"],
                 "seconds": res["seconds"], "peak_rss_bytes": res["peak_rss_bytes"], "run": run, "ranks": n,
                 "per_rank_bytes": res["per_rank_bytes"]}
            )
            log(f"  run {run} scale {n} ranks {res['seconds']:8.3f} s")
    return out


# --------------------------------------------------------------------------- report


def summarize(records: list[dict]) -> dict[tuple[str, str, str], dict]:
    groups: dict[tuple[str, str, str], list[dict]] = {}
    for r in records:
        if r.get("seconds") is not None:
            groups.setdefault((r.get("storage", "local"), r["system"], r["op"]), []).append(r)
    out = {}
    for key, rs in groups.items():
        secs = [r["seconds"] for r in rs]
        peaks = [r["peak_rss_bytes"] for r in rs if r.get("peak_rss_bytes") is not None]  # training rows have none
        med = statistics.median(secs)
        out[key] = {
            "seconds": med,
            "min": min(secs),
            "max": max(secs),
            "gbps": rs[0]["state_bytes"] / med / 1e9 if med > 0 else float("inf"),
            "peak": statistics.median(peaks) if peaks else None,
            "state_bytes": rs[0]["state_bytes"],
            "n": len(rs),
            "ranks": rs[0].get("ranks"),
            "methods": sorted({r["method"] for r in rs if "method" in r}),
        }
    return out


def table(records: list[dict]) -> str:
    s = summarize(records)
    lines = []
    hdr = f"{'storage':7s} {'system':16s} {'op':12s} {'median s':>9s} {'min-max s':>15s} {'GB/s':>7s} {'peak+MiB':>9s} {'x limit':>8s} {'x Accel':>8s}"
    lines += [hdr, "-" * len(hdr)]
    limit = {"save": s.get(("local", "limit", "write")), "load": s.get(("local", "limit", "read"))}
    accel = {"save": s.get(("local", "accelerate", "save")), "load": s.get(("local", "accelerate", "load"))}
    s3raw = {"save": s.get(("s3", "s3fs", "save")), "load": s.get(("s3", "s3fs", "load"))}
    for (storage, system, op), v in sorted(s.items(), key=lambda kv: (kv[0][0] != "local", kv[0][1] != "limit", kv[0][1], kv[0][2])):
        kind = "save" if op in ("save", "async_total", "write") else "load" if op in ("load", "read") else None
        ref = (s3raw if storage == "s3" else limit).get(kind) if kind else None
        xl = f"{v['seconds'] / ref['seconds']:.2f}" if ref and storage in ("local", "s3") else ""
        if xl and storage == "local" and not system.startswith("limit") and v["seconds"] < ref["seconds"]:
            xl = "!" + xl  # beats the disk limit: the limit is wrong
        acc = accel.get(kind) if storage == "local" and kind else None
        xa = f"{acc['seconds'] / v['seconds']:.2f}" if acc else ""
        lines.append(
            f"{storage:7s} {system:16s} {op:12s} {v['seconds']:9.3f} {v['min']:7.3f}-{v['max']:<7.3f} {v['gbps']:7.2f} "
            f"{'' if v['peak'] is None else format(v['peak'] / 2**20, '.1f'):>9s} {xl:>8s} {xa:>8s}" + (f"  {'/'.join(v['methods'])}" if system.startswith("limit") and v["methods"] else "")
        )
    lines.append("")
    lines.append("x limit: time / limit time (local: disk write/read limit; s3: raw s3fs pipe/cat); x Accel: Accelerate time / this time")
    lines.append("limit = best of limit-inproc (buffered / o_direct) and limit-fio per run, method(s) listed; "
                 "'!' = faster than the limit (median): the limit is wrong")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="1GiB", help="total state bytes: 256MiB, 1GiB, 3GiB...")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--runs", type=int, default=3, help="fresh-process measurements per system and op (local and small-tensor rows; "
                    "default 3: keeps --size 1GiB with every section under 20 min on 2 vCPUs)")
    ap.add_argument("--s3-runs", type=int, default=1, help="runs for S3 and scale (default 1: keeps --size 1GiB under 20 min on 2 vCPUs)")
    ap.add_argument("--training-runs", type=int, default=3,
                    help="runs of bench/async_training.py (each: every system once; odd, so the verdict's median is one run's)")
    ap.add_argument("--json", default=None, help='write {"records": [...], "targets": [...]} to this file')
    ap.add_argument("--skip-small", action="store_true", help="no 2,500 x Linear(8, 8) rows")
    ap.add_argument("--skip-training", action="store_true", help="no training-during-async-save rows")
    ap.add_argument("--skip-accelerator", action="store_true", help="no accelerator rows (there are none without a GPU)")
    ap.add_argument("--skip-fio", action="store_true", help="limits from the in-process methods only (not for published numbers)")
    ap.add_argument("--skip-s3", action="store_true")
    ap.add_argument("--skip-scale", action="store_true")
    ap.add_argument("--skip-local", action="store_true")
    ap.add_argument("--workdir", default=None, help="directory for checkpoint files (default: a temp dir on the disk of this repo)")
    args = ap.parse_args(argv)
    size = parse_size(args.size)
    extra_runs = args.s3_runs
    root = args.workdir or os.path.join(os.path.dirname(REPO), "tmp-bench")
    os.makedirs(root, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="statekit-bench-", dir=root)
    started = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - started:7.1f}s]{msg}", flush=True)

    fio = None
    if not args.skip_fio and not args.skip_local:
        try:
            fio = _fio.ensure_fio()
        except RuntimeError as exc:
            log(f" WARNING: no fio, the limits are the in-process methods only: {exc}")
    records: list[dict] = []
    try:
        if not args.skip_local:
            log(f" local disk, {args.size} {args.dtype}, {args.runs} runs, in {workdir}, limits with {fio or 'no fio'}")
            records += bench_local(size, args.dtype, args.runs, workdir, log, fio)
        if not args.skip_small:
            log(f" small tensors: 2,500 x Linear(8, 8) + AdamW, {args.runs} runs")
            records += bench_small(args.runs, workdir, log)
        if not args.skip_accelerator:
            log(f" accelerator: {args.size} {args.dtype} on the accelerator, {args.runs} runs")
            records += bench_accelerator(size, args.dtype, args.runs, workdir, log)
        if not args.skip_training:
            log(f" training during an async save, {args.size}, {args.training_runs} runs")
            records += bench_training(size, args.training_runs, workdir, log)
        if not args.skip_s3:
            log(f" S3 (moto), 256MiB {args.dtype}, {extra_runs} runs")
            records += bench_s3(args.dtype, extra_runs, workdir, log)
        if not args.skip_scale:
            log(f" scale: torchrun 1/2/4 ranks, {args.size} total, {extra_runs} runs")
            records += bench_scale(size, args.dtype, extra_runs, workdir, log)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        targets = compute_targets(records)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"records": records, "targets": targets}, f, indent=1)
    print()
    print(table(records))
    print()
    print(format_targets(targets))
    scale = [r for r in records if r["system"].startswith("statekit-") and r["system"].endswith("rank")]
    if scale:
        s = summarize(scale)
        print()
        print("scale (one checkpoint of the same total size):")
        for (_, system, _), v in sorted(s.items(), key=lambda kv: kv[1]["ranks"]):
            n = v["ranks"]
            total = v["state_bytes"] / v["seconds"] / 1e9
            print(f"  {n} rank(s): {v['seconds']:.3f} s, total {total:.2f} GB/s, per rank {total / n:.2f} GB/s")
    print(f"\nwall time {time.time() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
