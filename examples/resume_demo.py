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
    python examples/resume_demo.py --grad-accum 4        # gradient accumulation
    python examples/resume_demo.py --preempt             # SIGTERM instead of SIGKILL (make demo-preempt)
    python examples/resume_demo.py --preempt-eval        # SIGTERM during an evaluation (make demo-preempt-eval)

With ``--grad-accum N`` each step is a micro-batch inside ``accelerator.accumulate``
and the optimizer steps every N micro-batches (Accelerate's gradient accumulation);
saves every ``--save-every`` micro-batches fall between optimizer steps too, so the
resume must carry the accumulated gradients.

With ``--preempt`` step 2 sends SIGTERM instead of SIGKILL, as a cluster does before
the kill: the manager (``save_on_signal=True``) saves the step the run reached at the next
step boundary and exits 143, and step 3 must resume from exactly that step (not from the
last periodic checkpoint); the report says so, or fails. With ``--preempt-eval`` the run
starts a 60 s evaluation after the kill step and the SIGTERM lands 1 s into it: the
manager's watcher thread saves that step at once (the main thread never reaches another
step boundary) and the process exits 143 mid-evaluation.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import set_seed
from sklearn.datasets import load_digits
from torch import nn

import _demo_harness as harness
import _demo_report as checks
import statekit

TRAIN_SIZE = 1437
"""Training images: 80 % of the 1,797 digits."""


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
    bunch = load_digits()
    x = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(bunch.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(1234))
    train, test = order[:TRAIN_SIZE], order[TRAIN_SIZE:]
    return (torch.utils.data.TensorDataset(x[train], y[train]), torch.utils.data.TensorDataset(x[test], y[test]))


def build(args: argparse.Namespace):
    """Everything a run needs, built the same way in every process."""
    set_seed(args.seed)
    torch.set_num_threads(1)  # one thread: the same float summation order in every process
    accelerator = Accelerator(
        cpu=True,
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=args.stateful_loader),
        gradient_accumulation_steps=args.grad_accum,
    )
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
    manager = statekit.CheckpointManager(accelerator, args.url, keep_last=args.keep_last, storage_options=args.storage_options,
                                         replicate_to=args.replicate_to, save_on_signal=harness.save_on_signal(args))
    return accelerator, model, optimizer, loader, scheduler, manager, test


def train(args: argparse.Namespace, log, resume: bool, abandon_at: int | None = None) -> None:
    """Train to ``args.steps``; log every step, save and resume as JSON lines to ``log``."""
    accelerator, model, optimizer, loader, scheduler, manager, test = build(args)

    def train_step(batch) -> float:
        x, y = batch
        with accelerator.accumulate(model):  # a no-op wrapper without --grad-accum
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()  # Accelerate steps and zeroes only at the end of a window
            scheduler.step()
            optimizer.zero_grad()
        return loss.item()

    step = harness.resume_step(manager, log) if resume else 0
    model.train()
    def evaluate() -> None:  # under no_grad, in eval mode: nothing of the training state changes
        model.eval()
        with torch.no_grad():
            model(test.tensors[0])
        model.train()

    step = harness.train_steps(args, manager, loader, train_step, log, step=step, abandon_at=abandon_at,
                               evaluate=evaluate,
                               describe_save=lambda manifest: {
                                   "plugins": dict(manifest.plugins),
                                   "resume_audit": manifest.resume_audit.to_json() if manifest.resume_audit else None})
    model.eval()
    with torch.no_grad():
        x, y = test.tensors
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    manager.wait()
    log({"event": "checkpoint_stats", **manager.stats().to_dict()})  # the time this run lost to checkpoints
    plugins = sorted(name for name, _ in statekit.get_plugin_manager().list_name_plugin() if name)
    log({"event": "done", "step": step, "accuracy": accuracy, "plugins": plugins})
    final = {"model": accelerator.unwrap_model(model), "optimizer": optimizer.optimizer}
    statekit.save(args.final, final, step=step, overwrite=True)


# --------------------------------------------------------------------------- comparison and report


def compare_final(a: str, b: str) -> list[str]:
    """Differences between two final states written by ``train`` (empty if bit-identical)."""
    states = {}
    for name, url in (("reference", a), ("resumed", b)):
        checkpoint, _ = checks.open_final(url)
        states[name] = {
            "model": checkpoint.load_tensors("model.safetensors"),
            "optimizer": checkpoint.load_state("optimizer"),
        }
    ref, res = states["reference"], states["resumed"]
    return checks.tensor_differences(ref["model"], res["model"]) + checks.optimizer_differences(
        ref["optimizer"], res["optimizer"]
    )


def report(args: argparse.Namespace, runs: harness.Runs) -> int:
    analysis = checks.analyse(runs.ref_events(), runs.run_events())
    problems = analysis.problems + compare_final(runs.ref_final, runs.run_final)
    active = analysis.saves[-1]["plugins"] if analysis.saves else {}
    # the resume audit's verdict, recorded in every checkpoint the resumed run wrote
    audit = (analysis.saves[-1].get("resume_audit") if analysis.saves else None) or {}
    if audit.get("verdict") == "diverged":
        problems.append(f"resume audit: {audit.get('detail')}")
    installed = ", ".join(analysis.done["plugins"]) or "none"
    rows = [
        ("checkpoint root", args.url),
        ("steps", f"{args.steps} ({len(analysis.ref_losses)} in the reference run)"),
        ("grad accumulation", f"{args.grad_accum} micro-batches per optimizer step"),
        ("resumed from step", analysis.resumed),
        ("resumed from", _tier(args, runs)),
        ("checkpoints written", analysis.written),
        ("save seconds", analysis.save_seconds),
        ("load seconds", f"{analysis.load_seconds:.4f}"),
        ("resume audit", _audit_text(audit)),
        ("checkpoint cost", _stats_text(runs)),
        ("plugins active", f"{', '.join(f'{k} {v}' for k, v in active.items()) or 'none'} (installed: {installed})"),
        ("test accuracy", f"{analysis.done['accuracy']:.4f}"),
    ]
    if args.preempt:
        events = runs.run_events()
        signal_save = [r for r in events if r["event"] == "signal_save"]
        from_watcher = bool(signal_save) and bool(signal_save[-1].get("from_watcher"))
        # a save from the watcher is of the last step boundary before the signal (a micro-batch may follow it)
        expected = signal_save[-1]["step"] if from_watcher else analysis.killed_after
        if not signal_save:
            problems.append("the preempted run logged no save on its SIGTERM")
        elif args.preempt_eval and (not from_watcher or any(r["event"] == "evaluation_done" for r in events)):
            problems.append(f"the SIGTERM during the evaluation was not saved from the watcher before the "
                            f"evaluation's end: {signal_save[-1].get('path')}")
        elif analysis.resumed_step != expected or signal_save[-1]["step"] != analysis.resumed_step:
            problems.append(f"resumed from step {analysis.resumed_step}, not from step {analysis.killed_after} where "
                            "the SIGTERM stopped the run")
        else:
            rows.insert(4, ("preempted", f"SIGTERM; {signal_save[-1].get('path', 'saved')}: step "
                                         f"{signal_save[-1]['step']} committed {signal_save[-1]['seconds']:.3f} s after "
                                         f"the signal, exit code 143; resumed exactly from step {analysis.resumed_step}"))
    exact = ["weights, optimizer state and all per-step losses equal the reference bit for bit"]
    return checks.print_report("statekit resume demo report", rows, problems, exact)


def _audit_text(audit: dict) -> str:
    """The resume audit's verdict (docs/concepts.md, Resume audit), as the report shows it."""
    if not audit:
        return "- (no checkpoint written after the resume)"
    if audit.get("verdict") == "verified":
        return "verified: the first batch after the resume is the one recorded at save time (indices and content)"
    return f"{audit.get('verdict')}: {audit.get('detail')}"


def _stats_text(runs: harness.Runs) -> str:
    """The resumed run's ``manager.stats()`` (docs/backpressure.md), as the report shows it."""
    stats = [r for r in runs.run_events() if r["event"] == "checkpoint_stats"]
    if not stats:
        return "-"
    s = stats[-1]
    backlog = s["replication"]
    remote = f", replication backlog {backlog['checkpoints']} checkpoint(s)" if backlog else ""
    return (f"{s['blocking_s_total']:.3f} s blocking in {s['save_count']} saves (longest {s['blocking_s_max']:.3f} s), "
            f"{s['skipped_saves']} skipped, {s['steps_lost_on_resume']} step(s) lost by the resume as far as the root shows{remote}")


def _tier(args: argparse.Namespace, runs: harness.Runs) -> str:
    """Which tier the resumed run loaded: the checkpoint URL and local/remote."""
    url = [r for r in runs.run_events() if r["event"] == "resume"][-1].get("from") or "-"
    remote = bool(args.replicate_to) and url.startswith(args.replicate_to)
    return f"{url} ({'remote tier: replicated to ' + args.replicate_to if remote else 'local'})"


def main(argv: list[str] | None = None) -> int:
    parser = harness.demo_parser(__doc__, "resume-demo", steps=240, steps_help="about 5 epochs", save_every=10,
                                 keep_last=3)
    parser.add_argument("--stateful-loader", action="store_true", help="use Accelerate's StatefulDataLoader")
    parser.add_argument("--grad-accum", type=int, default=1, metavar="N",
                        help="gradient_accumulation_steps (steps are then micro-batches; default 1)")
    args = parser.parse_args(argv)
    args.storage_options = None
    args.preempt = args.preempt or args.preempt_eval

    if args.worker:
        train(args, harness.jsonl_logger(Path(args.log)), resume=args.resume)
        return 0

    with harness.demo_storage(args, "resume-demo"):
        runs = harness.kill_and_resume(
            args,
            title="statekit resume demo",
            script=__file__,
            train=train,
            worker_flags=(["--stateful-loader"] if args.stateful_loader else []) + ["--grad-accum", str(args.grad_accum)],
            batches_per_epoch=math.ceil(TRAIN_SIZE / args.batch_size),
            work_prefix="statekit-demo-",
        )
        return report(args, runs)


if __name__ == "__main__":
    sys.exit(main())
