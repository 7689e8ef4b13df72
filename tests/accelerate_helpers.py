"""A tiny Accelerate training setup shared by the bridge, manager and data tests."""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.dropout = nn.Dropout(0.3)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.dropout(torch.relu(self.fc1(x))))


class Counter:
    """A custom object registered with accelerator.register_for_checkpointing."""

    def __init__(self) -> None:
        self.count = 0
        self.history: list[tuple[int, float]] = []

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "history": list(self.history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = state["count"]
        self.history = list(state["history"])


def fresh_accelerator(stateful: bool = False, accum: int = 1):
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return Accelerator(
        cpu=True,
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=stateful),
        gradient_accumulation_steps=accum,
    )


def prepared_linear(with_scheduler: bool = False):
    """A fresh accelerator with a seeded ``Linear(4, 2)`` and its SGD (and a StepLR) prepared:
    ``(accelerator, prepared objects)``."""
    accelerator = fresh_accelerator()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    objects = [model, optimizer]
    if with_scheduler:
        objects.append(torch.optim.lr_scheduler.StepLR(optimizer, step_size=1))
    return accelerator, accelerator.prepare(*objects)


def build(seed: int = 0, stateful: bool = False, n: int = 100, batch_size: int = 8, accum: int = 1):
    """(accelerator, model, optimizer, loader, scheduler, counter), prepared and seeded;
    ``accum``: ``gradient_accumulation_steps``."""
    from accelerate.utils import set_seed

    set_seed(seed)
    accelerator = fresh_accelerator(stateful, accum)
    g = torch.Generator().manual_seed(99)
    x = torch.randn(n, 6, generator=g)
    y = torch.randint(0, 3, (n,), generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size, shuffle=True)
    model = TinyNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, 50) / 50)))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    return accelerator, model, optimizer, loader, scheduler, counter


def batches(loader):
    """The loader's batches, continuing one training loop across calls of the helpers below.

    A training loop holds its ``for`` loop's iterator while it saves; a helper that left its
    loop with ``break`` before the test saves would leave the epoch instead (statekit then
    saves a new pass, as the next ``for`` would start one). So the helpers take their batches
    from one live iterator per loader, started again where an epoch ends.
    """
    while True:
        live = loader.__dict__.get("_test_live_iterator")
        if live is None:
            live = iter(loader)
            loader.__dict__["_test_live_iterator"] = live
        for batch in live:
            yield batch
        loader.__dict__["_test_live_iterator"] = None


def train_steps(run, steps: int, start: int = 0, on_step=None) -> list[float]:
    """Train ``steps`` optimizer steps from step ``start``; returns the losses."""
    accelerator, model, optimizer, loader, scheduler, counter = run
    losses: list[float] = []
    step = start
    source = batches(loader)
    while step < start + steps:
        x, y = next(source)
        loss = F.cross_entropy(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        step += 1
        counter.count += 1
        losses.append(loss.item())
        if on_step is not None:
            on_step(step)
    return losses


def train_micro_batches(run, count: int, start: int = 0, on_step=None) -> list[float]:
    """Train ``count`` micro-batches from micro-batch ``start`` inside
    ``accelerator.accumulate`` (optimizer and scheduler step at sync points only, as
    Accelerate's accumulation loop does); returns the per-micro-batch losses."""
    accelerator, model, optimizer, loader, scheduler, counter = run
    losses: list[float] = []
    done = start
    source = batches(loader)
    while done < start + count:
        x, y = next(source)
        with accelerator.accumulate(model):
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        done += 1
        counter.count += 1
        losses.append(loss.item())
        if on_step is not None:
            on_step(done)
    return losses


def train_loop(model, optimizer, loader, steps: int, start: int = 0, on_step=None, record=None) -> list[tuple[float, Any]]:
    """Plain loop (no Accelerate calls; works for prepared objects too): ``steps``
    optimizer steps from step ``start``, crossing epochs; ``on_step(step)`` after each.

    Returns:
        Per step ``(loss, record(x, y))`` (``record`` None: the labels as a list).
    """
    seen: list[tuple[float, Any]] = []
    step = start
    source = batches(loader)
    while step < start + steps:
        x, y = next(source)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        seen.append((loss.item(), y.tolist() if record is None else record(x, y)))
        if on_step is not None:
            on_step(step)
    return seen


SCRIPTS = Path(__file__).parent / "scripts"


def script_command(script: Path | str, *args: str, nproc: int = 1, launcher: bool | None = None) -> list[str]:
    """The command that runs ``script``: in this interpreter, or (``launcher``; default:
    ``nproc`` > 1) under ``torchrun`` with ``nproc`` processes on a free local port."""
    if not (nproc > 1 if launcher is None else launcher):
        return [sys.executable, str(script), *args]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={port}",
            "--master_addr=127.0.0.1", str(script), *args]


def torchrun(script: str, *args: str, nproc: int = 2, env: dict[str, str] | None = None, timeout: float = 300) -> None:
    """Run ``tests/scripts/<script>`` under ``torchrun`` with ``nproc`` real gloo processes
    on a free local port (one thread each); fails the test with the output's tail."""
    cmd = script_command(SCRIPTS / script, *args, nproc=nproc, launcher=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
