"""statekit resume demo: train, get killed mid-epoch with SIGKILL, resume bit-exactly.

A small CNN with dropout learns scikit-learn's handwritten digits (1,797 8x8 images)
with Accelerate, AdamW and a warm-up + cosine LR schedule, from a shuffled DataLoader,
checkpointing with statekit every few steps. The demo runs:

1. a reference training to N steps, in a fresh process;
2. the same training in a child process that is killed with SIGKILL at a random step in
   the middle of an epoch (whatever it is doing: maybe in the middle of a save);
3. a new process that resumes from the newest committed checkpoint and trains to N.

It then checks that the final weights, the optimizer state and the per-step loss history
equal the reference bit for bit, prints a report, and exits 1 if they do not.

``memory://`` is private to each process, so with a ``memory://`` URL steps 2 and 3 run
inside this process: the run is abandoned at the random step (an exception stands in for
the SIGKILL) and resumed with freshly built objects.

Usage::

    python examples/resume_demo.py                       # local folder under ./runs
    python examples/resume_demo.py --url memory://demo
    python examples/resume_demo.py --moto                # starts a local moto S3 server
    python examples/resume_demo.py --url s3://bucket/run # any fsspec URL
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


# --------------------------------------------------------------------------- the training run


class Net(nn.Module):
    """A small CNN for 8x8 digits: two conv layers, dropout, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.dropout = nn.Dropout(0.3)
        self.head = nn.Linear(32 * 2 * 2, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.head(self.dropout(x.flatten(1)))


def digits() -> tuple[torch.utils.data.TensorDataset, torch.utils.data.TensorDataset]:
    """The digits data set as (train, test), a fixed 80/20 split."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(bunch.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(1234))
    cut = int(0.8 * len(y))
    train, test = order[:cut], order[cut:]
    return (torch.utils.data.TensorDataset(x[train], y[train]), torch.utils.data.TensorDataset(x[test], y[test]))


def build(args: argparse.Namespace):
    """Everything a run needs, built the same way in every process."""
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.utils import set_seed

    import statekit

    set_seed(args.seed)
    torch.set_num_threads(1)  # one thread: the same float summation order in every process
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=args.stateful_loader))
    train, test = digits()
    loader = torch.utils.data.DataLoader(train, batch_size=args.batch_size, shuffle=True)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-2)
    warmup = max(1, args.steps // 10)

    def lr_lambda(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, args.steps - warmup))))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    manager = statekit.CheckpointManager(accelerator, args.url, keep_last=args.keep_last, storage_options=args.storage_options)
    return accelerator, model, optimizer, loader, scheduler, manager, test


class Abandon(Exception):
    """Stands in for SIGKILL when the checkpoints live in this process (memory://)."""


def train(args: argparse.Namespace, log, resume: bool, abandon_at: int | None = None) -> None:
    """Train to ``args.steps``; log every step, save and resume as JSON lines to ``log``."""
    import statekit

    accelerator, model, optimizer, loader, scheduler, manager, test = build(args)
    step = 0
    if resume:
        started = time.perf_counter()
        step = manager.resume() or 0
        log({"event": "resume", "step": step, "seconds": time.perf_counter() - started})
    model.train()
    while step < args.steps:
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            log({"event": "step", "step": step, "loss": loss.item()})
            if abandon_at is not None and step == abandon_at:
                raise Abandon(step)
            if step % args.save_every == 0:
                started = time.perf_counter()
                manifest = manager.save(step, metrics={"loss": loss.item()})
                size = sum(f["size_bytes"] for f in manifest["files"].values())
                log({"event": "save", "step": step, "seconds": time.perf_counter() - started, "bytes": size,
                     "plugins": manifest["plugins"]})
            if step >= args.steps:
                break
    model.eval()
    with torch.no_grad():
        x, y = test.tensors
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    plugins = sorted(name for name, _ in statekit.get_plugin_manager().list_name_plugin() if name)
    log({"event": "done", "step": step, "accuracy": accuracy, "plugins": plugins})
    final = {"model": accelerator.unwrap_model(model), "optimizer": optimizer.optimizer}
    statekit.save(args.final, final, step=step, overwrite=True)


# --------------------------------------------------------------------------- orchestration


def jsonl_logger(path: Path):
    handle = path.open("a", buffering=1)

    def log(record: dict) -> None:
        handle.write(json.dumps(record) + "\n")
        handle.flush()

    return log


def read_log(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def worker_command(args: argparse.Namespace, log: Path, final: str, resume: bool) -> list[str]:
    cmd = [sys.executable, __file__, "--worker", "--url", args.url, "--steps", str(args.steps),
           "--save-every", str(args.save_every), "--batch-size", str(args.batch_size), "--seed", str(args.seed),
           "--log", str(log), "--final", final]
    if args.keep_last:
        cmd += ["--keep-last", str(args.keep_last)]
    if args.stateful_loader:
        cmd.append("--stateful-loader")
    if resume:
        cmd.append("--resume")
    return cmd


def run_to_end(cmd: list[str]) -> None:
    result = subprocess.run(cmd)
    if result.returncode != 0:
        raise SystemExit(f"worker failed with exit code {result.returncode}: {' '.join(cmd)}")


def run_and_kill(cmd: list[str], log: Path, kill_at: int) -> int:
    """Start the worker and SIGKILL it once it reports step >= kill_at; returns the last step seen."""
    child = subprocess.Popen(cmd)
    try:
        while child.poll() is None:
            steps = [r["step"] for r in read_log(log) if r["event"] == "step"]
            if steps and steps[-1] >= kill_at:
                os.kill(child.pid, signal.SIGKILL)
                child.wait()
                return steps[-1]
            time.sleep(0.002)
    finally:
        if child.poll() is None:
            child.kill()
    raise SystemExit(f"the worker finished (exit code {child.returncode}) before it could be killed at step {kill_at}")


def compare_final(a: str, b: str) -> list[str]:
    """Differences between two final states written by ``train`` (empty if bit-identical)."""
    import statekit
    from statekit.engine.context import Checkpoint
    from statekit.storage import Storage

    problems = []
    tensors = {}
    for name, url in (("reference", a), ("resumed", b)):
        checkpoint = Checkpoint(Storage(url), mode="load", manifest=statekit.api.saveload.read_manifest(Storage(url)))
        tensors[name] = {
            "model": checkpoint.load_tensors("model.safetensors"),
            "optimizer": checkpoint.load_state("optimizer"),
        }
    ref, res = tensors["reference"], tensors["resumed"]
    for key, t in ref["model"].items():
        if not torch.equal(t, res["model"][key]):
            problems.append(f"weight {key} differs (max abs diff {(t - res['model'][key]).abs().max().item():.3g})")
    for index, state in ref["optimizer"]["state"].items():
        for name, value in state.items():
            other = res["optimizer"]["state"][index][name]
            if not torch.equal(torch.as_tensor(value), torch.as_tensor(other)):
                problems.append(f"optimizer state {index}.{name} differs")
    if ref["optimizer"]["param_groups"] != res["optimizer"]["param_groups"]:
        problems.append("optimizer param_groups differ")
    return problems


def start_moto() -> tuple[subprocess.Popen, str]:
    """Start moto's S3 server on a free local port; returns (process, endpoint URL)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            urllib.request.urlopen(endpoint, timeout=1)
            break
        except Exception:
            time.sleep(0.05)
    os.environ.update({"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1"})
    import s3fs

    s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}).mkdir("statekit-demo")
    return server, endpoint


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=None, help="checkpoint root URL (default: ./runs/resume-demo-<id>)")
    parser.add_argument("--moto", action="store_true", help="start a local moto S3 server and use s3://statekit-demo/...")
    parser.add_argument("--steps", type=int, default=240, help="training steps (default 240: about 5 epochs)")
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--keep-last", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kill-at", type=int, default=None, help="step to kill at (default: random, mid-epoch)")
    parser.add_argument("--stateful-loader", action="store_true", help="use Accelerate's StatefulDataLoader")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--log", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--final", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.storage_options = None

    if args.worker:
        train(args, jsonl_logger(Path(args.log)), resume=args.resume)
        return 0

    server = None
    if args.moto:
        server, endpoint = start_moto()
        args.url = args.url or f"s3://statekit-demo/resume-demo-{uuid.uuid4().hex[:8]}"
        print(f"moto S3 server at {endpoint}")
    args.url = args.url or str(Path("runs") / f"resume-demo-{uuid.uuid4().hex[:8]}")
    in_process = args.url.startswith("memory://")
    work = Path(tempfile.mkdtemp(prefix="statekit-demo-"))
    batches_per_epoch = math.ceil(1437 / args.batch_size)
    rng = random.Random()
    kill_at = args.kill_at
    while kill_at is None or kill_at % batches_per_epoch == 0:
        kill_at = rng.randrange(args.save_every + 1, args.steps - 1)
    print(f"statekit resume demo: {args.steps} steps, checkpoint every {args.save_every} to {args.url}")
    try:
        ref_log, run_log = work / "reference.jsonl", work / "run.jsonl"
        ref_final, run_final = str(work / "final-reference"), str(work / "final-resumed")
        ref_args = argparse.Namespace(**{**vars(args), "url": f"{args.url.rstrip('/')}-reference", "log": str(ref_log), "final": ref_final})
        run_args = argparse.Namespace(**{**vars(args), "log": str(run_log), "final": run_final})
        print("1. reference run ...", flush=True)
        if in_process:
            train(ref_args, jsonl_logger(ref_log), resume=False)
        else:
            run_to_end(worker_command(ref_args, ref_log, ref_final, resume=False))
        print(f"2. run killed at step {kill_at} (mid-epoch: batch {kill_at % batches_per_epoch} of {batches_per_epoch}) ...", flush=True)
        if in_process:
            try:
                train(run_args, jsonl_logger(run_log), resume=False, abandon_at=kill_at)
            except Abandon:
                pass
            killed_at = kill_at
        else:
            killed_at = run_and_kill(worker_command(run_args, run_log, run_final, resume=False), run_log, kill_at)
        print(f"   killed after step {killed_at}")
        print("3. resumed run ...", flush=True)
        if in_process:
            train(run_args, jsonl_logger(run_log), resume=True)
        else:
            run_to_end(worker_command(run_args, run_log, run_final, resume=True))
        return report(args, read_log(ref_log), read_log(run_log), ref_final, run_final)
    finally:
        if server is not None:
            server.terminate()


def report(args, ref_events: list[dict], run_events: list[dict], ref_final: str, run_final: str) -> int:
    ref_losses = {r["step"]: r["loss"] for r in ref_events if r["event"] == "step"}
    resume_events = [r for r in run_events if r["event"] == "resume"]
    resumed_step = resume_events[-1]["step"]
    first_run = run_events[: run_events.index(resume_events[-1])]
    second_run = run_events[run_events.index(resume_events[-1]) :]
    history = {r["step"]: r["loss"] for r in first_run if r["event"] == "step" and r["step"] <= resumed_step}
    history.update({r["step"]: r["loss"] for r in second_run if r["event"] == "step"})
    replayed = {r["step"]: r["loss"] for r in first_run if r["event"] == "step" and r["step"] > resumed_step}
    problems = [f"loss at step {s} differs: {history.get(s)!r} vs reference {l!r}" for s, l in ref_losses.items() if history.get(s) != l]
    problems += [f"replayed step {s} differs from the killed run" for s, l in replayed.items() if second_run and history.get(s) != l]
    problems += compare_final(ref_final, run_final)
    saves = [r for r in run_events if r["event"] == "save"]
    done = [r for r in run_events if r["event"] == "done"][-1]
    print()
    print("statekit resume demo report")
    print(f"  checkpoint root      {args.url}")
    print(f"  steps                {args.steps} ({len(ref_losses)} in the reference run)")
    print(f"  resumed from step    {resumed_step} (killed after step {max(s for s in replayed) if replayed else resumed_step})")
    print(f"  checkpoints written  {len(saves)}, {saves[-1]['bytes'] if saves else 0:,} bytes each")
    print(f"  save seconds         median {sorted(r['seconds'] for r in saves)[len(saves) // 2]:.4f}" if saves else "")
    print(f"  load seconds         {resume_events[-1]['seconds']:.4f}")
    active = saves[-1]["plugins"] if saves else {}
    print(f"  plugins active       {', '.join(f'{k} {v}' for k, v in active.items()) or 'none'}"
          f" (installed: {', '.join(done['plugins']) or 'none'})")
    print(f"  test accuracy        {done['accuracy']:.4f}")
    if problems:
        print(f"  RESUME NOT EXACT: {len(problems)} differences")
        for p in problems[:20]:
            print(f"    - {p}")
        return 1
    print("  resume exact         yes: weights, optimizer state and all per-step losses equal the reference bit for bit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
