"""torchrun worker for the statekit-fsdp tests (also importable for in-process helpers).

Run as ``python -m torch.distributed.run --nproc_per_node=N worker.py COMMAND ...`` with
the gloo backend on CPU. Commands:

* ``save``: build a model (seed 0), train 3 steps, ``statekit.save`` model + optimizer,
  dump the full (gathered) state to ``--full``; with ``--then-load FILE`` also load the
  checkpoint into a fresh model (seed 1) and dump that state to FILE.
* ``load``: build a fresh model (seed 1), ``statekit.load`` the checkpoint, dump the
  full state to ``--full``; with ``--verdicts FILE`` each rank writes its state-check
  verdicts and warnings to ``FILE.rank<r>.json``; with ``--fault`` the load path is faulty
  (``fsdp_testlib.fault_after_load``) and the state check's warnings are recorded, not raised.

Every command fails on a :class:`statekit.StateCheckWarning` (a false alarm of the state
check), except a ``--fault`` load.
* ``train``: train ``--steps`` steps with a ``CheckpointManager`` (``--url`` is its root,
  async saves), saving at ``--save-at``; with ``--resume`` start from the newest
  checkpoint instead; write the per-step global losses to ``--losses``.
* ``incremental``: a model whose ``inp`` and ``hidden`` layers are frozen, saved three
  times by a ``CheckpointManager`` (``--url``, incremental by default) with a training
  step before each save; before the third, rank 1 edits its shard of the frozen
  ``hidden.weight`` in place. Dumps the full state after saves 2 and 3 to
  ``--full``-2.safetensors and ``--full``-3.safetensors.

Flavors: ``fsdp2`` (``fully_shard`` per Linear and at the root), ``fsdp1``
(``FullyShardedDataParallel(device_id=cpu, use_orig_params=True)``), ``fsdp1-flat`` (the same
with ``use_orig_params=False``: the optimizer sees FlatParameters), ``ddp``, ``plain``.
The full state is written by rank 0 as a safetensors file (``model.<fqn>`` and
``optim.<path>`` tensors; param_groups as JSON in the metadata).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from typing import Any

import torch

GLOBAL_BATCH = 12
"""Samples per step over all ranks (divisible by 1, 2, 3 and 4)."""


class Net(torch.nn.Module):
    """A tiny MLP with uneven shard sizes at 2, 3 and 4 ranks, and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(6, 10)
        self.hidden = torch.nn.Linear(10, 7)
        self.out = torch.nn.Linear(7, 5)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(torch.relu(self.inp(x))))) * self.scale


def rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


FROZEN_LAYERS = ("inp", "hidden")
"""The layers ``build(..., frozen=True)`` freezes (``requires_grad=False``)."""


def build(flavor: str, seed: int, frozen: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model (same initial weights on every rank) and its AdamW optimizer; with
    ``frozen`` the :data:`FROZEN_LAYERS` do not require gradients (the optimizer still
    lists them, as ``AdamW(model.parameters())`` does in a fine-tuning script)."""
    torch.manual_seed(seed)
    model = Net()
    if frozen:
        for name in FROZEN_LAYERS:
            getattr(model, name).requires_grad_(False)
    if flavor == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # a CPU mesh, named: fully_shard's default mesh is on CUDA where a GPU is present,
        # and these processes share one GPU (or none) over gloo
        mesh = init_device_mesh("cpu", (rank_world()[1],))
        for layer in (model.inp, model.hidden, model.out):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif flavor in ("fsdp1", "fsdp1-flat"):
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=flavor == "fsdp1")
    elif flavor == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif flavor != "plain":
        raise SystemExit(f"unknown flavor {flavor}")
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    return model, optim


def scheduler(optim: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """A cosine schedule (its chained form reads the optimizer's current lr: a resume that
    restores the optimizer and the schedule inconsistently changes the losses)."""
    return torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=10)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the global batch of ``step`` (the same data at any world size)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 6, generator=g)
    y = torch.randn(GLOBAL_BATCH, 5, generator=g)
    rank, world = rank_world()
    per = GLOBAL_BATCH // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def train_step(model: torch.nn.Module, optim: torch.optim.Optimizer, step: int, sched: Any = None) -> float:
    """One optimizer step; returns the global mean loss (the same number on every rank)."""
    import torch.distributed as dist

    x, y = batch(step)
    loss = torch.nn.functional.mse_loss(model(x), y)
    optim.zero_grad(set_to_none=True)
    loss.backward()
    if isinstance(model, torch.nn.Module) and rank_world()[1] > 1 and not _averages_grads(model):
        for p in model.parameters():  # plain replicated model without DDP: average by hand
            dist.all_reduce(p.grad)
            p.grad /= rank_world()[1]
    optim.step()
    if sched is not None:
        sched.step()
    value = loss.detach().clone()
    if rank_world()[1] > 1:
        dist.all_reduce(value)
        value /= rank_world()[1]
    return float(value)


def _averages_grads(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    return isinstance(model, (FSDPModule, FullyShardedDataParallel, torch.nn.parallel.DistributedDataParallel))


def full_state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The gathered model + optimizer state as flat CPU tensors, and param_groups as JSON."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from statekit_fsdp.state import split_state

    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    # cpu_offload=True (rank 0 only) segfaults for FSDP1 on CPU/gloo in torch 2.13; the
    # models here are tiny, so every rank gathers the full state.
    msd, osd = get_state_dict(inner, [optim], options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    skeleton, tensors = split_state({"model": msd, "optim": osd})
    groups = [dict(g) for g in osd["param_groups"]]
    return {k: t.detach().clone().contiguous() for k, t in tensors.items()}, {"param_groups": json.dumps(groups, sort_keys=True)}


def dump(path: str, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
    from safetensors.torch import save_file

    tensors, meta = full_state(model, optim)
    if rank_world()[0] == 0:
        save_file(tensors, path, metadata=meta)


def main(argv: list[str]) -> None:
    import faulthandler

    faulthandler.enable()
    faulthandler.dump_traceback_later(float(os.environ.get("FSDP_WORKER_TIMEOUT_S", "150")), exit=True)
    warnings.simplefilter("ignore", FutureWarning)
    warnings.simplefilter("ignore", UserWarning)
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["save", "load", "train", "incremental"])
    parser.add_argument("--flavor", default="fsdp2")
    parser.add_argument("--url", required=True)
    parser.add_argument("--full")
    parser.add_argument("--then-load")
    parser.add_argument("--accelerate", action="store_true")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--save-at", type=int, default=4)
    parser.add_argument("--losses")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--verdicts", help="write every state-check verdict and warning to FILE.rank<r>.json")
    parser.add_argument("--fault", action="store_true", help="load: a faulty load path (fsdp_testlib.fault_after_load)")
    args = parser.parse_args(argv)
    from statekit import StateCheckWarning

    if not args.fault:  # a difference in a clean load is a false alarm: fail (after the filters above)
        warnings.simplefilter("error", StateCheckWarning)
    if args.verdicts:
        from fsdp_testlib import capturing_verdicts

        verdicts, _ = capturing_verdicts()

    import torch.distributed as dist

    import statekit

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 or args.flavor in ("fsdp2", "fsdp1", "fsdp1-flat", "ddp"):
        import datetime

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(os.environ.get("FSDP_WORKER_TIMEOUT_S", "150"))))
    try:
        if args.command == "save":
            model, optim = build(args.flavor, seed=0)
            sched = scheduler(optim)
            for step in range(3):
                train_step(model, optim, step, sched)
            target = optim
            if args.accelerate:
                from accelerate import Accelerator

                target = Accelerator(cpu=True).prepare_optimizer(optim)
            statekit.save(args.url, {"model": model, "optim": target, "sched": sched}, step=3)
            if args.full:
                dump(args.full, model, optim)
            if args.then_load:
                model2, optim2 = build(args.flavor, seed=1)
                statekit.load(args.url, {"model": model2, "optim": optim2})
                dump(args.then_load, model2, optim2)
        elif args.command == "load":
            model, optim = build(args.flavor, seed=1)
            if args.fault:
                from fsdp_testlib import fault_after_load

                fault_after_load(model, optim)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("error" if not args.fault else "always", StateCheckWarning)
                statekit.load(args.url, {"model": model, "optim": optim})
            if args.full:
                dump(args.full, model, optim)
            if args.verdicts:
                from fsdp_testlib import verdict_json

                with open(f"{args.verdicts}.rank{rank_world()[0]}.json", "w") as f:
                    json.dump({"verdicts": [verdict_json(v) for v in verdicts],
                               "warnings": [str(w.message) for w in caught if issubclass(w.category, StateCheckWarning)]}, f)
        elif args.command == "incremental":
            model, optim = build(args.flavor, seed=0, frozen=True)
            sched = scheduler(optim)
            manager = statekit.CheckpointManager({"model": model, "optim": optim, "sched": sched}, args.url)
            for step in (1, 2, 3):
                if step == 3 and rank_world()[0] == 1:
                    with torch.no_grad():  # this rank's shard of a frozen weight, edited in place
                        model.hidden.weight.to_local().view(-1)[0] += 1.0
                train_step(model, optim, step, sched)
                manager.save(step)
                if step >= 2:
                    dump(f"{args.full}-{step}.safetensors", model, optim)
        else:
            model, optim = build(args.flavor, seed=0 if not args.resume else 1)
            sched = scheduler(optim)
            # async: the shards are staged on this thread, written in the background while
            # training goes on (and changes the parameters)
            manager = statekit.CheckpointManager({"model": model, "optim": optim, "sched": sched}, args.url, async_save=True)
            first = 0
            if args.resume:
                first = manager.resume()
                assert first == args.save_at, first
            losses = {}
            for step in range(first, args.steps):
                losses[step] = train_step(model, optim, step, sched)
                if not args.resume and step + 1 == args.save_at:
                    manager.save(step + 1)
            manager.wait()
            if rank_world()[0] == 0:
                with open(args.losses, "w") as f:
                    json.dump({str(k): v for k, v in losses.items()}, f)
    finally:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
