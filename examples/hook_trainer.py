"""A hook-based trainer with gradient accumulation, checkpointed by ``statekit.CheckpointHook``.

The trainer has the nested loops of a hook-based trainer (RoboOrchardLab's
``HookBasedTrainer``): loop, epoch, step (one optimizer step) and micro-batch, with
``on_<channel>_begin/end`` hooks around each. A step spans ``--accum`` micro-batches
(gradient accumulation); an epoch-level ``StepLR`` steps at each epoch end. The data are
96 random points in 16 dimensions, labelled by a random linear map into 4 classes (built
in code: nothing to download), in shuffled micro-batches of 8; the model has dropout, so
RNG state matters.

Checkpointing is one hook: ``CheckpointHook(manager, progress, every_n_steps=3,
every_n_epochs=1)`` resumes at loop begin, saves at step and epoch ends and waits for
async saves at loop end. Run it, kill it, run it again: it resumes where the newest
checkpoint was taken and ends with the same weights as an uninterrupted run.

Usage::

    python examples/hook_trainer.py --url runs/hook-trainer               # trains (or resumes) to the end
    python examples/hook_trainer.py --url runs/hook-trainer --kill-at-step 10  # SIGKILLs itself after step 10
    python examples/hook_trainer.py --url runs/hook-trainer --log steps.jsonl --final final.pt
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import statekit


@dataclass
class HookArgs:
    """What the trainer hands every hook (``PipelineHookArgs`` in RoboOrchardLab)."""

    epoch_id: int
    step_id: int
    global_step_id: int
    loss: float | None = None


class Trainer:
    """Loop -> epoch -> step -> micro-batch, calling ``on_<channel>_begin/end`` of every hook."""

    def __init__(self, model, optimizer, scheduler, loader, progress, hooks, *, accum: int, epochs: int) -> None:
        self.model, self.optimizer, self.scheduler, self.loader = model, optimizer, scheduler, loader
        self.progress, self.hooks, self.accum, self.epochs = progress, hooks, accum, epochs
        if len(loader) % accum:
            raise ValueError(f"{len(loader)} micro-batches per epoch are not a multiple of accum={accum}")
        self.steps_per_epoch = len(loader) // accum

    def call(self, channel: str, loss: float | None = None) -> None:
        """Call ``channel`` (``"on_step_end"``...) on every hook that has it, with the counters."""
        p = self.progress
        args = HookArgs(p.epoch, p.step_in_epoch, p.global_step, loss)
        for hook in self.hooks:
            method = getattr(hook, channel, None)  # a hook implements the channels it needs
            if method is not None:
                method(args)

    def fit(self) -> None:
        """Train to ``epochs`` epochs, from wherever ``on_loop_begin`` left the counters."""
        p = self.progress
        self.call("on_loop_begin")  # CheckpointHook resumes here: model ... progress restored
        while p.epoch < self.epochs:
            self.call("on_epoch_begin")
            if p.step_in_epoch < self.steps_per_epoch:  # else resumed after this epoch's last step
                micro_batches = iter(self.loader)  # after a resume: the rest of the epoch
                for group in zip(*[micro_batches] * self.accum):
                    self.step(group)
            p.finish_epoch()
            self.scheduler.step()  # an epoch-level LR schedule
            self.call("on_epoch_end")
        self.call("on_loop_end")

    def step(self, group) -> None:
        """One optimizer step over ``accum`` micro-batches (``(x, y)`` tensor pairs)."""
        self.call("on_step_begin")
        total = 0.0
        for x, y in group:
            self.call("on_batch_begin")
            loss = F.cross_entropy(self.model(x), y) / self.accum
            loss.backward()  # gradients accumulate in .grad
            total += loss.item()
            self.progress.finish_micro_batch()
            self.call("on_batch_end")
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.progress.finish_step()
        self.call("on_step_end", loss=total)  # a sync point: no accumulated gradient left


class LossLog:
    """Writes ``{"step", "epoch", "loss"}`` per optimizer step as JSON lines (and the resume)."""

    def __init__(self, path: str | None, checkpoint: statekit.CheckpointHook) -> None:
        self.file = open(path, "a", buffering=1) if path else None
        self.checkpoint = checkpoint

    def on_loop_begin(self, args) -> None:
        if self.file:
            self.file.write(json.dumps({"resumed_from": self.checkpoint.resumed_step}) + "\n")

    def on_step_end(self, args) -> None:
        if self.file:
            self.file.write(json.dumps({"step": args.global_step_id, "epoch": args.epoch_id, "loss": args.loss}) + "\n")


class KillAt:
    """SIGKILLs this process at the end of step ``k``, as a crash or a preemption would."""

    def __init__(self, k: int | None) -> None:
        self.k = k

    def on_step_end(self, args) -> None:
        if args.global_step_id == self.k:
            os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str] | None = None) -> None:
    """Build the run, add the hooks, train (resuming from ``--url`` when it holds a checkpoint)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="runs/hook-trainer", help="checkpoint root URL")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--accum", type=int, default=3, help="micro-batches per optimizer step")
    parser.add_argument("--every-n-steps", type=int, default=3)
    parser.add_argument("--async-save", action="store_true", help="save from a background thread")
    parser.add_argument("--kill-at-step", type=int, default=None, help="SIGKILL this process after step K")
    parser.add_argument("--log", default=None, help="append per-step losses here (JSON lines)")
    parser.add_argument("--final", default=None, help="torch.save the final state dicts here")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    x = torch.randn(96, 16)
    data = torch.utils.data.TensorDataset(x, (x @ torch.randn(16, 4)).argmax(dim=1))
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    progress = statekit.TrainerProgress()
    objects = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loader": loader, "trainer": progress}
    manager = statekit.CheckpointManager(objects, args.url, keep_last=3, async_save=args.async_save)
    checkpoint = statekit.CheckpointHook(manager, progress, every_n_steps=args.every_n_steps, every_n_epochs=1)
    hooks = [checkpoint, LossLog(args.log, checkpoint), KillAt(args.kill_at_step)]
    Trainer(model, optimizer, scheduler, loader, progress, hooks, accum=args.accum, epochs=args.epochs).fit()
    if args.final:
        final = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
        torch.save(final, args.final)


if __name__ == "__main__":
    main()
