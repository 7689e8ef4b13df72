"""A reproduction of diffusers' ``examples/text_to_image/train_text_to_image.py``
(huggingface/diffusers at 58eb52c0803ea9af3abec60841c2a093bdf1f951), written for statekit's
tests: the same calls, in the same order, with the same random draws; no code of theirs.

What it keeps, as upstream does it:
- scheduler, tokenizer, text encoder, VAE and UNet loaded with ``from_pretrained`` from
  ``--pretrained_model_name_or_path``; VAE and text encoder frozen; with ``--use_ema`` a second
  UNet loaded and wrapped in ``EMAModel(..., model_cls=UNet2DConditionModel, model_config=...)``;
- the pre-hooks, registered before ``prepare``: the save hook (main process only) writes the EMA
  with ``EMAModel.save_pretrained`` to ``unet_ema/``, then each model in ``models`` with
  ``save_pretrained`` to ``unet/``, one ``weights.pop()`` per model; the load hook reads
  ``EMAModel.from_pretrained(dir/unet_ema, UNet2DConditionModel)`` into the EMA with
  ``load_state_dict`` and, for each of ``len(models)``, pops a model and loads
  ``UNet2DConditionModel.from_pretrained(dir, subfolder="unet")`` into it
  (``register_to_config`` + ``load_state_dict``);
- the data: ``load_dataset("imagefolder", data_files={"train": dir/**})``, captions tokenized
  to ``model_max_length``, ``with_transform`` (Resize, RandomCrop/CenterCrop, optional flip,
  ToTensor, Normalize), a shuffled ``DataLoader``;
- the step arithmetic: ``max_train_steps`` from the epochs when not given, epochs recomputed
  after ``prepare``; ``--resume_from_checkpoint latest`` (sorted ``checkpoint-*``),
  ``first_epoch = global_step // num_update_steps_per_epoch`` and **no skip**: upstream's loop
  starts the resumed epoch from its first batch (it has no ``resume_step`` any more);
- per micro-batch, inside ``accelerator.accumulate(unet)``: ``vae.encode(...).latent_dist.sample()``
  (a random draw), ``torch.randn_like`` noise (plus ``--noise_offset`` / ``--input_perturbation``
  draws), ``torch.randint`` timesteps, ``add_noise``, the text encoder, the UNet, MSE (or the
  ``--snr_gamma`` weighting), ``accelerator.gather`` of the loss, backward, ``clip_grad_norm_`` on
  sync steps, ``optimizer.step``, ``lr_scheduler.step``, ``zero_grad``; after a sync step the EMA
  steps, then every ``--checkpointing_steps`` the ``--checkpoints_total_limit`` deletion and
  ``accelerator.save_state(output_dir/checkpoint-<global_step>)``; ``break`` at ``max_train_steps``;
- at the end: the EMA copied into the UNet, ``StableDiffusionPipeline.from_pretrained(base,
  text_encoder=, vae=, unet=)`` saved to ``--output_dir``.

The pieces all diffusers scripts share (checkpoint sorting, deletion, the captioned
``imagefolder``) are in ``_diffusers_common``. What differs: tiny models from a pipeline folder the tests write (no hub), 12 local images;
``_tv`` for torchvision; no trackers, validation images, progress bars, hub upload, 8-bit
Adam, xformers, ``--dream_training``, ``--offload_ema`` (CUDA only) or DeepSpeed context. Added by
``_harness``: ``--statekit``, ``--stop_after_steps``, ``harness_log.jsonl``, ``final_state.*``
(written after the loop, before the export).
"""

from __future__ import annotations

import argparse
import math
import os

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, set_seed
from transformers import CLIPTextModel, CLIPTokenizer

import _diffusers_common
import _harness
from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel
from diffusers.optimization import get_scheduler
from diffusers.training_utils import EMAModel, compute_snr
from diffusers.utils.torch_utils import is_compiled_module


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="train_text_to_image.py, reproduced for statekit's tests")
    p.add_argument("--input_perturbation", type=float, default=0)
    p.add_argument("--pretrained_model_name_or_path", required=True)
    p.add_argument("--revision", default=None)
    p.add_argument("--variant", default=None)
    p.add_argument("--train_data_dir", required=True)
    p.add_argument("--image_column", default="image")
    p.add_argument("--caption_column", default="text")
    p.add_argument("--max_train_samples", type=int, default=None)
    p.add_argument("--output_dir", default="sd-model-finetuned")
    p.add_argument("--cache_dir", default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--resolution", type=int, default=512)
    p.add_argument("--center_crop", action="store_true")
    p.add_argument("--random_flip", action="store_true")
    p.add_argument("--train_batch_size", type=int, default=16)
    p.add_argument("--num_train_epochs", type=int, default=100)
    p.add_argument("--max_train_steps", type=int, default=None)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--learning_rate", type=float, default=1e-4)
    p.add_argument("--scale_lr", action="store_true")
    p.add_argument("--lr_scheduler", default="constant")
    p.add_argument("--lr_warmup_steps", type=int, default=500)
    p.add_argument("--snr_gamma", type=float, default=None)
    p.add_argument("--use_ema", action="store_true")
    p.add_argument("--foreach_ema", action="store_true")
    p.add_argument("--dataloader_num_workers", type=int, default=0)
    p.add_argument("--adam_beta1", type=float, default=0.9)
    p.add_argument("--adam_beta2", type=float, default=0.999)
    p.add_argument("--adam_weight_decay", type=float, default=1e-2)
    p.add_argument("--adam_epsilon", type=float, default=1e-08)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--prediction_type", default=None)
    p.add_argument("--mixed_precision", default=None, choices=["no", "fp16", "bf16"])
    p.add_argument("--checkpointing_steps", type=int, default=500)
    p.add_argument("--checkpoints_total_limit", type=int, default=None)
    p.add_argument("--resume_from_checkpoint", default=None)
    p.add_argument("--noise_offset", type=float, default=0)
    p.add_argument("--image_interpolation_mode", default="lanczos", choices=["bilinear", "bicubic", "lanczos", "nearest"])
    _harness.add_arguments(p)
    return p.parse_args(argv)


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
    noise_scheduler = DDPMScheduler.from_pretrained(base, subfolder="scheduler")
    tokenizer = CLIPTokenizer.from_pretrained(base, subfolder="tokenizer", revision=args.revision)
    text_encoder = CLIPTextModel.from_pretrained(base, subfolder="text_encoder", revision=args.revision, variant=args.variant)
    vae = AutoencoderKL.from_pretrained(base, subfolder="vae", revision=args.revision, variant=args.variant)
    unet = UNet2DConditionModel.from_pretrained(base, subfolder="unet", revision=args.revision)
    vae.requires_grad_(False)
    text_encoder.requires_grad_(False)
    unet.train()

    if args.use_ema:
        ema_source = UNet2DConditionModel.from_pretrained(base, subfolder="unet", revision=args.revision, variant=args.variant)
        ema_unet = EMAModel(ema_source.parameters(), model_cls=UNet2DConditionModel, model_config=ema_source.config,
                            foreach=args.foreach_ema)

    def save_model_hook(models, weights, output_dir):
        if not accelerator.is_main_process:
            return
        if args.use_ema:
            ema_unet.save_pretrained(os.path.join(output_dir, "unet_ema"))
        for model in models:
            model.save_pretrained(os.path.join(output_dir, "unet"))
            weights.pop()  # Accelerate must not save this model again

    def load_model_hook(models, input_dir):
        if args.use_ema:
            loaded = EMAModel.from_pretrained(os.path.join(input_dir, "unet_ema"), UNet2DConditionModel,
                                              foreach=args.foreach_ema)
            ema_unet.load_state_dict(loaded.state_dict())
            ema_unet.to(accelerator.device)
            del loaded
        for _ in range(len(models)):
            model = models.pop()  # Accelerate must not load it again
            loaded = UNet2DConditionModel.from_pretrained(input_dir, subfolder="unet")
            model.register_to_config(**loaded.config)
            model.load_state_dict(loaded.state_dict())
            del loaded

    accelerator.register_save_state_pre_hook(save_model_hook)
    accelerator.register_load_state_pre_hook(load_model_hook)

    if args.scale_lr:
        args.learning_rate *= args.gradient_accumulation_steps * args.train_batch_size * accelerator.num_processes
    optimizer = torch.optim.AdamW(unet.parameters(), lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                                  weight_decay=args.adam_weight_decay, eps=args.adam_epsilon)

    train_dataset, collate_fn = _diffusers_common.captioned_images(args, tokenizer, accelerator)
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
                                 num_training_steps=num_training_steps_for_scheduler)

    unet, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(unet, optimizer, train_dataloader, lr_scheduler)
    harness.attach(accelerator, "prepare")
    if args.use_ema:
        ema_unet.to(accelerator.device)

    weight_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(accelerator.mixed_precision, torch.float32)
    text_encoder.to(accelerator.device, dtype=weight_dtype)
    vae.to(accelerator.device, dtype=weight_dtype)

    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    if args.max_train_steps is None:
        args.max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
    args.num_train_epochs = math.ceil(args.max_train_steps / num_update_steps_per_epoch)

    def unwrap_model(model):
        model = accelerator.unwrap_model(model)
        return model._orig_mod if is_compiled_module(model) else model

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
        train_loss = 0.0
        for step, batch in enumerate(train_dataloader):
            with accelerator.accumulate(unet):
                latents = vae.encode(batch["pixel_values"].to(weight_dtype)).latent_dist.sample()
                latents = latents * vae.config.scaling_factor
                noise = torch.randn_like(latents)
                if args.noise_offset:
                    noise += args.noise_offset * torch.randn((latents.shape[0], latents.shape[1], 1, 1),
                                                             device=latents.device)
                if args.input_perturbation:
                    new_noise = noise + args.input_perturbation * torch.randn_like(noise)
                bsz = latents.shape[0]
                timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (bsz,),
                                          device=latents.device).long()
                noisy_latents = noise_scheduler.add_noise(latents, new_noise if args.input_perturbation else noise,
                                                          timesteps)
                encoder_hidden_states = text_encoder(batch["input_ids"], return_dict=False)[0]
                if args.prediction_type is not None:
                    noise_scheduler.register_to_config(prediction_type=args.prediction_type)
                if noise_scheduler.config.prediction_type == "epsilon":
                    target = noise
                elif noise_scheduler.config.prediction_type == "v_prediction":
                    target = noise_scheduler.get_velocity(latents, noise, timesteps)
                else:
                    raise ValueError(f"Unknown prediction type {noise_scheduler.config.prediction_type}")
                model_pred = unet(noisy_latents, timesteps, encoder_hidden_states, return_dict=False)[0]
                if args.snr_gamma is None:
                    loss = F.mse_loss(model_pred.float(), target.float(), reduction="mean")
                else:
                    snr = compute_snr(noise_scheduler, timesteps)
                    weights = torch.stack([snr, args.snr_gamma * torch.ones_like(timesteps)], dim=1).min(dim=1)[0]
                    weights = weights / snr if noise_scheduler.config.prediction_type == "epsilon" else weights / (snr + 1)
                    loss = F.mse_loss(model_pred.float(), target.float(), reduction="none")
                    loss = (loss.mean(dim=list(range(1, len(loss.shape)))) * weights).mean()
                avg_loss = accelerator.gather(loss.repeat(args.train_batch_size)).mean()
                train_loss += avg_loss.item() / args.gradient_accumulation_steps
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(unet.parameters(), args.max_grad_norm)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()

            if accelerator.sync_gradients:
                if args.use_ema:
                    ema_unet.step(unet.parameters())
                global_step += 1
                train_loss = 0.0
                if global_step % args.checkpointing_steps == 0 and accelerator.is_main_process:
                    _diffusers_common.prune_checkpoints(args.output_dir, args.checkpoints_total_limit)
                    accelerator.save_state(os.path.join(args.output_dir, f"checkpoint-{global_step}"))

            harness.loss(global_step if accelerator.sync_gradients else global_step + 1, loss.detach().item(),
                         epoch=epoch, lr=lr_scheduler.get_last_lr()[0])
            if accelerator.sync_gradients:
                harness.step_done(global_step)
            if global_step >= args.max_train_steps:
                break

    accelerator.wait_for_everyone()
    tensors = {**_harness.module_tensors(unwrap_model(unet), "unet"), **_harness.optimizer_tensors(optimizer)}
    counters = {"global_step": global_step, "lr_scheduler": lr_scheduler.state_dict()}
    if args.use_ema:
        tensors.update({f"ema.{i}": p for i, p in enumerate(ema_unet.shadow_params)})
        counters.update(ema_optimization_step=ema_unet.optimization_step, ema_decay=ema_unet.cur_decay_value)
    harness.final(tensors, counters)
    if accelerator.is_main_process:
        unet = unwrap_model(unet)
        if args.use_ema:
            ema_unet.copy_to(unet.parameters())
        pipeline = StableDiffusionPipeline.from_pretrained(base, text_encoder=text_encoder, vae=vae, unet=unet,
                                                           revision=args.revision, variant=args.variant)
        pipeline.save_pretrained(args.output_dir)
    accelerator.end_training()


if __name__ == "__main__":
    main(parse_args())
