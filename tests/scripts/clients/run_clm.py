"""A reproduction of transformers' ``examples/pytorch/language-modeling/run_clm.py``
(huggingface/transformers at 00d481d18f914b55e65faa31e82321629691eadb, ``check_min_version
("4.57.0.dev0")``), written for statekit's tests: the same calls, in the same order; no code of
theirs. The one documented change is ``Trainer`` -> ``statekit_transformers.StatekitTrainer``
(``--statekit trainer``; docs/plugins/transformers.md).

What it keeps, as upstream does it: ``HfArgumentParser((ModelArguments, DataTrainingArguments,
TrainingArguments))``; ``set_seed(training_args.seed)`` before anything; ``load_dataset("text",
data_files=..., keep_linebreaks=...)`` (a ``validation_split_percentage`` split when there is no
validation file); ``AutoConfig`` / ``AutoTokenizer`` / ``AutoModelForCausalLM.from_pretrained``
(embeddings resized only when the tokenizer is larger); tokenization and ``group_texts`` with
``datasets.map`` under ``training_args.main_process_first``; the block size from the tokenizer and
``max_position_embeddings``; ``--max_train_samples``; ``Trainer(model, args, train_dataset,
eval_dataset, processing_class=tokenizer, data_collator=default_data_collator, ...)``;
``trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)`` (a path: Trainer
resumes from that ``checkpoint-<n>``), ``save_model``, ``log_metrics`` / ``save_metrics`` /
``save_state``; with ``--do_eval`` ``evaluate()`` and the perplexity.

What differs: a tiny GPT-2 and a word-level tokenizer from a folder the tests write, two small
text files; no streaming, hub or model card; the ``--do_eval`` accuracy is computed here
(``evaluate.load("accuracy")`` downloads its metric). Added by ``_harness``: ``--statekit
{off,trainer}``, ``--stop_after_steps`` (a callback SIGKILLs the process when step N+1 begins:
after step N's log and checkpoint), ``harness_log.jsonl`` (the loss Trainer logs for each
logging step, exactly), ``final_state.*`` (at ``on_train_end``).
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field
from itertools import chain
from typing import Optional

import numpy as np
import torch
from datasets import load_dataset
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    HfArgumentParser,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    default_data_collator,
    set_seed,
)

import _harness


@dataclass
class ModelArguments:
    model_name_or_path: Optional[str] = field(default=None)
    config_name: Optional[str] = field(default=None)
    tokenizer_name: Optional[str] = field(default=None)
    cache_dir: Optional[str] = field(default=None)
    use_fast_tokenizer: bool = field(default=True)
    model_revision: str = field(default="main")
    trust_remote_code: bool = field(default=False)
    dtype: Optional[str] = field(default=None, metadata={"choices": ["auto", "bfloat16", "float16", "float32"]})


@dataclass
class DataTrainingArguments:
    train_file: Optional[str] = field(default=None)
    validation_file: Optional[str] = field(default=None)
    max_train_samples: Optional[int] = field(default=None)
    max_eval_samples: Optional[int] = field(default=None)
    block_size: Optional[int] = field(default=None)
    overwrite_cache: bool = field(default=False)
    validation_split_percentage: Optional[int] = field(default=5)
    preprocessing_num_workers: Optional[int] = field(default=None)
    keep_linebreaks: bool = field(default=True)


@dataclass
class HarnessArguments:
    statekit: str = field(default="off", metadata={"choices": ["off", "trainer"]})
    stop_after_steps: Optional[int] = field(default=None)


class HarnessCallback(TrainerCallback):
    def __init__(self, harness):
        self.harness = harness

    def on_train_begin(self, args, state, control, **kwargs):
        if state.global_step:
            self.harness.resumed(f"checkpoint-{state.global_step}", state.global_step)

    def on_step_begin(self, args, state, control, **kwargs):
        self.harness.step_done(state.global_step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.harness.loss(state.global_step, logs["loss"], epoch=logs.get("epoch"))

    def on_train_end(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        self.harness.final({**_harness.module_tensors(model, "model"), **_harness.optimizer_tensors(optimizer)},
                           {"global_step": state.global_step, "lr_scheduler": lr_scheduler.state_dict()})


def main():
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments, HarnessArguments))
    model_args, data_args, training_args, harness_args = parser.parse_args_into_dataclasses()
    harness = _harness.Harness(training_args.output_dir, harness_args)

    set_seed(training_args.seed)

    data_files, dataset_args = {}, {}
    if data_args.train_file is not None:
        data_files["train"] = data_args.train_file
    if data_args.validation_file is not None:
        data_files["validation"] = data_args.validation_file
    extension = (data_args.train_file or data_args.validation_file).split(".")[-1]
    if extension == "txt":
        extension = "text"
        dataset_args["keep_linebreaks"] = data_args.keep_linebreaks
    raw_datasets = load_dataset(extension, data_files=data_files, cache_dir=model_args.cache_dir, **dataset_args)
    if "validation" not in raw_datasets:
        pct = data_args.validation_split_percentage
        raw_datasets["validation"] = load_dataset(extension, data_files=data_files, split=f"train[:{pct}%]",
                                                  cache_dir=model_args.cache_dir, **dataset_args)
        raw_datasets["train"] = load_dataset(extension, data_files=data_files, split=f"train[{pct}%:]",
                                             cache_dir=model_args.cache_dir, **dataset_args)

    common = {"cache_dir": model_args.cache_dir, "revision": model_args.model_revision,
              "trust_remote_code": model_args.trust_remote_code}
    config = AutoConfig.from_pretrained(model_args.config_name or model_args.model_name_or_path, **common)
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name or model_args.model_name_or_path,
                                              use_fast=model_args.use_fast_tokenizer, **common)
    dtype = model_args.dtype if model_args.dtype in ["auto", None] else getattr(torch, model_args.dtype)
    model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path,
                                                 from_tf=".ckpt" in model_args.model_name_or_path, config=config,
                                                 dtype=dtype, **common)
    if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(len(tokenizer))

    column_names = list(raw_datasets["train" if training_args.do_train else "validation"].features)
    text_column_name = "text" if "text" in column_names else column_names[0]

    def tokenize_function(examples):
        return tokenizer(examples[text_column_name])

    with training_args.main_process_first(desc="dataset map tokenization"):
        tokenized_datasets = raw_datasets.map(tokenize_function, batched=True, num_proc=data_args.preprocessing_num_workers,
                                              remove_columns=column_names,
                                              load_from_cache_file=not data_args.overwrite_cache,
                                              desc="Running tokenizer on dataset")
    max_pos_embeddings = getattr(config, "max_position_embeddings", 1024)
    if data_args.block_size is None:
        block_size = tokenizer.model_max_length
        if block_size > max_pos_embeddings:
            block_size = min(1024, max_pos_embeddings) if max_pos_embeddings > 0 else 1024
    else:
        block_size = min(data_args.block_size, tokenizer.model_max_length)

    def group_texts(examples):
        concatenated = {k: list(chain(*examples[k])) for k in examples}
        total_length = len(concatenated[list(examples.keys())[0]])
        if total_length < block_size:
            raise ValueError(f"block_size of {block_size} is too big - use a value <={total_length}")
        total_length = (total_length // block_size) * block_size
        result = {k: [t[i: i + block_size] for i in range(0, total_length, block_size)] for k, t in concatenated.items()}
        result["labels"] = result["input_ids"].copy()
        return result

    with training_args.main_process_first(desc="grouping texts together"):
        lm_datasets = tokenized_datasets.map(group_texts, batched=True, num_proc=data_args.preprocessing_num_workers,
                                             load_from_cache_file=not data_args.overwrite_cache,
                                             desc=f"Grouping texts in chunks of {block_size}")

    train_dataset = eval_dataset = None
    if training_args.do_train:
        train_dataset = lm_datasets["train"]
        if data_args.max_train_samples is not None:
            train_dataset = train_dataset.select(range(min(len(train_dataset), data_args.max_train_samples)))
    if training_args.do_eval:
        eval_dataset = lm_datasets["validation"]
        if data_args.max_eval_samples is not None:
            eval_dataset = eval_dataset.select(range(min(len(eval_dataset), data_args.max_eval_samples)))

    def preprocess_logits_for_metrics(logits, labels):
        return (logits[0] if isinstance(logits, tuple) else logits).argmax(dim=-1)

    def compute_metrics(eval_preds):
        preds, labels = eval_preds
        labels, preds = labels[:, 1:].reshape(-1), preds[:, :-1].reshape(-1)
        return {"accuracy": float(np.mean(preds == labels))}

    trainer_cls = Trainer
    if harness_args.statekit == "trainer":
        from statekit_transformers import StatekitTrainer as trainer_cls
    trainer = trainer_cls(
        model=model, args=training_args, train_dataset=train_dataset, eval_dataset=eval_dataset,
        processing_class=tokenizer, data_collator=default_data_collator,
        compute_metrics=compute_metrics if training_args.do_eval else None,
        preprocess_logits_for_metrics=preprocess_logits_for_metrics if training_args.do_eval else None,
        callbacks=[HarnessCallback(harness)],
    )

    if training_args.do_train:
        train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        trainer.save_model()
        metrics = train_result.metrics
        metrics["train_samples"] = min(data_args.max_train_samples or len(train_dataset), len(train_dataset))
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()
    if training_args.do_eval:
        metrics = trainer.evaluate()
        metrics["eval_samples"] = min(data_args.max_eval_samples or len(eval_dataset), len(eval_dataset))
        try:
            metrics["perplexity"] = math.exp(metrics["eval_loss"])
        except OverflowError:
            metrics["perplexity"] = float("inf")
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)


if __name__ == "__main__":
    main()
