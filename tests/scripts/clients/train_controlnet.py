"""A reproduction of diffusers' ``examples/controlnet/train_controlnet.py``
(huggingface/diffusers at 58eb52c0803ea9af3abec60841c2a093bdf1f951), written for statekit's
tests: the same calls, in the same order, with the same random draws; no code of theirs.

What it keeps, as upstream does it:
- tokenizer (``AutoTokenizer``, ``use_fast=False``), text encoder (class from its config),
  scheduler, VAE and UNet loaded from ``--pretrained_model_name_or_path``; the ControlNet built
  with ``ControlNetModel.from_unet(unet)`` (its zero convolutions and conditioning embedding are
  new weights, drawn from torch's generator);
- the pre-hooks, registered before ``prepare``: the save hook (main process only) walks
  ``weights`` from its end, ``weights.pop()`` then ``models[i].save_pretrained(output_dir/controlnet)``
  while ``weights`` is not empty; the load hook pops every model and loads
  ``ControlNetModel.from_pretrained(input_dir, subfolder="controlnet")`` into it
  (``register_to_config`` + ``load_state_dict``);
- the data: ``load_dataset(train_data_dir)`` (here a folder with a parquet file), the image,
  caption and conditioning columns, captions tokenized with an empty prompt when
  ``random.random() < --proportion_empty_prompts`` (one draw of Python's generator per caption,
  whatever the proportion), Resize + CenterCrop + ToTensor (+ Normalize for the image), a
  shuffled ``DataLoader``;
- the step arithmetic, ``--resume_from_checkpoint latest`` with ``first_epoch`` and no skip (the
  resumed epoch restarts from its first batch); per micro-batch inside ``accumulate(controlnet)``:
  VAE sample, ``randn_like`` noise, ``randint`` timesteps, ``add_noise``, the text encoder, the
  ControlNet's residuals into the frozen UNet, MSE, backward, ``clip_grad_norm_`` of
  ``controlnet.parameters()`` on sync steps, step, schedule, ``zero_grad(set_to_none=
  --set_grads_to_none)``; then (main process) the checkpoint deletion and ``save_state``;
  ``break`` at ``max_train_steps``;
- at the end: ``controlnet.save_pretrained(--output_dir)``.

What differs: tiny models from a pipeline folder the tests write, 12 local image pairs (32x32:
the VAE's factor 8 gives 4x4 latents, the conditioning embedding's three stride-2 convolutions
too); ``_tv`` for torchvision; no validation, trackers, progress bars, hub upload, 8-bit Adam or
xformers. Added by ``_harness``: ``--statekit``, ``--stop_after_steps``, ``harness_log.jsonl``,
``final_state.*``.
"""

from __future__ import annotations

import argparse
import math
import os
import random

import numpy as np
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, set_seed
from datasets import load_dataset
from transformers import AutoTokenizer, PretrainedConfig

import _diffusers_common
import _harness
import _tv
from diffusers import AutoencoderKL, ControlNetModel, DDPMScheduler, UNet2DConditionModel
from diffusers.optimization import get_scheduler
from diffusers.utils.torch_utils import is_compiled_module


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="train_controlnet.py, reproduced for statekit's tests")
    p.add_argument("--pretrained_model_name_or_path", required=True)
    p.add_argument("--controlnet_model_name_or_path", default=None)
    p.add_argument("--revision", default=None)
    p.add_argument("--variant", default=None)
    p.add_argument("--tokenizer_name", default=None)
    p.add_argument("--output_dir", default="controlnet-model")
    p.add_argument("--cache_dir", default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--resolution", type=int, default=512)
    p.add_argument("--train_batch_size", type=int, default=4)
    p.add_argument("--num_train_epochs", type=int, default=1)
    p.add_argument("--max_train_steps", type=int, default=None)
    p.add_argument("--checkpointing_steps", type=int, default=500)
    p.add_argument("--checkpoints_total_limit", type=int, default=None)
    p.add_argument("--resume_from_checkpoint", default=None)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--learning_rate", type=float, default=5e-6)
    p.add_argument("--scale_lr", action="store_true")
    p.add_argument("--lr_scheduler", default="constant")
    p.add_argument("--lr_warmup_steps", type=int, default=500)
    p.add_argument("--lr_num_cycles", type=int, default=1)
    p.add_argument("--lr_power", type=float, default=1.0)
    p.add_argument("--dataloader_num_workers", type=int, default=0)
    p.add_argument("--adam_beta1", type=float, default=0.9)
    p.add_argument("--adam_beta2", type=float, default=0.999)
    p.add_argument("--adam_weight_decay", type=float, default=1e-2)
    p.add_argument("--adam_epsilon", type=float, default=1e-08)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--mixed_precision", default=None, choices=["no", "fp16", "bf16"])
    p.add_argument("--set_grads_to_none", action="store_true")
    p.add_argument("--train_data_dir", required=True)
    p.add_argument("--image_column", default="image")
    p.add_argument("--conditioning_image_column", default="conditioning_image")
    p.add_argument("--caption_column", default="text")
    p.add_argument("--max_train_samples", type=int, default=None)
    p.add_argument("--proportion_empty_prompts", type=float, default=0)
    _harness.add_arguments(p)
    return p.parse_args(argv)


def make_train_dataset(args, tokenizer, accelerator):
    dataset = load_dataset(args.train_data_dir, cache_dir=args.cache_dir)
    column_names = dataset["train"].column_names
    image_column = args.image_column or column_names[0]
    caption_column = args.caption_column or column_names[1]
    conditioning_image_column = args.conditioning_image_column or column_names[2]
    for column in (image_column, caption_column, conditioning_image_column):
        if column not in column_names:
            raise ValueError(f"`{column}` not found in dataset columns: {', '.join(column_names)}")

    def tokenize_captions(examples, is_train=True):
        captions = []
        for caption in examples[caption_column]:
            if random.random() < args.proportion_empty_prompts:
                captions.append("")
            elif isinstance(caption, str):
                captions.append(caption)
            elif isinstance(caption, (list, np.ndarray)):
                captions.append(random.choice(caption) if is_train else caption[0])
            else:
                raise ValueError(f"Caption column `{caption_column}` should contain strings or lists of strings.")
        return tokenizer(captions, max_length=tokenizer.model_max_length, padding="max_length", truncation=True,
                         return_tensors="pt").input_ids

    image_transforms = _tv.Compose([_tv.Resize(args.resolution, interpolation=_tv.BILINEAR),
                                    _tv.CenterCrop(args.resolution), _tv.to_tensor, _tv.normalize_half])
    conditioning_image_transforms = _tv.Compose([_tv.Resize(args.resolution, interpolation=_tv.BILINEAR),
                                                 _tv.CenterCrop(args.resolution), _tv.to_tensor])

    def preprocess_train(examples):
        images = [image_transforms(image.convert("RGB")) for image in examples[image_column]]
        conditioning = [conditioning_image_transforms(image.convert("RGB"))
                        for image in examples[conditioning_image_column]]
        examples["pixel_values"] = images
        examples["conditioning_pixel_values"] = conditioning
        examples["input_ids"] = tokenize_captions(examples)
        return examples

    with accelerator.main_process_first():
        if args.max_train_samples is not None:
            dataset["train"] = dataset["train"].shuffle(seed=args.seed).select(range(args.max_train_samples))
        return dataset["train"].with_transform(preprocess_train)


def collate_fn(examples):
    def stacked(key):
        return torch.stack([e[key] for e in examples]).to(memory_format=torch.contiguous_format).float()

    return {"pixel_values": stacked("pixel_values"), "conditioning_pixel_values": stacked("conditioning_pixel_values"),
            "input_ids": torch.stack([e["input_ids"] for e in examples])}


def main(args):
    harness = _harness.Harness(args.output_dir, args)
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision=args.mixed_precision,
        project_config=ProjectConfiguration(project_dir=args.output_dir, logging_dir=os.path.join(args.output_dir, "logs")),
    )
    harness.attach(accelerator, "init")
    if args.seed is not None:
        set_seed(args.seed)
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)

    base = args.pretrained_model_name_or_path
    if args.tokenizer_name:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name, revision=args.revision, use_fast=False)
    else:
        tokenizer = AutoTokenizer.from_pretrained(base, subfolder="tokenizer", revision=args.revision, use_fast=False)
    architecture = PretrainedConfig.from_pretrained(base, subfolder="text_encoder", revision=args.revision).architectures[0]
    if architecture != "CLIPTextModel":
        raise ValueError(f"{architecture} is not supported.")
    from transformers import CLIPTextModel as text_encoder_cls

    noise_scheduler = DDPMScheduler.from_pretrained(base, subfolder="scheduler")
    text_encoder = text_encoder_cls.from_pretrained(base, subfolder="text_encoder", revision=args.revision,
                                                    variant=args.variant)
    vae = AutoencoderKL.from_pretrained(base, subfolder="vae", revision=args.revision, variant=args.variant)
    unet = UNet2DConditionModel.from_pretrained(base, subfolder="unet", revision=args.revision, variant=args.variant)
    if args.controlnet_model_name_or_path:
        controlnet = ControlNetModel.from_pretrained(args.controlnet_model_name_or_path)
    else:
        controlnet = ControlNetModel.from_unet(unet)

    def unwrap_model(model):
        model = accelerator.unwrap_model(model)
        return model._orig_mod if is_compiled_module(model) else model

    def save_model_hook(models, weights, output_dir):
        if not accelerator.is_main_process:
            return
        i = len(weights) - 1
        while weights:
            weights.pop()
            models[i].save_pretrained(os.path.join(output_dir, "controlnet"))
            i -= 1

    def load_model_hook(models, input_dir):
        while models:
            model = models.pop()
            loaded = ControlNetModel.from_pretrained(input_dir, subfolder="controlnet")
            model.register_to_config(**loaded.config)
            model.load_state_dict(loaded.state_dict())
            del loaded

    accelerator.register_save_state_pre_hook(save_model_hook)
    accelerator.register_load_state_pre_hook(load_model_hook)

    vae.requires_grad_(False)
    unet.requires_grad_(False)
    text_encoder.requires_grad_(False)
    controlnet.train()
    if unwrap_model(controlnet).dtype != torch.float32:
        raise ValueError(f"Controlnet loaded as datatype {unwrap_model(controlnet).dtype}.")

    if args.scale_lr:
        args.learning_rate *= args.gradient_accumulation_steps * args.train_batch_size * accelerator.num_processes
    optimizer = torch.optim.AdamW(controlnet.parameters(), lr=args.learning_rate,
                                  betas=(args.adam_beta1, args.adam_beta2), weight_decay=args.adam_weight_decay,
                                  eps=args.adam_epsilon)

    train_dataset = make_train_dataset(args, tokenizer, accelerator)
    train_dataloader = torch.utils.data.DataLoader(train_dataset, shuffle=True, collate_fn=collate_fn,
                                                   batch_size=args.train_batch_size,
                                                   num_workers=args.dataloader_num_workers)

    num_warmup_steps_for_scheduler = args.lr_warmup_steps * accelerator.num_processes
    if args.max_train_steps is None:
        len_after_sharding = math.ceil(len(train_dataloader) / accelerator.num_processes)
        num_update_steps_per_epoch = math.ceil(len_after_sharding / args.gradient_accumulation_steps)
        num_training_steps_for_scheduler = args.num_train_epochs * num_update_steps_per_epoch * accelerator.num_processes
    else:
        num_training_steps_for_scheduler = args.max_train_steps * accelerator.num_processes
    lr_scheduler = get_scheduler(args.lr_scheduler, optimizer=optimizer, num_warmup_steps=num_warmup_steps_for_scheduler,
                                 num_training_steps=num_training_steps_for_scheduler, num_cycles=args.lr_num_cycles,
                                 power=args.lr_power)

    controlnet, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(controlnet, optimizer, train_dataloader,
                                                                                lr_scheduler)
    harness.attach(accelerator, "prepare")

    weight_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(accelerator.mixed_precision, torch.float32)
    vae.to(accelerator.device, dtype=weight_dtype)
    unet.to(accelerator.device, dtype=weight_dtype)
    text_encoder.to(accelerator.device, dtype=weight_dtype)

    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    if args.max_train_steps is None:
        args.max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
    args.num_train_epochs = math.ceil(args.max_train_steps / num_update_steps_per_epoch)

    global_step = 0
    first_epoch = 0
    if args.resume_from_checkpoint:
        path = _diffusers_common.checkpoint_to_resume(args.resume_from_checkpoint, args.output_dir)
        if path is None:
            accelerator.print(f"Checkpoint '{args.resume_from_checkpoint}' does not exist. Starting a new training run.")
            args.resume_from_checkpoint = None
        else:
            accelerator.print(f"Resuming from checkpoint {path}")
            accelerator.load_state(os.path.join(args.output_dir, path))
            global_step = int(path.split("-")[1])
            first_epoch = global_step // num_update_steps_per_epoch
            harness.resumed(path, global_step)

    for epoch in range(first_epoch, args.num_train_epochs):
        for step, batch in enumerate(train_dataloader):
            with accelerator.accumulate(controlnet):
                latents = vae.encode(batch["pixel_values"].to(dtype=weight_dtype)).latent_dist.sample()
                latents = latents * vae.config.scaling_factor
                noise = torch.randn_like(latents)
                bsz = latents.shape[0]
                timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (bsz,),
                                          device=latents.device).long()
                noisy_latents = noise_scheduler.add_noise(latents.float(), noise.float(), timesteps).to(dtype=weight_dtype)
                encoder_hidden_states = text_encoder(batch["input_ids"], return_dict=False)[0]
                controlnet_image = batch["conditioning_pixel_values"].to(dtype=weight_dtype)
                down_block_res_samples, mid_block_res_sample = controlnet(
                    noisy_latents, timesteps, encoder_hidden_states=encoder_hidden_states,
                    controlnet_cond=controlnet_image, return_dict=False)
                model_pred = unet(
                    noisy_latents, timesteps, encoder_hidden_states=encoder_hidden_states,
                    down_block_additional_residuals=[s.to(dtype=weight_dtype) for s in down_block_res_samples],
                    mid_block_additional_residual=mid_block_res_sample.to(dtype=weight_dtype), return_dict=False)[0]
                if noise_scheduler.config.prediction_type == "epsilon":
                    target = noise
                elif noise_scheduler.config.prediction_type == "v_prediction":
                    target = noise_scheduler.get_velocity(latents, noise, timesteps)
                else:
                    raise ValueError(f"Unknown prediction type {noise_scheduler.config.prediction_type}")
                loss = F.mse_loss(model_pred.float(), target.float(), reduction="mean")
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(controlnet.parameters(), args.max_grad_norm)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad(set_to_none=args.set_grads_to_none)

            if accelerator.sync_gradients:
                global_step += 1
                if accelerator.is_main_process and global_step % args.checkpointing_steps == 0:
                    _diffusers_common.prune_checkpoints(args.output_dir, args.checkpoints_total_limit)
                    accelerator.save_state(os.path.join(args.output_dir, f"checkpoint-{global_step}"))

            harness.loss(global_step if accelerator.sync_gradients else global_step + 1, loss.detach().item(),
                         epoch=epoch, lr=lr_scheduler.get_last_lr()[0])
            if accelerator.sync_gradients:
                harness.step_done(global_step)
            if global_step >= args.max_train_steps:
                break

    accelerator.wait_for_everyone()
    harness.final({**_harness.module_tensors(unwrap_model(controlnet), "controlnet"),
                   **_harness.optimizer_tensors(optimizer)},
                  {"global_step": global_step, "lr_scheduler": lr_scheduler.state_dict()})
    if accelerator.is_main_process:
        unwrap_model(controlnet).save_pretrained(args.output_dir)
    accelerator.end_training()


if __name__ == "__main__":
    main(parse_args())
