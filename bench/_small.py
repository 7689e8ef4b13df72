"""Many small tensors: one measurement per process, for ``bench/run.py``.

Usage (run by ``bench/run.py``; one fresh interpreter per measurement, as ``_workers.py``)::

    python bench/_small.py SYSTEM OP DIR        # SYSTEM: statekit | torch, OP: save | load

The state is a model of 2,500 ``nn.Linear(8, 8)`` layers plus its AdamW state after one
step: 5,000 parameters, 10,000 moment tensors and 5,000 ``step`` scalars (about 15,000
tensors holding data, 20,000 in all; 2.2 MiB of fp32). What this measures is the cost per
tensor and per file, not the disk. Saves are durable (``torch.save``'s file is fsynced
inside the timing); loads restore into a fresh model and a fresh AdamW with the files
dropped from the page cache first. Prints one line ``RESULT {json}`` with
``{"seconds", "peak_rss_bytes", "state_bytes", "tensors"}``.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _workers import drop_cache, fsync_tree, one_step, peak_bytes, reset_peak, rss_bytes  # noqa: E402

LAYERS = 2500
WIDTH = 8


def build_small(with_state: bool = True) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """2,500 ``nn.Linear(8, 8)`` layers and AdamW; with ``with_state`` one step is taken."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if with_state:
        one_step(model, optim)
    return model, optim


def count(model: torch.nn.Module, optim: torch.optim.Optimizer) -> tuple[int, int]:
    """``(tensors, bytes)`` of the model's state dict and the optimizer's state."""
    tensors = list(model.state_dict().values())
    tensors += [v for st in optim.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return len(tensors), sum(t.numel() * t.element_size() for t in tensors)


def op_statekit_save(d: str, model, optim) -> None:
    import statekit

    statekit.api.saveload.save(d, {"model": model, "optim": optim})


def op_statekit_load(d: str, model, optim) -> None:
    import statekit

    statekit.api.loading.load(d, {"model": model, "optim": optim})


def op_torch_save(d: str, model, optim) -> None:
    torch.save({"model": model.state_dict(), "optim": optim.state_dict()}, os.path.join(d, "state.pt"))
    fsync_tree(d)


def op_torch_load(d: str, model, optim) -> None:
    sd = torch.load(os.path.join(d, "state.pt"), weights_only=True)
    model.load_state_dict(sd["model"])
    optim.load_state_dict(sd["optim"])


OPS = {
    ("statekit", "save"): op_statekit_save,
    ("statekit", "load"): op_statekit_load,
    ("torch", "save"): op_torch_save,
    ("torch", "load"): op_torch_load,
}


def main(argv: list[str]) -> None:
    """Run one ``(system, op)`` of :data:`OPS` in ``argv = [SYSTEM, OP, DIR]`` and print it.

    Raises:
        SystemExit: unknown system/op pair (the message lists the known ones).
    """
    system, op, d = argv
    if (system, op) not in OPS:
        raise SystemExit(f"_small.py: unknown system/op {system} {op}; known: {sorted(OPS)}")
    torch.set_num_threads(1)
    loading = op == "load"
    model, optim = build_small(with_state=not loading)
    tensors, nbytes = count(*build_small()) if loading else count(model, optim)
    if system == "statekit":
        import statekit

        statekit.hooks.registry.get_plugin_manager()
    if loading:
        drop_cache(d)
    gc.collect()
    reset_peak()
    base = rss_bytes()
    t0 = time.perf_counter()
    OPS[(system, op)](d, model, optim)
    seconds = time.perf_counter() - t0
    peak = max(0, peak_bytes() - base)
    rec = {"seconds": seconds, "peak_rss_bytes": peak, "state_bytes": nbytes, "tensors": tensors}
    print("RESULT " + json.dumps(rec), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
