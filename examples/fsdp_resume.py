"""Train an FSDP2 model on CPU, save it sharded with statekit, resume on a different number of processes.

Needs ``statekit`` and ``statekit-fsdp`` installed (``pip install -e . -e plugins/statekit-fsdp``).
Run the whole demonstration (it launches torchrun twice)::

    python examples/fsdp_resume.py                       # train on 2 processes, resume on 3
    python examples/fsdp_resume.py --train-procs 4 --resume-procs 1 --dir /tmp/fsdp-demo

or the two halves yourself::

    torchrun --nproc_per_node=2 examples/fsdp_resume.py train  --dir /tmp/fsdp-demo
    torchrun --nproc_per_node=3 examples/fsdp_resume.py resume --dir /tmp/fsdp-demo

``train`` runs ``--steps`` steps without interruption, saving a checkpoint at
``--save-at`` (every rank writes its own shards; statekit-fsdp takes the FSDP model and
its optimizer, the core writes the LR scheduler once), and records its loss curve.
``resume`` starts fresh processes, loads that checkpoint (resharding to the new world
size) and trains the remaining steps. Both curves are printed side by side: every step
sees the same global batch at any world size, so the resumed curve continues the
original one up to float32 rounding (bit for bit when the world size is unchanged).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import statekit

GLOBAL_BATCH = 24  # divisible by 1, 2, 3, 4 and 6 processes


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def build(seed: int = 0):
    """A small MLP, sharded with FSDP2 (one group per layer plus the root), AdamW and a cosine schedule."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 4)
    )
    # a CPU mesh, named: fully_shard's default mesh is on CUDA wherever a GPU is present,
    # and these gloo processes (all on one machine) would then share GPU 0 and hang
    mesh = init_device_mesh("cpu", (_rank_world()[1],))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=100)
    return model, optim, sched


def batch(step: int):
    """This rank's slice of step ``step``'s global batch: a fixed random teacher's regression task."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(GLOBAL_BATCH, 16, generator=g)
    teacher = torch.Generator().manual_seed(12345)
    w = torch.randn(16, 4, generator=teacher)
    y = torch.tanh(x @ w) + 0.05 * torch.randn(GLOBAL_BATCH, 4, generator=g)
    rank, world = _rank_world()
    per = GLOBAL_BATCH // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def step_once(model, optim, sched, step: int) -> float:
    """One training step; returns the loss averaged over all ranks (the global batch loss)."""
    x, y = batch(step)
    loss = torch.nn.functional.mse_loss(model(x), y)
    optim.zero_grad(set_to_none=True)
    loss.backward()  # FSDP2 reduce-scatters the gradients, averaged over ranks
    optim.step()
    sched.step()
    value = loss.detach().clone()
    dist.all_reduce(value)
    return float(value) / _rank_world()[1]


def run(mode: str, directory: Path, steps: int, save_at: int) -> None:
    """Body of one torchrun process (``train`` or ``resume``)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # shows statekit-fsdp's resharding line
    warnings.simplefilter("ignore", statekit.StatekitWarning)  # e.g. RNG state of ranks that no longer exist
    dist.init_process_group("gloo")
    rank, world = _rank_world()
    ckpt = str(directory / "checkpoint")
    model, optim, sched = build(seed=0 if mode == "train" else 1)  # resume starts from other weights on purpose
    first = 0
    if mode == "resume":
        manifest = statekit.load(ckpt, {"model": model, "optim": optim, "sched": sched})
        first = manifest.step
    losses = {}
    for step in range(first, steps):
        losses[step] = step_once(model, optim, sched, step)
        if mode == "train" and step + 1 == save_at:
            statekit.save(ckpt, {"model": model, "optim": optim, "sched": sched}, step=save_at, overwrite=True)
            if rank == 0:
                print(f"[train x{world}] saved step {save_at} to {ckpt}", flush=True)
    if rank == 0:
        (directory / f"{mode}.json").write_text(json.dumps({"world_size": world, "losses": losses}))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(nproc: int, *args: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
           f"--master_port={_free_port()}", __file__, *args]  # fmt: skip
    print("$", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))


def demo(train_procs: int, resume_procs: int, directory: Path, steps: int, save_at: int) -> None:
    """Launch both halves and print the two loss curves."""
    common = ["--dir", str(directory), "--steps", str(steps), "--save-at", str(save_at)]
    _torchrun(train_procs, "train", *common)
    _torchrun(resume_procs, "resume", *common)
    train = json.loads((directory / "train.json").read_text())
    resume = json.loads((directory / "resume.json").read_text())
    print(f"\n step  loss, {train['world_size']} procs (uninterrupted)  loss, {resume['world_size']} procs (resumed)  rel. diff")
    worst = 0.0
    for step in range(steps):
        a = train["losses"][str(step)]
        b = resume["losses"].get(str(step))
        if b is None:
            print(f"{step:5d}  {a:30.8f}")
            continue
        diff = abs(a - b) / abs(a)
        worst = max(worst, diff)
        print(f"{step:5d}  {a:30.8f}  {b:26.8f}  {diff:9.1e}")
    print(f"\nresumed at step {save_at}; largest relative difference after the resume: {worst:.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", nargs="?", choices=["demo", "train", "resume"], default="demo")
    parser.add_argument("--dir", type=Path, default=None, help="where the checkpoint and the curves go")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--save-at", type=int, default=15)
    parser.add_argument("--train-procs", type=int, default=2)
    parser.add_argument("--resume-procs", type=int, default=3)
    args = parser.parse_args()
    directory = args.dir or Path(tempfile.mkdtemp(prefix="statekit-fsdp-demo-"))
    directory.mkdir(parents=True, exist_ok=True)
    if args.mode == "demo":
        demo(args.train_procs, args.resume_procs, directory, args.steps, args.save_at)
    else:
        run(args.mode, directory, args.steps, args.save_at)


if __name__ == "__main__":
    main()
