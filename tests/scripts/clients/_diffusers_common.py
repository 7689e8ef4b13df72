"""Pieces that diffusers' training scripts (huggingface/diffusers at
58eb52c0803ea9af3abec60841c2a093bdf1f951) write out identically in each script, written once
here for the reproductions (same calls, same order, same draws; no code of theirs):

- :func:`checkpoint_dirs`: the ``checkpoint*`` folders of the output dir sorted by the number
  after the dash (what ``--resume_from_checkpoint latest`` and the deletion both use);
- :func:`prune_checkpoints`: ``--checkpoints_total_limit``: before a save, when ``limit`` or more
  checkpoints exist, the oldest ``len - limit + 1`` are removed with ``shutil.rmtree``;
- :func:`checkpoint_to_resume`: ``"latest"`` -> the last of :func:`checkpoint_dirs` (or None),
  any other value -> its basename;
- :func:`captioned_images`: the ``imagefolder`` + captions pipeline of ``train_text_to_image.py``
  and ``train_text_to_image_lora.py``: ``load_dataset("imagefolder", data_files={"train":
  dir/**})``, the image and caption columns checked, captions tokenized to the tokenizer's
  ``model_max_length`` (a list of captions: ``random.choice`` of Python's generator), the
  transforms (Resize with ``--image_interpolation_mode``, CenterCrop or RandomCrop, an optional
  RandomHorizontalFlip, ToTensor, Normalize), ``with_transform`` under ``main_process_first``
  (``--max_train_samples``: ``shuffle(seed).select``), and the collate function.
"""

from __future__ import annotations

import os
import random
import shutil

import numpy as np
import torch

import _tv

INTERPOLATION = {"bilinear": 2, "bicubic": 3, "lanczos": 1, "nearest": 0}  # PIL's resampling codes


def checkpoint_dirs(output_dir):
    names = [d for d in os.listdir(output_dir) if d.startswith("checkpoint")]
    return sorted(names, key=lambda d: int(d.split("-")[1]))


def prune_checkpoints(output_dir, limit):
    if limit is None:
        return
    existing = checkpoint_dirs(output_dir)
    if len(existing) >= limit:
        for name in existing[: len(existing) - limit + 1]:
            shutil.rmtree(os.path.join(output_dir, name))


def checkpoint_to_resume(resume_from_checkpoint, output_dir):
    if resume_from_checkpoint != "latest":
        return os.path.basename(resume_from_checkpoint)
    dirs = checkpoint_dirs(output_dir)
    return dirs[-1] if dirs else None


def captioned_images(args, tokenizer, accelerator):
    """``(train_dataset, collate_fn)`` as the two text-to-image scripts build them."""
    from datasets import load_dataset

    dataset = load_dataset("imagefolder", data_files={"train": os.path.join(args.train_data_dir, "**")},
                           cache_dir=args.cache_dir)
    column_names = dataset["train"].column_names
    image_column, caption_column = args.image_column, args.caption_column
    for column in (image_column, caption_column):
        if column not in column_names:
            raise ValueError(f"'{column}' needs to be one of: {', '.join(column_names)}")

    def tokenize_captions(examples, is_train=True):
        captions = []
        for caption in examples[caption_column]:
            if isinstance(caption, str):
                captions.append(caption)
            elif isinstance(caption, (list, np.ndarray)):
                captions.append(random.choice(caption) if is_train else caption[0])
            else:
                raise ValueError(f"Caption column `{caption_column}` should contain strings or lists of strings.")
        return tokenizer(captions, max_length=tokenizer.model_max_length, padding="max_length", truncation=True,
                         return_tensors="pt").input_ids

    train_transforms = _tv.Compose([
        _tv.Resize(args.resolution, interpolation=INTERPOLATION[args.image_interpolation_mode]),
        _tv.CenterCrop(args.resolution) if args.center_crop else _tv.RandomCrop(args.resolution),
        _tv.RandomHorizontalFlip() if args.random_flip else _tv.identity,
        _tv.to_tensor,
        _tv.normalize_half,
    ])

    def preprocess_train(examples):
        images = [image.convert("RGB") for image in examples[image_column]]
        examples["pixel_values"] = [train_transforms(image) for image in images]
        examples["input_ids"] = tokenize_captions(examples)
        return examples

    with accelerator.main_process_first():
        if args.max_train_samples is not None:
            dataset["train"] = dataset["train"].shuffle(seed=args.seed).select(range(args.max_train_samples))
        train_dataset = dataset["train"].with_transform(preprocess_train)

    def collate_fn(examples):
        pixel_values = torch.stack([e["pixel_values"] for e in examples]).to(memory_format=torch.contiguous_format).float()
        return {"pixel_values": pixel_values, "input_ids": torch.stack([e["input_ids"] for e in examples])}

    return train_dataset, collate_fn
