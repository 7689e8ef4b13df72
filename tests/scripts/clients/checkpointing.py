"""A reproduction of Accelerate's ``examples/by_feature/checkpointing.py``
(huggingface/accelerate at 16cb6eb80dd9aa8b4df1a63ef57863e455d53b83), written for statekit's
tests: the same calls, in the same order, with the same random draws; no code of theirs.

What it keeps, as upstream does it:
- ``Accelerator(cpu=, mixed_precision=, dataloader_config=DataLoaderConfiguration(
  use_stateful_dataloader=...))``, then ``set_seed(seed)``, then the loaders: the sentence pairs
  tokenized with ``datasets.map`` under ``main_process_first`` (``idx``, ``sentence1``,
  ``sentence2`` removed, ``label`` renamed ``labels``), a shuffled train ``DataLoader`` and an
  eval ``DataLoader`` whose collate pads to the longest with ``tokenizer.pad``;
- gradient accumulation the example's way: ``batch_size // MAX_GPU_BATCH_SIZE`` micro-batches
  when the batch is larger than that, the loss divided, ``optimizer.step`` when ``step %
  gradient_accumulation_steps == 0`` (no ``accelerator.accumulate``);
- the model moved to the device, AdamW, ``get_linear_schedule_with_warmup(100 warm-up steps)``,
  ``prepare(model, optimizer, train, eval, scheduler)``;
- ``--checkpointing_steps N``: ``save_state(output_dir/step_<overall_step>)`` after the micro-batch
  (``overall_step`` counts micro-batches); ``epoch``: ``epoch_<i>`` after the epoch's evaluation;
- ``--resume_from_checkpoint PATH``: ``load_state(PATH)``; ``step_<n>``: ``starting_epoch = n //
  len(train_dataloader)``, ``resume_step = n - starting_epoch * len(...)``; the first epoch iterates
  ``accelerator.skip_first_batches(train_dataloader, resume_step)`` (the loader itself with
  ``--use_stateful_dataloader``) and ``overall_step += resume_step`` (only the epoch's part, as
  upstream: a resume in a later epoch names its next checkpoints from the epoch's start);
- at each epoch end the eval loader is iterated (``gather_for_metrics``) for the metric.

What differs: a tiny BERT (``--model_name_or_path``) and a word-level tokenizer from a folder the
tests write instead of ``bert-base-cased``; local JSON lines with GLUE MRPC's columns
(``--data_dir``) instead of ``load_dataset("nyu-mll/glue", "mrpc")``; accuracy computed here
instead of ``evaluate.load("glue", "mrpc")`` (both download); the example's fixed ``config`` and
``MAX_GPU_BATCH_SIZE`` take flags (``--lr``, ``--num_epochs``, ``--seed``, ``--batch_size``,
``--max_gpu_batch_size``). Added by ``_harness``: ``--statekit``, ``--stop_after_steps``,
``harness_log.jsonl`` (keyed by the micro-batch's index in the run, which a resume does not
restart), ``final_state.*``.
"""

from __future__ import annotations

import argparse
import os

import torch
from accelerate import Accelerator, DataLoaderConfiguration, DistributedType
from accelerate.utils import set_seed
from datasets import load_dataset
from torch.optim import AdamW
from torch.utils.data import DataLoader
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup

import _harness

EVAL_BATCH_SIZE = 32


def get_dataloaders(accelerator, args, batch_size):
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    datasets = load_dataset("json", data_files={"train": os.path.join(args.data_dir, "train.jsonl"),
                                                "validation": os.path.join(args.data_dir, "validation.jsonl")})

    def tokenize_function(examples):
        return tokenizer(examples["sentence1"], examples["sentence2"], truncation=True, max_length=None)

    with accelerator.main_process_first():
        tokenized = datasets.map(tokenize_function, batched=True, remove_columns=["idx", "sentence1", "sentence2"])
    tokenized = tokenized.rename_column("label", "labels")

    def collate_fn(examples):
        max_length = 128 if accelerator.distributed_type == DistributedType.XLA else None
        if accelerator.mixed_precision == "fp8":
            pad_to_multiple_of = 16
        elif accelerator.mixed_precision != "no":
            pad_to_multiple_of = 8
        else:
            pad_to_multiple_of = None
        return tokenizer.pad(examples, padding="longest", max_length=max_length, pad_to_multiple_of=pad_to_multiple_of,
                             return_tensors="pt")

    train_dataloader = DataLoader(tokenized["train"], shuffle=True, collate_fn=collate_fn, batch_size=batch_size)
    eval_dataloader = DataLoader(tokenized["validation"], shuffle=False, collate_fn=collate_fn,
                                 batch_size=EVAL_BATCH_SIZE)
    return train_dataloader, eval_dataloader


def training_function(config, args):
    harness = _harness.Harness(args.output_dir, args)
    dataloader_config = DataLoaderConfiguration(use_stateful_dataloader=args.use_stateful_dataloader)
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision, dataloader_config=dataloader_config)
    harness.attach(accelerator, "init")
    lr, num_epochs, seed, batch_size = config["lr"], int(config["num_epochs"]), int(config["seed"]), int(config["batch_size"])

    if hasattr(args.checkpointing_steps, "isdigit"):
        if args.checkpointing_steps == "epoch":
            checkpointing_steps = args.checkpointing_steps
        elif args.checkpointing_steps.isdigit():
            checkpointing_steps = int(args.checkpointing_steps)
        else:
            raise ValueError(f"`checkpointing_steps` must be a number or `epoch`, not `{args.checkpointing_steps}`.")
    else:
        checkpointing_steps = None

    set_seed(seed)
    train_dataloader, eval_dataloader = get_dataloaders(accelerator, args, batch_size)

    gradient_accumulation_steps = 1
    if batch_size > args.max_gpu_batch_size and accelerator.distributed_type != DistributedType.XLA:
        gradient_accumulation_steps = batch_size // args.max_gpu_batch_size
        batch_size = args.max_gpu_batch_size

    model = AutoModelForSequenceClassification.from_pretrained(args.model_name_or_path, return_dict=True)
    model = model.to(accelerator.device)
    optimizer = AdamW(params=model.parameters(), lr=lr)
    lr_scheduler = get_linear_schedule_with_warmup(
        optimizer=optimizer, num_warmup_steps=100,
        num_training_steps=(len(train_dataloader) * num_epochs) // gradient_accumulation_steps,
    )
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)
    harness.attach(accelerator, "prepare")

    overall_step = 0
    starting_epoch = 0
    resume_step = None
    if args.resume_from_checkpoint:
        accelerator.print(f"Resumed from checkpoint: {args.resume_from_checkpoint}")
        accelerator.load_state(args.resume_from_checkpoint)
        path = os.path.basename(args.resume_from_checkpoint)
        training_difference = os.path.splitext(path)[0]
        if "epoch" in training_difference:
            starting_epoch = int(training_difference.replace("epoch_", "")) + 1
            resume_step = None
        else:
            resume_step = int(training_difference.replace("step_", ""))
            starting_epoch = resume_step // len(train_dataloader)
            resume_step -= starting_epoch * len(train_dataloader)
        harness.resumed(path, starting_epoch * len(train_dataloader) + (resume_step or 0))

    for epoch in range(starting_epoch, num_epochs):
        model.train()
        offset = 0  # the harness's micro-batch index within the epoch starts here
        if args.resume_from_checkpoint and epoch == starting_epoch and resume_step is not None:
            if not args.use_stateful_dataloader:
                active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
            else:
                active_dataloader = train_dataloader
            overall_step += resume_step
            offset = resume_step
        else:
            active_dataloader = train_dataloader
        for step, batch in enumerate(active_dataloader):
            batch.to(accelerator.device)
            outputs = model(**batch)
            loss = outputs.loss / gradient_accumulation_steps
            accelerator.backward(loss)
            if step % gradient_accumulation_steps == 0:
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            overall_step += 1
            if isinstance(checkpointing_steps, int):
                output_dir = f"step_{overall_step}"
                if overall_step % checkpointing_steps == 0:
                    if args.output_dir is not None:
                        output_dir = os.path.join(args.output_dir, output_dir)
                    accelerator.save_state(output_dir)
            micro = epoch * len(train_dataloader) + offset + step + 1
            harness.loss(micro, loss.detach().item(), epoch=epoch, overall_step=overall_step)
            harness.step_done(micro)

        model.eval()
        correct = total = 0
        for step, batch in enumerate(eval_dataloader):
            batch.to(accelerator.device)
            with torch.no_grad():
                outputs = model(**batch)
            predictions = outputs.logits.argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
            correct += int((predictions == references).sum())
            total += int(references.numel())
        accelerator.print(f"epoch {epoch}:", {"accuracy": correct / total})
        harness.loss(epoch, correct / total, epoch=epoch, kind="eval")

        if checkpointing_steps == "epoch":
            output_dir = f"epoch_{epoch}"
            if args.output_dir is not None:
                output_dir = os.path.join(args.output_dir, output_dir)
            accelerator.save_state(output_dir)

    harness.final({**_harness.module_tensors(accelerator.unwrap_model(model), "model"),
                   **_harness.optimizer_tensors(optimizer)},
                  {"overall_step": overall_step, "lr_scheduler": lr_scheduler.state_dict()})
    accelerator.end_training()


def main():
    p = argparse.ArgumentParser(description="checkpointing.py, reproduced for statekit's tests")
    p.add_argument("--mixed_precision", default=None, choices=["no", "fp16", "bf16", "fp8"])
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--checkpointing_steps", type=str, default=None)
    p.add_argument("--output_dir", type=str, default=".")
    p.add_argument("--resume_from_checkpoint", type=str, default=None)
    p.add_argument("--use_stateful_dataloader", action="store_true")
    p.add_argument("--model_name_or_path", required=True)
    p.add_argument("--data_dir", required=True)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--num_epochs", type=int, default=3)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--max_gpu_batch_size", type=int, default=16)
    _harness.add_arguments(p)
    args = p.parse_args()
    config = {"lr": args.lr, "num_epochs": args.num_epochs, "seed": args.seed, "batch_size": args.batch_size}
    training_function(config, args)


if __name__ == "__main__":
    main()
