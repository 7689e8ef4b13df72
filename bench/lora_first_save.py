"""Benchmark: the bytes the first checkpoint of a LoRA fine-tune writes (issue 47, part 2;
docs/export.md, "A frozen base is referenced").

A GPT-2 built from a config (``--layers`` blocks of width 2048, vocabulary 8,000: about
``--layers`` x 201 MiB + 70 MiB of fp32 weights; the default 5 is 1.05 GiB) is written with
``save_pretrained`` to a pretrained folder and loaded back with ``from_pretrained``; peft
wraps it with a LoRA adapter (rank ``--rank`` on ``c_attn``, ``c_proj``, ``c_fc``); one
AdamW step. Then, in the same process, one checkpoint each way:

- **statekit, referenced** (the default): ``CheckpointManager.save``; the base is
  referenced in the pretrained folder, not written (the first save reads the folder's
  tensors once to checksum them; the second, timed too, only checksums the live ones);
- **statekit, written** (``statekit.reference_pretrained(model, None)``): the whole model;
- **torch.save** of ``{"model": state_dict, "optimizer": state_dict}`` (the usual by-hand checkpoint).

Printed: bytes on disk of each checkpoint, their ratio to the adapter + optimizer state
(the LoRA parameters' bytes and AdamW's two moments and steps), and the save's wall time.
The target: referenced <= 1.05x adapter + optimizer bytes.

Usage::

    python bench/lora_first_save.py                 # 1 GiB base
    python bench/lora_first_save.py --layers 1      # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import torch


def folder_bytes(path: str) -> int:
    """Bytes of every file under ``path``."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def build(workdir: str, layers: int, rank: int):
    """The pretrained folder, the LoRA model loaded from it, its optimizer after one step."""
    import peft
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=layers, n_embd=2048, n_head=16, vocab_size=8000, n_positions=256,
                        bos_token_id=0, eos_token_id=0)
    folder = os.path.join(workdir, "pretrained")
    GPT2LMHeadModel(config).save_pretrained(folder)
    base = GPT2LMHeadModel.from_pretrained(folder)
    model = peft.get_peft_model(base, peft.LoraConfig(r=rank, target_modules=["c_attn", "c_proj", "c_fc"],
                                                       fan_in_fan_out=True))
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, 8000, (2, 32))
    model(input_ids=ids, labels=ids).loss.backward()
    optim.step()
    optim.zero_grad()
    return folder, model, optim


def adapter_and_optimizer_bytes(model, optim) -> int:
    """The LoRA parameters' bytes plus every tensor of the optimizer's state."""
    adapter = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    state = sum(t.numel() * t.element_size() for s in optim.state.values() for t in s.values() if isinstance(t, torch.Tensor))
    return adapter + state


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", help="write the results to this file")
    args = ap.parse_args()
    import statekit

    workdir = tempfile.mkdtemp(prefix="statekit-lora-", dir=args.workdir)
    try:
        folder, model, optim = build(workdir, args.layers, args.rank)
        target = adapter_and_optimizer_bytes(model, optim)
        base = folder_bytes(folder)
        rows = {}
        root = os.path.join(workdir, "referenced")
        manager = statekit.CheckpointManager({"model": model, "optim": optim}, root)
        seconds = timed(lambda: (manager.save(1), manager.wait()))
        ckpt = os.path.join(root, "checkpoint-00000001")
        refs = statekit.verify(ckpt).references or {}
        rows["statekit, referenced"] = (folder_bytes(ckpt), seconds)
        seconds = timed(lambda: (manager.save(2), manager.wait()))  # the base's checksums are cached now
        rows["statekit, referenced, second save"] = (folder_bytes(os.path.join(root, "checkpoint-00000002")), seconds)
        statekit.reference_pretrained(model, None)
        root = os.path.join(workdir, "written")
        manager = statekit.CheckpointManager({"model": model, "optim": optim}, root)
        seconds = timed(lambda: (manager.save(1), manager.wait()))
        rows["statekit, written"] = (folder_bytes(os.path.join(root, "checkpoint-00000001")), seconds)
        path = os.path.join(workdir, "torch.pt")
        seconds = timed(lambda: torch.save({"model": model.state_dict(), "optimizer": optim.state_dict()}, path))
        rows["torch.save"] = (os.path.getsize(path), seconds)
        print(f"base (pretrained folder): {base / 2**20:.1f} MiB; adapter + optimizer state: {target / 2**20:.2f} MiB; "
              f"referenced tensors: {sum(len(r.tensors) for r in refs.values())}")
        print("| checkpoint | bytes on disk | / adapter + optimizer | save s |")
        print("|---|---|---|---|")
        for name, (nbytes, secs) in rows.items():
            print(f"| {name} | {nbytes / 2**20:.2f} MiB | {nbytes / target:.3f}x | {secs:.2f} |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"base_bytes": base, "adapter_optimizer_bytes": target,
                           "rows": {k: {"bytes": b, "seconds": s} for k, (b, s) in rows.items()}}, f, indent=1)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
