"""One measurement per process, for ``bench/run.py``.

Usage (run by ``bench/run.py``; one fresh interpreter per measurement so peak RSS is honest)::

    python bench/_workers.py SYSTEM OP DIR SIZE_BYTES DTYPE [S3_ENDPOINT]

Builds the state (a model of large ``nn.Linear`` layers plus AdamW state after one step,
about ``SIZE_BYTES`` in all), resets the kernel's peak-RSS mark
(``/proc/self/clear_refs`` ``5``), takes the baseline RSS, runs one operation and prints
one JSON line ``{"seconds", "peak_rss_bytes", "state_bytes", ...}`` where
``peak_rss_bytes`` is ``ru_maxrss`` after the operation minus the baseline.

Load measurements restore into a freshly built model and a fresh AdamW (no state yet,
as on resume); the files are dropped from the page cache first
(``posix_fadvise(POSIX_FADV_DONTNEED)``), so reads are cold-ish.
"""

from __future__ import annotations

import glob
import json
import mmap
import os
import resource
import sys
import time

import torch

CHUNK = 16 * 1024 * 1024
LAYER_OUT = 2048


def rss_bytes() -> int:
    """Current resident set size of this process, bytes (``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak() -> None:
    """Reset the kernel's peak-RSS mark to the current RSS (Linux ``clear_refs`` 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_bytes() -> int:
    """Peak RSS of this process in bytes since :func:`reset_peak`.

    ``VmHWM`` of ``/proc/self/status`` (the kernel's high-water mark that
    ``getrusage(RUSAGE_SELF).ru_maxrss`` also reports): ``ru_maxrss`` alone cannot be
    reset once a thread has exited (the kernel folds the mark into the signal struct),
    which would charge the state building to the operation. Falls back to ``ru_maxrss``.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def build(size: int, dtype: torch.dtype, with_state: bool = True, device: str = "cpu") -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model of ``nn.Linear(in, 2048)`` layers holding ``size / 3`` bytes of weights, and
    AdamW; with ``with_state`` one optimizer step is taken (exp_avg + exp_avg_sq = 2x).
    ``device``: where the model and so the optimizer state live (``"cuda"``: the accelerator rows)."""
    torch.manual_seed(0)
    itemsize = torch.empty((), dtype=dtype).element_size()
    weight_elems = size // 3 // itemsize
    per_layer = LAYER_OUT * 4096
    layers = []
    left = weight_elems
    while left > 0:
        fan_in = max(1, min(4096, (left - LAYER_OUT) // LAYER_OUT))
        layers.append(torch.nn.Linear(fan_in, LAYER_OUT, dtype=dtype, device=device))
        left -= fan_in * LAYER_OUT + LAYER_OUT
        if left < per_layer // 64:
            break
    model = torch.nn.Sequential(*layers)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if with_state:
        one_step(model, optim)
    return model, optim


def one_step(model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
    """One optimizer step with a constant gradient (1e-3), so AdamW holds its state
    (``exp_avg``, ``exp_avg_sq``, ``step``); the gradients are dropped afterwards."""
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optim.step()
    for p in model.parameters():
        p.grad = None


def state_nbytes(model: torch.nn.Module, optim: torch.optim.Optimizer) -> int:
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    for st in optim.state.values():
        total += sum(v.numel() * v.element_size() for v in st.values() if isinstance(v, torch.Tensor))
    return total


def all_tensors(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v for k, v in model.state_dict().items()}
    for i, st in enumerate(optim.state.values()):
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                out[f"optim.{i}.{k}"] = v
    return out


def drop_cache(path: str) -> None:
    """Drop every file under ``path`` from the page cache (best effort)."""
    files = [path] if os.path.isfile(path) else glob.glob(os.path.join(path, "**"), recursive=True)
    for p in files:
        if os.path.isfile(p):
            try:
                fd = os.open(p, os.O_RDONLY)
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
            except OSError:
                pass


def fsync_tree(path: str) -> None:
    """fsync every file and directory under ``path`` (the durable comparison)."""
    for root, dirs, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def s3_options(endpoint: str) -> dict:
    return {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}


# --------------------------------------------------------------------------- ops


def op_statekit_save(d, model, optim, ctx):
    import statekit

    url = ctx.get("url", d)
    statekit.api.saveload.save(url, {"model": model, "optim": optim}, storage_options=ctx.get("so"))


def op_statekit_load(d, model, optim, ctx):
    import statekit

    statekit.api.loading.load(ctx.get("url", d), {"model": model, "optim": optim}, storage_options=ctx.get("so"))


def op_statekit_async(d, model, optim, ctx):
    """Second async save (staging buffers warm): blocking time, then total until committed."""
    from statekit.api.saveload import save_objects
    from statekit.engine.entries import classify

    entries = [classify("model", model), classify("optim", optim)]
    t0 = time.perf_counter()
    pending = save_objects(os.path.join(d, "second"), entries, blocking=False, staging=ctx["pool"])
    ctx["blocking_seconds"] = time.perf_counter() - t0
    pending.wait()


def op_torch_save(d, model, optim, ctx):
    path = os.path.join(d, "state.pt")
    torch.save({"model": model.state_dict(), "optim": optim.state_dict()}, path)
    fsync_tree(d)


def op_torch_load(d, model, optim, ctx):
    sd = torch.load(os.path.join(d, "state.pt"), weights_only=True)
    model.load_state_dict(sd["model"])
    optim.load_state_dict(sd["optim"])


def op_safetensors_save(d, model, optim, ctx):
    from safetensors.torch import save_file

    tensors = all_tensors(model, optim)
    save_file(tensors, os.path.join(d, "state.safetensors"))
    fsync_tree(d)


def op_safetensors_load(d, model, optim, ctx):
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(d, "state.safetensors"))
    # load_file maps the file lazily (safe_open, backend "mmap": RSS grows by ~1 % of the
    # file on return) and AdamW's load_state_dict keeps same-dtype tensors without a copy:
    # fault in every page (one byte per 4 KiB) so this row reads every byte like the others.
    for t in tensors.values():
        flat = t.reshape(-1).view(torch.uint8)
        if flat.numel():
            flat[::4096].sum()
            flat[-1:].sum()
    model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
    # AdamW state: rebuild the optimizer's state dict from the flat tensors.
    sd = optim.state_dict()
    state = {}
    params = [p for g in sd["param_groups"] for p in g["params"]]
    for i in params:
        state[i] = {"step": torch.tensor(1.0), "exp_avg": tensors[f"optim.{i}.exp_avg"], "exp_avg_sq": tensors[f"optim.{i}.exp_avg_sq"]}
    sd["state"] = state
    optim.load_state_dict(sd)


def _accelerator():
    from accelerate import Accelerator

    return Accelerator(cpu=True)


def op_accelerate_save(d, model, optim, ctx):
    acc = ctx["acc"]
    acc.save_state(d)
    fsync_tree(d)


def op_accelerate_load(d, model, optim, ctx):
    ctx["acc"].load_state(d)


def _dcp_state(model, optim):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd}


def op_dcp_save(d, model, optim, ctx):
    import torch.distributed.checkpoint as dcp

    state = _dcp_state(model, optim)
    if ctx.get("so"):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        writer = FsspecWriter(ctx["url"], **ctx["so"])
    else:
        writer = dcp.FileSystemWriter(d, sync_files=True)
    dcp.save(state, storage_writer=writer)


def op_dcp_load(d, model, optim, ctx):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _dcp_state(model, optim)
    if ctx.get("so"):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        reader = FsspecReader(ctx["url"], **ctx["so"])
    else:
        reader = dcp.FileSystemReader(d)
    dcp.load(state, storage_reader=reader)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])


def op_s3fs_save(d, model, optim, ctx):
    fs = ctx["fs"]
    fs.pipe_file(ctx["path"] + "/state.bin", ctx["blob"])


def op_s3fs_load(d, model, optim, ctx):
    ctx["out"] = ctx["fs"].cat_file(ctx["path"] + "/state.bin")


def _o_direct_write(path: str, total: int, buf: memoryview) -> float:
    """Seconds to write ``total`` bytes from the aligned ``buf`` (reused) with ``O_DIRECT``, then fsync."""
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        done = 0
        while done < total:
            n = min(CHUNK, total - done)
            os.write(fd, buf[: (n + 4095) // 4096 * 4096])
            done += n
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - t0
    os.unlink(path)
    return seconds


def _o_direct_read(path: str, total: int, buf: memoryview, dest: memoryview) -> float:
    """Seconds to read ``total`` bytes cold with ``O_DIRECT`` into the aligned ``buf`` (reused),
    each piece copied on into ``dest``."""
    drop_cache(path)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        done = 0
        while done < total:
            got = os.readv(fd, [buf])
            if not got:
                break
            n = min(got, total - done)
            dest[done : done + n] = buf[:n]
            done += n
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def _io_buffers() -> dict:
    """The aligned 16 MiB buffers the in-process limits use: ordinary 4 KiB pages, and huge
    pages (``IOBuffer``: on a virtio disk O_DIRECT moves 2-3x more per second from them)."""
    from statekit.storage.hugepages import IOBuffer

    small = mmap.mmap(-1, CHUNK, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    small.write(b"\0" * CHUNK)
    huge = IOBuffer(CHUNK)
    huge.view[:] = bytes(CHUNK)
    return {"o_direct": memoryview(small), "o_direct_huge": huge.view}


def op_limit_write(d, model, optim, ctx):
    """Best of a buffered write + fsync of the state's own bytes, and O_DIRECT writes of as
    many bytes from a 4 KiB-page and from a huge-page buffer (``candidates`` keeps each)."""
    total = ctx["state_bytes"]
    cands = {}
    path = os.path.join(d, "buffered.bin")
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for t in ctx["tensors"]:
            mv = memoryview(t.reshape(-1).view(torch.uint8).numpy())
            for s in range(0, len(mv), CHUNK):
                f.write(mv[s : s + CHUNK])
        os.fsync(f.fileno())
    cands["buffered"] = time.perf_counter() - t0
    os.unlink(path)
    try:
        for method, buf in _io_buffers().items():
            cands[method] = _o_direct_write(os.path.join(d, "direct.bin"), total, buf)
    except OSError as exc:
        ctx["note"] = f"O_DIRECT unavailable: {exc}"
    ctx["candidates"] = cands
    ctx["method"] = min(cands, key=cands.get)
    ctx["seconds_override"] = cands[ctx["method"]]


def op_limit_read(d, model, optim, ctx):
    """Read the state bytes back cold (fadvise DONTNEED) into a pre-touched buffer: best of
    buffered ``readinto`` and O_DIRECT through a 4 KiB-page and a huge-page buffer."""
    total = ctx["state_bytes"]
    path = ctx["prepared"]
    mv = memoryview(ctx["dest"].numpy())
    cands = {}
    drop_cache(path)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        done = 0
        while done < total:
            got = f.readinto(mv[done : done + CHUNK])
            if not got:
                break
            done += got
    cands["buffered"] = time.perf_counter() - t0
    try:
        for method, buf in _io_buffers().items():
            cands[method] = _o_direct_read(path, total, buf, mv)
    except OSError as exc:
        ctx["note"] = f"O_DIRECT unavailable: {exc}"
    ctx["candidates"] = cands
    ctx["method"] = min(cands, key=cands.get)
    ctx["seconds_override"] = cands[ctx["method"]]


def op_limit_memcpy(d, model, optim, ctx):
    for src, dst in zip(ctx["tensors"], ctx["dests"]):
        dst.copy_(src)


OPS = {
    ("statekit", "save"): op_statekit_save,
    ("statekit", "load"): op_statekit_load,
    ("statekit", "async"): op_statekit_async,
    ("torch", "save"): op_torch_save,
    ("torch", "load"): op_torch_load,
    ("safetensors", "save"): op_safetensors_save,
    ("safetensors", "load"): op_safetensors_load,
    ("accelerate", "save"): op_accelerate_save,
    ("accelerate", "load"): op_accelerate_load,
    ("dcp", "save"): op_dcp_save,
    ("dcp", "load"): op_dcp_load,
    ("s3fs", "save"): op_s3fs_save,
    ("s3fs", "load"): op_s3fs_load,
    ("limit", "write"): op_limit_write,
    ("limit", "read"): op_limit_read,
    ("limit", "memcpy"): op_limit_memcpy,
}


def main() -> None:
    system, op, d, size, dtype_name = sys.argv[1:6]
    endpoint = sys.argv[6] if len(sys.argv) > 6 else ""
    size = int(size)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    torch.set_num_threads(1)
    loading = op == "load"
    model, optim = build(size, dtype, with_state=not loading)
    ctx: dict = {}
    if endpoint:
        import s3fs

        ctx["so"] = s3_options(endpoint)
        ctx["url"] = f"s3://bench/{system}"
        ctx["path"] = f"bench/{system}"
        if system == "s3fs":
            ctx["fs"] = s3fs.S3FileSystem(**ctx["so"])
    if system == "accelerate":
        acc = _accelerator()
        model, optim = acc.prepare(model, optim)
        ctx["acc"] = acc
    # the bytes the state holds (for load: what it will hold once loaded)
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    n_params = len(list(model.parameters()))
    # AdamW after one step: exp_avg + exp_avg_sq like the weights, plus a 4-byte step per parameter
    state_bytes = state_nbytes(model, optim) if not loading else 3 * model_bytes + 4 * n_params
    ctx["state_bytes"] = state_bytes
    if system == "s3fs" and op == "save":
        ctx["blob"] = b"".join(bytes(memoryview(t.reshape(-1).view(torch.uint8).numpy())) for t in all_tensors(model, optim).values())
    if system == "limit":
        tensors = [t.detach() for t in all_tensors(model, optim).values()]
        ctx["tensors"] = tensors
        if op == "memcpy":
            ctx["dests"] = [torch.empty_like(t).fill_(1) for t in tensors]
        if op == "read":
            path = os.path.join(d, "read.bin")
            with open(path, "wb") as f:
                for t in tensors:
                    f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
                os.fsync(f.fileno())
            ctx["prepared"] = path
            ctx["dest"] = torch.empty(state_bytes, dtype=torch.uint8).fill_(1)
            del tensors, ctx["tensors"]
            model = optim = None
    if system == "statekit" and op == "async":
        from statekit.api.saveload import save_objects
        from statekit.engine.entries import classify
        from statekit.engine.staging import StagingPool

        ctx["pool"] = StagingPool()
        entries = [classify("model", model), classify("optim", optim)]
        save_objects(os.path.join(d, "first"), entries, blocking=False, staging=ctx["pool"]).wait()
    if loading and not endpoint:
        drop_cache(d)
    # one-time imports (and statekit's plugin discovery) happen before the clock starts
    if system.startswith("statekit"):
        import statekit

        statekit.hooks.registry.get_plugin_manager()
    elif system == "dcp":
        import importlib

        for mod in ("torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict",
                    "torch.distributed.checkpoint._fsspec_filesystem"):
            importlib.import_module(mod)
    elif system == "safetensors":
        import importlib

        importlib.import_module("safetensors.torch")
    fn = OPS[(system, op)]
    import gc

    gc.collect()
    reset_peak()
    base = rss_bytes()
    t0 = time.perf_counter()
    fn(d, model, optim, ctx)
    seconds = time.perf_counter() - t0
    peak = max(0, peak_bytes() - base)
    seconds = ctx.get("seconds_override", seconds)
    if system == "limit" and op == "read":
        os.unlink(ctx["prepared"])
    rec = {
        "seconds": seconds,
        "peak_rss_bytes": peak,
        "state_bytes": state_bytes,
        "model_bytes": model_bytes,
    }
    for k in ("method", "note", "blocking_seconds", "candidates"):
        if k in ctx:
            rec[k] = ctx[k]
    print("RESULT " + json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
