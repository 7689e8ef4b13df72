"""transformers' Trainer with statekit-transformers against Trainer alone, on the same run (issue 36).

A small GPT-2 from a config (4 layers, 256 wide, 8,000-token vocabulary: 6.3 M parameters,
about 76 MB of checkpoint with AdamW's state), random token sentences, CPU, saves every
``--save-every`` steps. Three models, each trained by ``transformers.Trainer`` and by
``StatekitTrainer`` in the same process, alternating, ``--rounds`` times:

- ``full``: every parameter trainable;
- ``frozen embedding``: the (tied) token embedding frozen, 2 M of the parameters;
- ``LoRA``: peft LoRA (r=8) on the attention, the base frozen.

Printed per model: the median time of one checkpoint (``Trainer._save_checkpoint``, wall
clock, fsynced by statekit, not by Trainer), the bytes each checkpoint added to the disk
(statekit: the manifest's ``written_bytes``, files reused by hard link not counted; Trainer:
the folder's size), and the whole ``train()`` with its saves; statekit's time as a ratio of
Trainer's.

Usage::

    python bench/trainer.py [--steps 30] [--save-every 5] [--rounds 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

import torch

VOCAB = 8000


def model(kind: str) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    m = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=VOCAB, n_positions=64))
    if kind == "frozen embedding":
        m.transformer.wte.weight.requires_grad_(False)
    if kind == "LoRA":
        import peft

        m = peft.get_peft_model(m, peft.LoraConfig(r=8, target_modules=["c_attn"]))
    return m


class Sentences(torch.utils.data.Dataset):
    def __init__(self, n: int = 512, length: int = 64) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, VOCAB, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def one_run(kind: str, statekit_on: bool, args: argparse.Namespace, root: str) -> dict[str, Any]:
    from transformers import Trainer, TrainingArguments

    from statekit_transformers import StatekitTrainer

    times: list[float] = []
    base = StatekitTrainer if statekit_on else Trainer

    class Timed(base):
        def _save_checkpoint(self, m, trial):
            start = time.perf_counter()
            super()._save_checkpoint(m, trial)
            times.append(time.perf_counter() - start)

    out = os.path.join(root, f"{kind}-{'statekit' if statekit_on else 'trainer'}".replace(" ", "-"))
    shutil.rmtree(out, ignore_errors=True)
    targs = TrainingArguments(
        output_dir=out, per_device_train_batch_size=8, max_steps=args.steps, save_steps=args.save_every,
        learning_rate=1e-3, report_to=[], use_cpu=True, disable_tqdm=True, logging_steps=1000, seed=3,
    )
    trainer = Timed(model=model(kind), args=targs, train_dataset=Sentences())
    start = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - start
    folders = sorted((n for n in os.listdir(out) if n.startswith("checkpoint-")), key=lambda n: int(n.split("-")[1]))
    if statekit_on:
        import statekit

        manifests = [statekit.verify(os.path.join(out, n)) for n in folders]
        written = [m.written_bytes for m in manifests]
    else:
        written = [folder_bytes(os.path.join(out, n)) for n in folders]
    shutil.rmtree(out, ignore_errors=True)
    return {"save_s": statistics.median(times), "first_bytes": written[0], "later_bytes": statistics.median(written[1:]),
            "train_s": total}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the runs write (default: a temporary directory)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    root = args.dir or tempfile.mkdtemp(prefix="statekit-trainer-bench-")
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for _ in range(args.rounds):
        for kind in ("full", "frozen embedding", "LoRA"):
            for statekit_on in (False, True):
                entry = one_run(kind, statekit_on, args, root)
                results.setdefault(kind, {}).setdefault("statekit" if statekit_on else "trainer", []).append(entry)
    summary = {}
    print(f"{'model':18} {'':9} {'save (s)':>9} {'1st ckpt MB':>12} {'later ckpt MB':>14} {'train() s':>10}")
    for kind, sides in results.items():
        med = {side: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for side, runs in sides.items()}
        summary[kind] = med
        for side in ("trainer", "statekit"):
            m = med[side]
            print(f"{kind:18} {side:9} {m['save_s']:9.3f} {m['first_bytes'] / 1e6:12.2f} {m['later_bytes'] / 1e6:14.2f} {m['train_s']:10.2f}")
        t, s = med["trainer"], med["statekit"]
        print(f"{'':18} {'ratio':9} {s['save_s'] / t['save_s']:9.2f}x {s['first_bytes'] / t['first_bytes']:11.2f}x "
              f"{s['later_bytes'] / t['later_bytes']:13.2f}x {s['train_s'] / t['train_s']:9.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "summary": summary, "runs": results}, f, indent=1)
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
