"""A training run with an evaluation, for a signal that lands outside a step boundary.

Usage: python signal_anywhere.py MODE ROOT OUT  (or under torchrun --nproc_per_node 2)
MODE: reference (train TOTAL steps, no manager) or run (resume if a checkpoint exists,
train to TOTAL under ``CheckpointManager(save_on_signal=True)``).

The loop evaluates before step EVAL_AT + 1 (EVAL_BATCHES batches under ``no_grad``, each
drawing from the global RNG, so a resume is exact only with the boundary's random states);
the model has a BatchNorm layer and dropout; the data loader shuffles with its own
generator. Environment (effective in a run that starts from scratch only):
  STATEKIT_TEST_WHERE    eval: each evaluation batch sleeps 2 s (about 60 s), printing
                         "evaluation started <rank>" first and "evaluation done <rank>" last;
                         stall: from step STALL_AT on, the dataset's __getitem__ blocks
                         (printing "stall started <rank> <pid>"; in a worker until the
                         main process is gone); mid-step: after the forward and backward of
                         step MIDSTEP_AT (BatchNorm statistics changed) the main thread
                         prints "in-step <rank> <step>" and waits for the signal watcher
                         to act (an event), then finishes the step
  STATEKIT_TEST_WORKERS  num_workers of the training loader (default 0)
  STATEKIT_TEST_EVAL_EVERY  also evaluate before every step after a multiple of N steps
                         (the reference must be given the same N)
  STATEKIT_TEST_EVAL_SLEEP  seconds each evaluation batch sleeps in every run (default 0)
Every rank prints "ready <rank> <pid>", "start <rank> <step>", then "step <rank> <n> <loss as float.hex>" after
each step. A run that ends normally (or by SystemExit at a safe point) writes
OUT.rank<r>.pt: {"losses", "start", "stopped", "code", "weights", "result"}.
"""

import logging
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, __file__.rsplit("/scripts/", 1)[0])
from accelerate_helpers import batches, fresh_accelerator  # noqa: E402

import statekit  # noqa: E402

TOTAL, EVAL_AT, STALL_AT, MIDSTEP_AT, EVAL_BATCHES = 14, 6, 3, 11, 30

mode, root, out = sys.argv[1:4]
where = os.environ.get("STATEKIT_TEST_WHERE", "")
workers = int(os.environ.get("STATEKIT_TEST_WORKERS", "0"))
eval_every = int(os.environ.get("STATEKIT_TEST_EVAL_EVERY", "0"))
eval_sleep = float(os.environ.get("STATEKIT_TEST_EVAL_SLEEP", "0"))
MAIN_PID = os.getpid()
STALL_FLAG = f"{out}.stall"


def say(*words) -> None:
    os.write(1, (" ".join(map(str, words)) + "\n").encode())  # one write: the ranks share the launcher's stdout


class Samples(torch.utils.data.Dataset):
    """Fixed samples; once STALL_FLAG exists, a fetch blocks (a stalled data pipeline)."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(99)
        self.x, self.y = torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        if os.path.exists(STALL_FLAG):
            say("stall started", rank, os.getpid())
            deadline = time.monotonic() + 120
            orphaned = None
            while time.monotonic() < deadline:
                time.sleep(0.5)  # a C call; a worker outliving the main process is the test's finding,
                if os.getpid() != MAIN_PID and os.getppid() != MAIN_PID:  # ended 30 s later (no hang)
                    orphaned = orphaned or time.monotonic()
                    if time.monotonic() - orphaned > 30:
                        os._exit(0)
        return self.x[i], self.y[i]


logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")  # the watcher's line, on stderr
torch.manual_seed(0)
accelerator = fresh_accelerator()
rank = accelerator.process_index
model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                            torch.nn.Linear(16, 3))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
loader = torch.utils.data.DataLoader(Samples(112), batch_size=8, shuffle=True, num_workers=workers,
                                     generator=torch.Generator().manual_seed(5))
eval_x = torch.randn(EVAL_BATCHES, 8, 6, generator=torch.Generator().manual_seed(7))
model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
say("ready", rank, os.getpid())

losses: list[str] = []
start = step = 0
manager = None
code = 0
armed = False


def evaluate(slow: bool) -> None:
    model.eval()
    if slow:
        say("evaluation started", rank)
    with torch.no_grad():
        total = 0.0
        for i in range(EVAL_BATCHES):
            total += float(model(eval_x[i] + 0.01 * torch.randn(8, 6)).sum())  # draws from the global RNG
            if slow or eval_sleep:
                time.sleep(2.0 if slow else eval_sleep)
    if slow:
        say("evaluation done", rank)
    model.train()


try:
    if mode == "run":
        manager = statekit.CheckpointManager(accelerator, root, save_on_signal=True)
        start = step = manager.resume() or 0
        armed = start == 0 and bool(where)
    say("start", rank, start)
    source = batches(loader)
    while step < TOTAL:
        if step == EVAL_AT or (eval_every and step and step % eval_every == 0):
            evaluate(armed and where == "eval")
        if armed and where == "stall" and step == STALL_AT:
            Path(STALL_FLAG).touch()
        x, y = next(source)
        loss = F.cross_entropy(model(x), y)
        accelerator.backward(loss)
        if armed and where == "mid-step" and step + 1 == MIDSTEP_AT:
            say("in-step", rank, step + 1)
            manager.signal_save.watcher.finished.wait(120)  # an event: the watcher looked and fell back
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        step += 1
        losses.append(loss.item().hex())
        say("step", rank, step, losses[-1])
        if manager is not None:
            manager.step_boundary(step)
    if manager is not None:
        manager.wait()
except SystemExit as exc:
    code = exc.code
torch.save({"losses": losses, "start": start, "stopped": step, "code": code,
            "weights": accelerator.unwrap_model(model).state_dict(),
            "result": manager.signal_save.result if manager is not None else None}, f"{out}.rank{rank}.pt")
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)  # skip interpreter finalization (gloo teardown, pytorch/pytorch PR 179291)
