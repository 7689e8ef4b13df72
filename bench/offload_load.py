"""Benchmark: load a model larger than the memory budget with statekit-offload vs Accelerate.

What it does (each step in a fresh Python process, so each peak RSS is its own):

1. **build**: the weights of a stack of ``Linear(8192, 8192)`` layers (256 MiB of fp32
   weights each; ``--size-gib 4`` gives 16 layers) are generated one layer at a time and
   written with Accelerate's own ``offload_weight`` (an Accelerate offload folder); no
   process ever holds more than one layer.
2. **save**: the model is built on the meta device (``accelerate.init_empty_weights``),
   dispatched with every layer on disk (``dispatch_model(..., offload_dir=...)``), and
   ``statekit.save`` writes it tensor by tensor through statekit-offload (save from an
   offloaded model); its peak RSS above the baseline is printed.
3. **reference**: the output of the fully loaded model for a fixed input: ``statekit.load``
   into a meta model with no device map (every tensor on the CPU, the whole model in
   memory) when there is memory for it (``--reference full``), else layer by layer
   (``--reference layers``: each layer's weights read alone, the same ``nn.Linear``
   forward, hence the same bits).
4. **statekit**: ``statekit.load(url, {"model": m}, max_memory={"cpu": "1GiB"},
   offload_folder=...)`` into a meta model, then one forward pass.
5. **accelerate**: ``accelerate.load_checkpoint_and_dispatch(m, "<ckpt>/model.safetensors",
   device_map="auto", max_memory={"cpu": "1GiB"}, offload_folder=...)``, then one forward.

Peak RSS is ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` (the high-water mark of the
resident set, file-backed mapped pages included). The baseline is the same value
measured in the same process just before loading: interpreter, torch, statekit,
accelerate and the meta model. The target for step 3: peak - baseline < 1.5 GiB, and
the output ``torch.equal`` to the reference (step 5's output is compared too). Everything written goes under one
temporary directory, removed at the end (``--keep`` keeps it).

Usage::

    python bench/offload_load.py                 # 4 GiB model
    python bench/offload_load.py --size-gib 1    # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

HIDDEN = 8192
"""Width of every layer: a weight is HIDDEN x HIDDEN fp32 = 256 MiB."""

GIB = 1024**3
MIB = 1024**2
BUDGET = "1GiB"
"""The CPU memory budget given to both loaders (``max_memory={"cpu": BUDGET}``)."""

TARGET_BYTES = int(1.5 * GIB)
"""Peak RSS above the baseline that statekit's load must stay under."""


def _rss_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _rss_now_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _mem_available_bytes() -> int:
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _layers(size_gib: float) -> int:
    return max(1, round(size_gib * GIB / (HIDDEN * HIDDEN * 4)))


def _meta_model(n: int):
    import torch
    from accelerate import init_empty_weights

    with init_empty_weights():
        return torch.nn.Sequential(*[torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(n)])


def _input():
    import torch

    return torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(123))


def _emit(result: dict) -> None:
    print("RESULT " + json.dumps(result), flush=True)


def _save_output(path: str, y) -> None:
    from safetensors.torch import save_file

    save_file({"y": y.contiguous()}, path)


# --------------------------------------------------------------------------- steps (child processes)


def step_build(args: argparse.Namespace) -> None:
    import torch
    from accelerate.utils import offload_weight, save_offload_index

    n = _layers(args.size_gib)
    build_dir = os.path.join(args.work, "build-offload")
    os.makedirs(build_dir, exist_ok=True)
    index: dict = {}
    gen = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    for i in range(n):  # one layer in memory at a time, written with Accelerate's own offload_weight
        weight = torch.randn(HIDDEN, HIDDEN, generator=gen) / HIDDEN**0.5
        bias = torch.randn(HIDDEN, generator=gen) * 0.01
        offload_weight(weight, f"{i}.weight", build_dir, index=index)
        offload_weight(bias, f"{i}.bias", build_dir, index=index)
        del weight, bias
    save_offload_index(index, build_dir)
    _emit({"step": "build", "layers": n, "generate_s": time.perf_counter() - t0, "peak_bytes": _rss_peak_bytes()})


def step_save(args: argparse.Namespace) -> None:
    from accelerate import dispatch_model

    import statekit
    import statekit_offload  # noqa: F401

    n = _layers(args.size_gib)
    build_dir = os.path.join(args.work, "build-offload")
    model = _meta_model(n)
    dispatch_model(model, device_map={str(i): "disk" for i in range(n)}, offload_dir=build_dir)
    baseline = _rss_peak_bytes()
    t0 = time.perf_counter()
    statekit.save(args.url, {"model": model})  # statekit-offload streams each tensor from its .dat file
    t1 = time.perf_counter()
    size = os.path.getsize(os.path.join(args.url, "model.safetensors"))
    _emit({"step": "save", "file_bytes": size, "save_s": t1 - t0, "baseline_bytes": baseline,
           "peak_bytes": _rss_peak_bytes()})


def step_reference(args: argparse.Namespace) -> None:
    import torch

    import statekit
    from statekit import format as fmt

    n = _layers(args.size_gib)
    x = _input()
    baseline = _rss_peak_bytes()
    t0 = time.perf_counter()
    if args.reference == "full":
        model = _meta_model(n)
        statekit.load(args.url, {"model": model})  # every tensor on the CPU: the fully loaded model
        with torch.no_grad():
            y = model(x)
    else:
        path = os.path.join(args.url, "model.safetensors")
        layer = torch.nn.Linear(HIDDEN, HIDDEN)
        y = x
        with torch.no_grad():
            for i in range(n):
                with open(path, "rb") as f:
                    tensors, _ = fmt.read_tensors(f, path, names=[f"{i}.weight", f"{i}.bias"])
                layer.weight.copy_(tensors[f"{i}.weight"])
                layer.bias.copy_(tensors[f"{i}.bias"])
                del tensors
                y = layer(y)
    _save_output(os.path.join(args.work, "y-reference.safetensors"), y)
    _emit({"step": "reference", "mode": args.reference, "time_s": time.perf_counter() - t0,
           "baseline_bytes": baseline, "peak_bytes": _rss_peak_bytes()})


def step_statekit(args: argparse.Namespace) -> None:
    import accelerate  # noqa: F401  (imported before the baseline: library code, not data)
    import torch

    import statekit
    import statekit_offload

    model = _meta_model(_layers(args.size_gib))
    x = _input()
    baseline, baseline_now = _rss_peak_bytes(), _rss_now_bytes()
    t0 = time.perf_counter()
    statekit.load(args.url, {"model": model}, max_memory={"cpu": BUDGET},
                  offload_folder=os.path.join(args.work, "offload-statekit"))
    t1 = time.perf_counter()
    load_peak = _rss_peak_bytes()
    with torch.no_grad():
        y = model(x)
    t2 = time.perf_counter()
    info = statekit_offload.offload_info(model)
    _save_output(os.path.join(args.work, "y-statekit.safetensors"), y)
    _emit({"step": "statekit", "load_s": t1 - t0, "forward_s": t2 - t1, "baseline_bytes": baseline,
           "baseline_now_bytes": baseline_now, "load_peak_bytes": load_peak, "peak_bytes": _rss_peak_bytes(),
           "device_map": info.device_map, "in_place": len(info.in_place), "copied": len(info.copied)})


def step_accelerate(args: argparse.Namespace) -> None:
    import torch
    from accelerate import load_checkpoint_and_dispatch

    import statekit  # noqa: F401  (same imports as the statekit step, for the same baseline)

    model = _meta_model(_layers(args.size_gib))
    x = _input()
    baseline = _rss_peak_bytes()
    t0 = time.perf_counter()
    load_checkpoint_and_dispatch(model, os.path.join(args.url, "model.safetensors"), device_map="auto",
                                 max_memory={"cpu": BUDGET}, offload_folder=os.path.join(args.work, "offload-accelerate"))
    t1 = time.perf_counter()
    load_peak = _rss_peak_bytes()
    with torch.no_grad():
        y = model(x)
    t2 = time.perf_counter()
    _save_output(os.path.join(args.work, "y-accelerate.safetensors"), y)
    _emit({"step": "accelerate", "load_s": t1 - t0, "forward_s": t2 - t1, "baseline_bytes": baseline,
           "load_peak_bytes": load_peak, "peak_bytes": _rss_peak_bytes(), "device_map": dict(model.hf_device_map)})


STEPS = {"build": step_build, "save": step_save, "reference": step_reference, "statekit": step_statekit, "accelerate": step_accelerate}


# --------------------------------------------------------------------------- driver


def _run_step(name: str, args: argparse.Namespace, extra: list[str]) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--step", name, "--work", args.work, "--url", args.url,
           "--size-gib", str(args.size_gib), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    results = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not results:
        sys.stderr.write(proc.stdout + proc.stderr)
        raise SystemExit(f"step {name!r} failed (exit {proc.returncode})")
    return results[-1]


def _outputs_equal(work: str, name: str) -> bool:
    import torch
    from safetensors.torch import load_file

    ref = load_file(os.path.join(work, "y-reference.safetensors"))["y"]
    got = load_file(os.path.join(work, f"y-{name}.safetensors"))["y"]
    return bool(torch.equal(ref, got))


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-gib", type=float, default=4.0, help="fp32 weight bytes of the model, GiB (default 4)")
    parser.add_argument("--reference", choices=["auto", "full", "layers"], default="auto",
                        help="how the reference output is computed (auto: full if memory allows)")
    parser.add_argument("--dir", default=None, help="parent directory for the work files (default: the temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--skip-accelerate", action="store_true", help="skip the accelerate comparison")
    parser.add_argument("--step", choices=sorted(STEPS), help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.step:
        STEPS[args.step](args)
        return

    n = _layers(args.size_gib)
    model_bytes = n * (HIDDEN * HIDDEN + HIDDEN) * 4
    parent = args.dir or tempfile.gettempdir()
    free = shutil.disk_usage(parent).free
    need = 3.2 * model_bytes  # build files + checkpoint + Accelerate's offload folder
    print(f"model: {n} x Linear({HIDDEN}, {HIDDEN}) = {_gib(model_bytes)} of fp32 weights")
    print(f"disk: {_gib(free)} free under {parent}, about {_gib(need)} needed")
    if free < need:
        raise SystemExit("not enough free disk space")
    reference = args.reference
    if reference == "auto":
        reference = "full" if _mem_available_bytes() > model_bytes + 4 * GIB else "layers"
    args.work = tempfile.mkdtemp(prefix="statekit-offload-bench-", dir=parent)
    args.url = os.path.join(args.work, "ckpt")
    try:
        build = _run_step("build", args, [])
        print(f"build: {build['layers']} layers generated one at a time into an Accelerate offload folder, "
              f"{build['generate_s']:.1f} s, peak RSS {_gib(build['peak_bytes'])}")
        saved = _run_step("save", args, [])
        shutil.rmtree(os.path.join(args.work, "build-offload"))
        print(f"save: statekit.save of the disk-offloaded model, {_gib(saved['file_bytes'])} written in "
              f"{saved['save_s']:.1f} s, baseline {_gib(saved['baseline_bytes'])}, peak RSS {_gib(saved['peak_bytes'])}, "
              f"peak - baseline {_gib(saved['peak_bytes'] - saved['baseline_bytes'])}")
        ref = _run_step("reference", args, ["--reference", reference])
        print(f"reference ({ref['mode']}): {ref['time_s']:.1f} s, peak RSS {_gib(ref['peak_bytes'])}")
        ours = _run_step("statekit", args, [])
        ours_delta = ours["peak_bytes"] - ours["baseline_bytes"]
        ours_equal = _outputs_equal(args.work, "statekit")
        places = sorted(set(map(str, ours["device_map"].values())))
        print(f"statekit-offload: load {ours['load_s']:.1f} s, forward {ours['forward_s']:.1f} s, "
              f"baseline {_gib(ours['baseline_bytes'])}, peak RSS {_gib(ours['peak_bytes'])} "
              f"(load alone {_gib(ours['load_peak_bytes'])}), peak - baseline {_gib(ours_delta)} "
              f"[target < {_gib(TARGET_BYTES)}: {'OK' if ours_delta < TARGET_BYTES else 'MISSED'}], "
              f"devices {places}, {ours['in_place']} tensors read in place, {ours['copied']} copied, "
              f"output equal to reference: {ours_equal}")
        rows = [("statekit-offload", ours)]
        if not args.skip_accelerate:
            acc = _run_step("accelerate", args, [])
            acc_equal = _outputs_equal(args.work, "accelerate")
            print(f"accelerate.load_checkpoint_and_dispatch: load {acc['load_s']:.1f} s, forward {acc['forward_s']:.1f} s, "
                  f"baseline {_gib(acc['baseline_bytes'])}, peak RSS {_gib(acc['peak_bytes'])} "
                  f"(load alone {_gib(acc['load_peak_bytes'])}), peak - baseline "
                  f"{_gib(acc['peak_bytes'] - acc['baseline_bytes'])}, output equal to reference: {acc_equal}")
            rows.append(("accelerate", acc))
        print()
        print(f"{'loader':<18} {'load s':>7} {'fwd s':>6} {'baseline':>10} {'peak RSS':>10} {'peak-base':>10}")
        for name, r in rows:
            print(f"{name:<18} {r['load_s']:>7.1f} {r['forward_s']:>6.1f} {_gib(r['baseline_bytes']):>10} "
                  f"{_gib(r['peak_bytes']):>10} {_gib(r['peak_bytes'] - r['baseline_bytes']):>10}")
        if not ours_equal or ours_delta >= TARGET_BYTES:
            raise SystemExit(1)
    finally:
        if args.keep:
            print(f"kept {args.work}")
        else:
            shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()
