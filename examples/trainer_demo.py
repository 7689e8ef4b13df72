"""statekit through transformers' Trainer: train, get killed mid-epoch with SIGKILL, resume bit-exactly.

A small GPT-2 (2 layers, built from a config: nothing is downloaded) learns scikit-learn's
handwritten digits written as token sequences (each 8x8 image is 64 pixel tokens), with
``StatekitTrainer`` (statekit-transformers) in place of ``transformers.Trainer``: AdamW, a
warm-up + cosine schedule, dropout, gradient accumulation 2, a shuffled dataset and a
masked-LM collator that draws random masks. It runs, each in a fresh process:

1. a reference training to N steps;
2. the same training, killed with SIGKILL at a random step in the middle of an epoch;
3. a new process that calls ``trainer.train(resume_from_checkpoint=True)``.

It checks that every micro-batch's loss after the resume and the final weights equal the
reference bit for bit, prints a report (what the checkpoint holds, the resume audit), and
exits 1 if they do not. ``make demo-trainer`` runs it.

Usage::

    python examples/trainer_demo.py [--dir runs/trainer-demo] [--steps 40] [--kill-at K]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
from typing import Any

import torch

LEVELS = 17  # digit pixels are 0..16
SPECIAL = ["[PAD]", "[UNK]", "[MASK]"]


def tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = SPECIAL + [f"p{i}" for i in range(LEVELS)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", mask_token="[MASK]", unk_token="[UNK]")


def digits(tok: Any) -> list[dict[str, Any]]:
    """The 1,797 digits as 64-token sentences (``p0`` .. ``p16``)."""
    from sklearn.datasets import load_digits

    images = load_digits().data.astype(int)
    return [dict(tok(" ".join(f"p{v}" for v in row))) for row in images]


def build(args: argparse.Namespace, run_dir: str, log: Any, kill_at: int | None) -> Any:
    from transformers import DataCollatorForLanguageModeling, GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

    from statekit_transformers import StatekitTrainer

    class Recording(StatekitTrainer):  # every micro-batch's loss, exactly (float.hex), flushed as it comes
        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            log.write(json.dumps([self.state.global_step, float(loss.detach()).hex()]) + "\n")
            log.flush()
            return loss

    class Kill(TrainerCallback):
        def on_step_begin(self, targs, state, control, **kwargs):
            if kill_at is not None and state.global_step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    tok = tokenizer()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=len(SPECIAL) + LEVELS, n_positions=64))
    targs = TrainingArguments(
        output_dir=run_dir, per_device_train_batch_size=32, gradient_accumulation_steps=2, max_steps=args.steps,
        learning_rate=3e-3, lr_scheduler_type="cosine", warmup_steps=5, save_strategy="steps", save_steps=args.save_every,
        save_total_limit=3, logging_steps=10, report_to=[], seed=42, use_cpu=True, disable_tqdm=True,
    )
    return Recording(
        model=model, args=targs, train_dataset=digits(tok), processing_class=tok,
        data_collator=DataCollatorForLanguageModeling(tok, mlm=True, mlm_probability=0.15), callbacks=[Kill()],
    )


def child(args: argparse.Namespace) -> None:
    """One training process: ``--role reference|killed|resumed``."""
    from safetensors.torch import save_file

    run_dir = os.path.join(args.dir, "reference" if args.role == "reference" else "run")
    with open(os.path.join(args.dir, f"{args.role}.losses"), "w") as log:
        trainer = build(args, run_dir, log, args.kill_at if args.role == "killed" else None)
        trainer.train(resume_from_checkpoint=True if args.role == "resumed" else None)
    save_file({k: v.contiguous() for k, v in trainer.model.state_dict().items() if k != "lm_head.weight"},
              os.path.join(args.dir, f"{args.role}.safetensors"))


def losses(path: str) -> list[tuple[int, float]]:
    with open(path) as f:
        return [(step, float.fromhex(value)) for step, value in map(json.loads, f)]


def run_child(args: argparse.Namespace, role: str) -> int:
    cmd = [sys.executable, __file__, "--child", "--role", role, "--dir", args.dir, "--steps", str(args.steps),
           "--save-every", str(args.save_every), "--kill-at", str(args.kill_at)]
    return subprocess.run(cmd, check=False).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="runs/trainer-demo")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--kill-at", type=int, default=None, help="the step killed (default: random, mid-epoch)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--role", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return 0
    from safetensors.torch import load_file

    import statekit

    if args.kill_at is None:
        args.kill_at = random.Random().randrange(args.save_every + 1, args.steps - 2)
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    print(f"1. reference run to step {args.steps} (a fresh process)")
    if run_child(args, "reference") != 0:
        return 1
    print(f"2. the same run, killed with SIGKILL at step {args.kill_at}")
    code = run_child(args, "killed")
    print(f"   exit status {code} (-9: SIGKILL)")
    print("3. a new process: trainer.train(resume_from_checkpoint=True)")
    if run_child(args, "resumed") != 0:
        return 1
    reference = losses(os.path.join(args.dir, "reference.losses"))
    resumed = losses(os.path.join(args.dir, "resumed.losses"))
    start = resumed[0][0]
    same_losses = resumed == [entry for entry in reference if entry[0] >= start]
    a = load_file(os.path.join(args.dir, "reference.safetensors"))
    b = load_file(os.path.join(args.dir, "resumed.safetensors"))
    same_weights = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    checkpoint = os.path.join(args.dir, "run", f"checkpoint-{start}")
    run_dir = os.path.join(args.dir, "run")
    newest = statekit.CheckpointManager({}, run_dir, step_digits=0).list()[-1]
    print()
    print(f"resumed from        {checkpoint} (the newest committed checkpoint before step {args.kill_at})")
    print(f"checkpoint files    {', '.join(sorted(os.listdir(checkpoint)))}")
    print(f"pickle files        {[n for n in os.listdir(checkpoint) if n.endswith(('.bin', '.pt', '.pth'))] or 'none'}")
    audit = newest.resume_audit or {}
    print(f"resume audit        {audit.get('verdict', 'n/a')} (recorded in {os.path.basename(newest.url)})")
    print(f"micro-batch losses  {len(resumed)} after the resume: {'identical' if same_losses else 'DIFFERENT'} to the reference")
    print(f"final weights       {'identical' if same_weights else 'DIFFERENT'} (bit for bit)")
    ok = same_losses and same_weights
    print("RESULT: exact resume" if ok else "RESULT: the resume is NOT exact")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
