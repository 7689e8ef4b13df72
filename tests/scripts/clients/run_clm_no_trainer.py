"""A reproduction of transformers' ``examples/pytorch/language-modeling/run_clm_no_trainer.py``
(the version of ``check_min_version("4.57.0.dev0")``; huggingface/transformers is too large to
fetch here, so it was read from the unmodified fork evalstate/transformers at
2143f93a301ca3efb8a4f7e499ff515fb45bc016), written for statekit's tests: the same calls, in the
same order, with the same random draws; no code of theirs.

What it keeps, as upstream does it:
- ``Accelerator(gradient_accumulation_steps=...)``, ``set_seed``, ``load_dataset("text",
  data_files={"train", "validation"}, keep_linebreaks=...)``, ``AutoConfig`` / ``AutoTokenizer`` /
  ``AutoModelForCausalLM.from_pretrained`` (embeddings resized only when the tokenizer is larger),
  tokenization and ``group_texts`` into ``block_size`` chunks with ``datasets.map`` under
  ``main_process_first``, three ``random.sample`` indices logged (Python's generator);
- a shuffled train ``DataLoader`` and an eval ``DataLoader``, both with ``default_data_collator``;
  AdamW over two groups (``get_parameter_names`` without LayerNorm and the norm/bias patterns:
  weight decay; the rest: none); ``get_scheduler``; ``prepare(model, optimizer, train, eval,
  scheduler)``; ``max_train_steps`` and the epochs recomputed after ``prepare``;
- ``--checkpointing_steps N``: ``accelerator.save_state(output_dir/step_<completed_steps>)`` when
  ``completed_steps % N == 0`` on a sync step; ``epoch``: ``epoch_<i>`` after each epoch;
- ``--resume_from_checkpoint PATH`` (upstream has no ``latest`` here: its fallback branch cannot be
  reached): ``load_state(PATH)``; ``step_<n>``: ``resume_step = n * gradient_accumulation_steps``
  micro-batches, ``starting_epoch = resume_step // len(train_dataloader)``, ``completed_steps =
  resume_step // gradient_accumulation_steps``, ``resume_step -= starting_epoch * len(...)``; the first
  epoch iterates ``accelerator.skip_first_batches(train_dataloader, resume_step)``;
- per micro-batch inside ``accelerator.accumulate(model)``: forward (dropout draws), backward,
  ``optimizer.step``, ``lr_scheduler.step``, ``zero_grad`` (Accelerate skips the step between sync
  steps); ``break`` at ``max_train_steps``; at each epoch end the eval loader is iterated under
  ``no_grad`` (``gather_for_metrics``) for the perplexity;
- at the end: ``save_pretrained(output_dir, save_function=accelerator.save)``, the tokenizer, and
  ``all_results.json``.

What differs: a tiny GPT-2 and a word-level tokenizer from a folder the tests write, two small
text files; no trackers, progress bar or hub upload. Added by ``_harness``: ``--statekit``,
``--stop_after_steps``, ``harness_log.jsonl`` (the loss of each micro-batch), ``final_state.*``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
from itertools import chain

import torch
from accelerate import Accelerator, DistributedType
from accelerate.utils import set_seed
from datasets import load_dataset
from torch import nn
from torch.utils.data import DataLoader
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, SchedulerType, default_data_collator, get_scheduler
from transformers.trainer_pt_utils import get_parameter_names

import _harness


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="run_clm_no_trainer.py, reproduced for statekit's tests")
    p.add_argument("--train_file", required=True)
    p.add_argument("--validation_file", default=None)
    p.add_argument("--validation_split_percentage", default=5)
    p.add_argument("--model_name_or_path", required=True)
    p.add_argument("--config_name", default=None)
    p.add_argument("--tokenizer_name", default=None)
    p.add_argument("--use_slow_tokenizer", action="store_true")
    p.add_argument("--per_device_train_batch_size", type=int, default=8)
    p.add_argument("--per_device_eval_batch_size", type=int, default=8)
    p.add_argument("--learning_rate", type=float, default=5e-5)
    p.add_argument("--weight_decay", type=float, default=0.0)
    p.add_argument("--num_train_epochs", type=int, default=3)
    p.add_argument("--max_train_steps", type=int, default=None)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--lr_scheduler_type", type=SchedulerType, default="linear")
    p.add_argument("--num_warmup_steps", type=int, default=0)
    p.add_argument("--output_dir", default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--block_size", type=int, default=None)
    p.add_argument("--preprocessing_num_workers", type=int, default=None)
    p.add_argument("--overwrite_cache", action="store_true")
    p.add_argument("--no_keep_linebreaks", action="store_true")
    p.add_argument("--trust_remote_code", action="store_true")
    p.add_argument("--checkpointing_steps", type=str, default=None)
    p.add_argument("--resume_from_checkpoint", type=str, default=None)
    _harness.add_arguments(p)
    return p.parse_args(argv)


def main(args):
    harness = _harness.Harness(args.output_dir, args)
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
    harness.attach(accelerator, "init")
    if args.seed is not None:
        set_seed(args.seed)
    if accelerator.is_main_process and args.output_dir is not None:
        os.makedirs(args.output_dir, exist_ok=True)
    accelerator.wait_for_everyone()

    data_files, dataset_args = {"train": args.train_file}, {}
    extension = args.train_file.split(".")[-1]
    if args.validation_file is not None:
        data_files["validation"] = args.validation_file
        extension = args.validation_file.split(".")[-1]
    if extension == "txt":
        extension = "text"
        dataset_args["keep_linebreaks"] = not args.no_keep_linebreaks
    raw_datasets = load_dataset(extension, data_files=data_files, **dataset_args)
    if "validation" not in raw_datasets:
        pct = args.validation_split_percentage
        raw_datasets["validation"] = load_dataset(extension, data_files=data_files, split=f"train[:{pct}%]", **dataset_args)
        raw_datasets["train"] = load_dataset(extension, data_files=data_files, split=f"train[{pct}%:]", **dataset_args)

    config = AutoConfig.from_pretrained(args.config_name or args.model_name_or_path,
                                        trust_remote_code=args.trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name or args.model_name_or_path,
                                              use_fast=not args.use_slow_tokenizer,
                                              trust_remote_code=args.trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, from_tf=".ckpt" in args.model_name_or_path,
                                                 config=config, trust_remote_code=args.trust_remote_code)
    if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(len(tokenizer))

    column_names = raw_datasets["train"].column_names
    text_column_name = "text" if "text" in column_names else column_names[0]

    def tokenize_function(examples):
        return tokenizer(examples[text_column_name])

    with accelerator.main_process_first():
        tokenized_datasets = raw_datasets.map(tokenize_function, batched=True, num_proc=args.preprocessing_num_workers,
                                              remove_columns=column_names, load_from_cache_file=not args.overwrite_cache,
                                              desc="Running tokenizer on dataset")

    if args.block_size is None:
        block_size = tokenizer.model_max_length
        if block_size > config.max_position_embeddings:
            block_size = min(1024, config.max_position_embeddings)
    else:
        block_size = min(args.block_size, tokenizer.model_max_length)

    def group_texts(examples):
        concatenated = {k: list(chain(*examples[k])) for k in examples}
        total_length = len(concatenated[list(examples.keys())[0]])
        total_length = (total_length // block_size) * block_size
        result = {k: [t[i: i + block_size] for i in range(0, total_length, block_size)] for k, t in concatenated.items()}
        result["labels"] = result["input_ids"].copy()
        return result

    with accelerator.main_process_first():
        lm_datasets = tokenized_datasets.map(group_texts, batched=True, num_proc=args.preprocessing_num_workers,
                                             load_from_cache_file=not args.overwrite_cache,
                                             desc=f"Grouping texts in chunks of {block_size}")
    train_dataset, eval_dataset = lm_datasets["train"], lm_datasets["validation"]
    for index in random.sample(range(len(train_dataset)), 3):
        print(f"Sample {index} of the training set: {train_dataset[index]}.")

    train_dataloader = DataLoader(train_dataset, shuffle=True, collate_fn=default_data_collator,
                                  batch_size=args.per_device_train_batch_size)
    eval_dataloader = DataLoader(eval_dataset, collate_fn=default_data_collator, batch_size=args.per_device_eval_batch_size)

    forbidden_name_patterns = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]
    decay_parameters = get_parameter_names(model, [nn.LayerNorm], forbidden_layer_names=forbidden_name_patterns)
    optimizer = torch.optim.AdamW([
        {"params": [p for n, p in model.named_parameters() if n in decay_parameters and p.requires_grad],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if n not in decay_parameters and p.requires_grad],
         "weight_decay": 0.0},
    ], lr=args.learning_rate)

    overrode_max_train_steps = False
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    if args.max_train_steps is None:
        args.max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
        overrode_max_train_steps = True
    lr_scheduler = get_scheduler(
        name=args.lr_scheduler_type, optimizer=optimizer, num_warmup_steps=args.num_warmup_steps * accelerator.num_processes,
        num_training_steps=args.max_train_steps if overrode_max_train_steps else args.max_train_steps * accelerator.num_processes,
    )

    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)
    harness.attach(accelerator, "prepare")
    if accelerator.distributed_type == DistributedType.XLA:
        model.tie_weights()

    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    if overrode_max_train_steps:
        args.max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
    args.num_train_epochs = math.ceil(args.max_train_steps / num_update_steps_per_epoch)

    checkpointing_steps = args.checkpointing_steps
    if checkpointing_steps is not None and checkpointing_steps.isdigit():
        checkpointing_steps = int(checkpointing_steps)

    completed_steps = 0
    starting_epoch = 0
    if args.resume_from_checkpoint:
        checkpoint_path = args.resume_from_checkpoint
        path = os.path.basename(checkpoint_path)
        accelerator.print(f"Resumed from checkpoint: {checkpoint_path}")
        accelerator.load_state(checkpoint_path)
        training_difference = os.path.splitext(path)[0]
        if "epoch" in training_difference:
            starting_epoch = int(training_difference.replace("epoch_", "")) + 1
            resume_step = None
            completed_steps = starting_epoch * num_update_steps_per_epoch
        else:
            resume_step = int(training_difference.replace("step_", "")) * args.gradient_accumulation_steps
            starting_epoch = resume_step // len(train_dataloader)
            completed_steps = resume_step // args.gradient_accumulation_steps
            resume_step -= starting_epoch * len(train_dataloader)
        harness.resumed(path, completed_steps)

    for epoch in range(starting_epoch, args.num_train_epochs):
        model.train()
        if args.resume_from_checkpoint and epoch == starting_epoch and resume_step is not None:
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
        else:
            active_dataloader = train_dataloader
        for step, batch in enumerate(active_dataloader):
            with accelerator.accumulate(model):
                outputs = model(**batch)
                loss = outputs.loss
                accelerator.backward(loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                completed_steps += 1
            if isinstance(checkpointing_steps, int):
                if completed_steps % checkpointing_steps == 0 and accelerator.sync_gradients:
                    output_dir = f"step_{completed_steps}"
                    if args.output_dir is not None:
                        output_dir = os.path.join(args.output_dir, output_dir)
                    accelerator.save_state(output_dir)
            harness.loss(completed_steps if accelerator.sync_gradients else completed_steps + 1, loss.detach().item(),
                         epoch=epoch)
            if accelerator.sync_gradients:
                harness.step_done(completed_steps)
            if completed_steps >= args.max_train_steps:
                break

        model.eval()
        losses = []
        for step, batch in enumerate(eval_dataloader):
            with torch.no_grad():
                outputs = model(**batch)
            loss = outputs.loss
            losses.append(accelerator.gather_for_metrics(loss.repeat(batch["input_ids"].shape[0])))
        losses = torch.cat(losses)
        try:
            eval_loss = torch.mean(losses)
            perplexity = math.exp(eval_loss)
        except OverflowError:
            perplexity = float("inf")
        print(f"epoch {epoch}: perplexity: {perplexity} eval_loss: {eval_loss}")
        harness.loss(completed_steps, float(eval_loss), epoch=epoch, kind="eval")

        if args.checkpointing_steps == "epoch":
            output_dir = f"epoch_{epoch}"
            if args.output_dir is not None:
                output_dir = os.path.join(args.output_dir, output_dir)
            accelerator.save_state(output_dir)

    harness.final({**_harness.module_tensors(accelerator.unwrap_model(model), "model"),
                   **_harness.optimizer_tensors(optimizer)},
                  {"completed_steps": completed_steps, "lr_scheduler": lr_scheduler.state_dict()})
    if args.output_dir is not None:
        accelerator.wait_for_everyone()
        unwrapped_model = accelerator.unwrap_model(model)
        unwrapped_model.save_pretrained(args.output_dir, is_main_process=accelerator.is_main_process,
                                        save_function=accelerator.save)
        if accelerator.is_main_process:
            tokenizer.save_pretrained(args.output_dir)
            with open(os.path.join(args.output_dir, "all_results.json"), "w") as f:
                json.dump({"perplexity": perplexity}, f)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main(parse_args())
