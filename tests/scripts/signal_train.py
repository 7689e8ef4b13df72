"""A training run with ``CheckpointManager(save_on_signal=True)``, for real signals.

Usage: python signal_train.py MODE ROOT OUT  (or under torchrun --nproc_per_node 2)
MODE: reference (train TOTAL steps, no checkpoints) or run (resume if a checkpoint
exists, train to TOTAL; a signal saves the step reached and exits 143).

Environment:
  STATEKIT_TEST_ACCUM      gradient_accumulation_steps (steps are then micro-batches)
  STATEKIT_TEST_ASYNC      "1": async_save=True, and an async save every 4 steps
  STATEKIT_TEST_GRACE      grace_s (default: statekit's)
  STATEKIT_TEST_WATCHER    "1": PreemptionPolicy(watcher=True) (these tests test the safe points, the
                           watcher's fallback: off by default; tests/integration/signals/test_signal_anywhere.py
                           tests the watcher)
  STATEKIT_TEST_HOLD       "<step>": the async save of that step blocks on its writer thread
                           (slow storage: the root is opened through a local filesystem whose
                           first write into checkpoint-<step> waits) until the test writes a
                           line to the FIFO OUT.rank<r>.hold.fifo; prints "holding <rank> <step>"
  STATEKIT_TEST_REMOTE     a directory: replicate_to it (through the same local filesystem)
  STATEKIT_TEST_HOLD_COPY  "<step>": the remote copy of that step blocks on the replication
                           thread like STATEKIT_TEST_HOLD
  STATEKIT_TEST_PAUSE      "<where>:<step>": block at that point until the test writes a
                           line to the FIFO OUT.rank<r>.fifo (it sends its signal first);
                           where: mid-step (after backward, before optimizer.step),
                           after-async-save (right after an async save started), load
                           (inside the resume's load, in a registered object's load_state_dict)
Every rank prints "ready <rank> <pid>" once, then "step <rank> <n>" after each step and
"paused <rank> <where> <n>" at a pause. Each rank writes OUT.rank<r>.json: the losses of
this run, the step it started from, the step it stopped at, and the final weights.
"""

import json
import os
import sys
import threading

import fsspec
import torch
import torch.nn.functional as F

sys.path.insert(0, __file__.rsplit("/scripts/", 1)[0])
from accelerate_helpers import batches, build  # noqa: E402

import statekit  # noqa: E402

TOTAL = 24

mode, root, out = sys.argv[1:4]
accum = int(os.environ.get("STATEKIT_TEST_ACCUM", "1"))
use_async = os.environ.get("STATEKIT_TEST_ASYNC") == "1"
pause_where, _, pause_step = os.environ.get("STATEKIT_TEST_PAUSE", "").partition(":")
pause_step = int(pause_step) if pause_step else -1

run = build(seed=0, n=112, batch_size=8, accum=accum)
accelerator, model, optimizer, loader, scheduler, counter = run
rank = accelerator.process_index


def say(*words) -> None:
    os.write(1, (" ".join(map(str, words)) + "\n").encode())  # one write: the ranks share the launcher's stdout


def pause(where: str, step: int) -> None:
    if where == pause_where and step == pause_step:
        say("paused", rank, where, step)
        with open(f"{out}.rank{rank}.fifo") as fifo:  # blocks until the test has signalled
            fifo.read()


class LoadProbe:
    """A registered object whose load pauses: a signal arriving during the resume."""

    def state_dict(self):
        return {"x": 1}

    def load_state_dict(self, state):
        pause("load", 0)


accelerator.register_for_checkpointing(LoadProbe())

hold_step = os.environ.get("STATEKIT_TEST_HOLD")
hold_copy = os.environ.get("STATEKIT_TEST_HOLD_COPY")
remote = os.environ.get("STATEKIT_TEST_REMOTE")
if hold_step or remote:
    from fsspec.implementations.dirfs import DirFileSystem
    from fsspec.implementations.local import LocalFileSystem

    holds = []  # (path fragment, thread name prefix): the first write matching one waits
    if hold_step:
        holds.append((f"{os.path.abspath(root)}/checkpoint-{int(hold_step):08d}/", "statekit-save"))
    if remote and hold_copy:
        holds.append((f"{os.path.abspath(remote)}/checkpoint-{int(hold_copy):08d}/", "statekit-replicate"))

    class HoldFileSystem(DirFileSystem):
        """The local disk, except that the first write of the async save of step
        ``hold_step`` (or of the remote copy of step ``hold_copy``) waits for the test
        (storage that stalls while a save or a copy is in flight)."""

        protocol = "holdfile"

        def __init__(self, **kwargs):
            super().__init__(path="/", fs=LocalFileSystem(), **kwargs)

        def open(self, path, mode="rb", *args, **kwargs):
            thread = threading.current_thread().name
            for held in list(holds):
                if "w" in mode and held[0] in "/" + path.lstrip("/") and thread.startswith(held[1]):
                    holds.remove(held)
                    say("holding", rank, int(held[0].rstrip("/").rsplit("-", 1)[1]))
                    with open(f"{out}.rank{rank}.hold.fifo") as fifo:
                        fifo.read()
            return super().open(path, mode, *args, **kwargs)

    if not os.path.exists(f"{out}.rank{rank}.hold.fifo"):
        os.mkfifo(f"{out}.rank{rank}.hold.fifo")
    fsspec.register_implementation("holdfile", HoldFileSystem, clobber=True)
    if hold_step:
        root = f"holdfile://{os.path.abspath(root)}"
say("ready", rank, os.getpid())
losses: list[float] = []
start = step = 0
manager = None
try:
    if mode == "run":
        grace = os.environ.get("STATEKIT_TEST_GRACE")
        tiers = {"replicate_to": f"holdfile://{os.path.abspath(remote)}"} if remote else {}
        policy = statekit.PreemptionPolicy(**({"grace_s": float(grace)} if grace else {}),
                                           watcher=os.environ.get("STATEKIT_TEST_WATCHER") == "1")
        manager = statekit.CheckpointManager(accelerator, root, async_save=use_async, **tiers, save_on_signal=policy)
        start = step = manager.resume() or 0
    source = batches(loader)
    while step < TOTAL:
        x, y = next(source)
        with accelerator.accumulate(model):
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            pause("mid-step", step + 1)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        step += 1
        counter.count += 1
        losses.append(loss.item())
        say("step", rank, step)
        if manager is not None:
            if use_async and step % 4 == 0:
                manager.save(step)
                pause("after-async-save", step)
            manager.step_boundary(step)
    if manager is not None:
        manager.wait()
    code = 0
except SystemExit as exc:
    code = exc.code
weights = {k: v.tolist() for k, v in accelerator.unwrap_model(model).state_dict().items()}
with open(f"{out}.rank{rank}.json", "w") as f:
    json.dump({"losses": losses, "start": start, "stopped": step, "code": code, "weights": weights,
               "result": manager.signal_save.result if manager is not None else None}, f)
sys.stdout.flush()
sys.stderr.flush()
if os.environ.get("STATEKIT_TEST_NORMAL_EXIT"):  # one process: the interpreter's exit, atexit waits included
    sys.exit(code)
os._exit(code)  # skip interpreter finalization (gloo teardown, pytorch/pytorch PR 179291)
