"""A reproduction of diffusers' ``examples/unconditional_image_generation/train_unconditional.py``
(huggingface/diffusers at 58eb52c0803ea9af3abec60841c2a093bdf1f951), written for statekit's
tests: the same calls, in the same order, with the same random draws; no code of theirs.

What it keeps, as upstream does it:
- the save/load pre-hooks, registered right after ``Accelerator(...)``, before ``prepare``:
  the save hook runs on the main process only, saves the EMA with ``EMAModel.save_pretrained``
  to ``unet_ema/`` first (when ``--use_ema``), then every model in ``models`` with
  ``save_pretrained`` to ``unet/``, popping one entry of ``weights`` per model; the load hook
  loads the EMA back with ``EMAModel.from_pretrained(..., UNet2DModel)`` + ``load_state_dict`` and,
  for every model, pops it from ``models``, loads ``UNet2DModel.from_pretrained(dir,
  subfolder="unet")``, ``register_to_config`` and ``load_state_dict``;
- ``--resume_from_checkpoint latest``: the ``checkpoint*`` folders of ``--output_dir`` sorted by
  the number after the dash, the last one loaded with ``accelerator.load_state``; then
  ``first_epoch = global_step // num_update_steps_per_epoch`` and ``resume_step`` counted in
  micro-batches, and the loop's own skip: ``continue`` while ``epoch == first_epoch and step <
  resume_step`` (the skipped batches are still fetched, and their augmentations drawn);
- per micro-batch: noise (``torch.randn``) and timesteps (``torch.randint``) drawn *outside*
  ``accelerator.accumulate``, forward, MSE loss, backward, ``clip_grad_norm_`` on sync steps,
  ``optimizer.step``, ``lr_scheduler.step``, ``zero_grad``; after a sync step the EMA steps,
  ``global_step`` grows, and on the main process every ``--checkpointing_steps`` steps the
  ``--checkpoints_total_limit`` deletion (``shutil.rmtree`` of the oldest) then
  ``accelerator.save_state(output_dir/checkpoint-<global_step>)``;
- at each epoch end (``--save_images_epochs``, ``--save_model_epochs``): EMA weights swapped in
  (``store``/``copy_to``), a ``DDPMPipeline`` sampled with its own seeded generator, the pipeline
  saved with ``save_pretrained``, the weights swapped back (``restore``).

What differs: a tiny ``UNet2DModel`` (``--model_config_name_or_path``, a config file the
tests write) on 12 local images of 10x8 (``load_dataset("imagefolder", data_dir=...)``, as
upstream's ``--train_data_dir``); the torchvision transforms are ``_tv``'s equivalents (same
draws from torch's global generator); a ``--seed`` (upstream sets none: the tests need two
processes to start from the same weights) applied with ``accelerate.utils.set_seed`` right
after ``Accelerator(...)``; no trackers, progress bars or hub upload; ``--preserve_input_precision``
and xformers are left out; the sampled images are dropped. Added by ``_harness``:
``--statekit``, ``--stop_after_steps``, ``harness_log.jsonl``, ``final_state.*``.
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
import shutil

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, set_seed
from datasets import load_dataset

import _harness
import _tv
from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel
from diffusers.optimization import get_scheduler
from diffusers.training_utils import EMAModel


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="train_unconditional.py, reproduced for statekit's tests")
    p.add_argument("--train_data_dir", required=True)
    p.add_argument("--cache_dir", default=None)
    p.add_argument("--model_config_name_or_path", required=True)
    p.add_argument("--output_dir", default="ddpm-model-64")
    p.add_argument("--resolution", type=int, default=64)
    p.add_argument("--center_crop", action="store_true")
    p.add_argument("--random_flip", action="store_true")
    p.add_argument("--train_batch_size", type=int, default=16)
    p.add_argument("--eval_batch_size", type=int, default=16)
    p.add_argument("--dataloader_num_workers", type=int, default=0)
    p.add_argument("--num_epochs", type=int, default=100)
    p.add_argument("--save_images_epochs", type=int, default=10)
    p.add_argument("--save_model_epochs", type=int, default=10)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--learning_rate", type=float, default=1e-4)
    p.add_argument("--lr_scheduler", default="cosine")
    p.add_argument("--lr_warmup_steps", type=int, default=500)
    p.add_argument("--adam_beta1", type=float, default=0.95)
    p.add_argument("--adam_beta2", type=float, default=0.999)
    p.add_argument("--adam_weight_decay", type=float, default=1e-6)
    p.add_argument("--adam_epsilon", type=float, default=1e-08)
    p.add_argument("--use_ema", action="store_true")
    p.add_argument("--ema_inv_gamma", type=float, default=1.0)
    p.add_argument("--ema_power", type=float, default=3 / 4)
    p.add_argument("--ema_max_decay", type=float, default=0.9999)
    p.add_argument("--mixed_precision", default="no", choices=["no", "fp16", "bf16"])
    p.add_argument("--prediction_type", default="epsilon", choices=["epsilon", "sample"])
    p.add_argument("--ddpm_num_steps", type=int, default=1000)
    p.add_argument("--ddpm_num_inference_steps", type=int, default=1000)
    p.add_argument("--ddpm_beta_schedule", default="linear")
    p.add_argument("--checkpointing_steps", type=int, default=500)
    p.add_argument("--checkpoints_total_limit", type=int, default=None)
    p.add_argument("--resume_from_checkpoint", default=None)
    p.add_argument("--seed", type=int, default=0)
    _harness.add_arguments(p)
    return p.parse_args(argv)


def alphas_at(table, timesteps, shape):
    """The schedule's values at ``timesteps``, broadcast to ``shape`` (``_extract_into_tensor``)."""
    values = (table if isinstance(table, torch.Tensor) else torch.from_numpy(table))[timesteps].float()
    while values.dim() < len(shape):
        values = values[..., None]
    return values.to(timesteps.device).expand(shape)


def checkpoint_dirs(output_dir):
    names = [d for d in os.listdir(output_dir) if d.startswith("checkpoint")]
    return sorted(names, key=lambda d: int(d.split("-")[1]))


def main(args):
    harness = _harness.Harness(args.output_dir, args)
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision=args.mixed_precision,
        project_config=ProjectConfiguration(project_dir=args.output_dir, logging_dir=os.path.join(args.output_dir, "logs")),
    )
    harness.attach(accelerator, "init")
    set_seed(args.seed)

    def save_model_hook(models, weights, output_dir):
        if not accelerator.is_main_process:
            return
        if args.use_ema:
            ema_model.save_pretrained(os.path.join(output_dir, "unet_ema"))
        for model in models:
            model.save_pretrained(os.path.join(output_dir, "unet"))
            weights.pop()  # so that Accelerate does not save this model again

    def load_model_hook(models, input_dir):
        if args.use_ema:
            loaded = EMAModel.from_pretrained(os.path.join(input_dir, "unet_ema"), UNet2DModel)
            ema_model.load_state_dict(loaded.state_dict())
            ema_model.to(accelerator.device)
            del loaded
        for _ in range(len(models)):
            model = models.pop()  # so that Accelerate does not load it again
            loaded = UNet2DModel.from_pretrained(input_dir, subfolder="unet")
            model.register_to_config(**loaded.config)
            model.load_state_dict(loaded.state_dict())
            del loaded

    accelerator.register_save_state_pre_hook(save_model_hook)
    accelerator.register_load_state_pre_hook(load_model_hook)

    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)

    model = UNet2DModel.from_config(UNet2DModel.load_config(args.model_config_name_or_path))
    if args.use_ema:
        ema_model = EMAModel(
            model.parameters(), decay=args.ema_max_decay, use_ema_warmup=True, inv_gamma=args.ema_inv_gamma,
            power=args.ema_power, model_cls=UNet2DModel, model_config=model.config,
        )
    weight_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(accelerator.mixed_precision, torch.float32)

    if "prediction_type" in inspect.signature(DDPMScheduler.__init__).parameters:
        noise_scheduler = DDPMScheduler(num_train_timesteps=args.ddpm_num_steps, beta_schedule=args.ddpm_beta_schedule,
                                        prediction_type=args.prediction_type)
    else:
        noise_scheduler = DDPMScheduler(num_train_timesteps=args.ddpm_num_steps, beta_schedule=args.ddpm_beta_schedule)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                                  weight_decay=args.adam_weight_decay, eps=args.adam_epsilon)

    dataset = load_dataset("imagefolder", data_dir=args.train_data_dir, cache_dir=args.cache_dir, split="train")
    augment = _tv.Compose([
        _tv.Resize(args.resolution, interpolation=_tv.BILINEAR),
        _tv.CenterCrop(args.resolution) if args.center_crop else _tv.RandomCrop(args.resolution),
        _tv.RandomHorizontalFlip() if args.random_flip else _tv.identity,
        _tv.to_tensor,
        _tv.normalize_half,
    ])

    def transform_images(examples):
        return {"input": [augment(image.convert("RGB")) for image in examples["image"]]}

    dataset.set_transform(transform_images)
    train_dataloader = torch.utils.data.DataLoader(
        dataset, batch_size=args.train_batch_size, shuffle=True, num_workers=args.dataloader_num_workers
    )
    lr_scheduler = get_scheduler(
        args.lr_scheduler, optimizer=optimizer, num_warmup_steps=args.lr_warmup_steps * args.gradient_accumulation_steps,
        num_training_steps=len(train_dataloader) * args.num_epochs,
    )

    model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(model, optimizer, train_dataloader, lr_scheduler)
    harness.attach(accelerator, "prepare")
    if args.use_ema:
        ema_model.to(accelerator.device)

    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    global_step = 0
    first_epoch = 0

    if args.resume_from_checkpoint:
        if args.resume_from_checkpoint != "latest":
            path = os.path.basename(args.resume_from_checkpoint)
        else:
            dirs = checkpoint_dirs(args.output_dir)
            path = dirs[-1] if dirs else None
        if path is None:
            accelerator.print(f"Checkpoint '{args.resume_from_checkpoint}' does not exist. Starting a new training run.")
            args.resume_from_checkpoint = None
        else:
            accelerator.print(f"Resuming from checkpoint {path}")
            accelerator.load_state(os.path.join(args.output_dir, path))
            global_step = int(path.split("-")[1])
            resume_global_step = global_step * args.gradient_accumulation_steps
            first_epoch = global_step // num_update_steps_per_epoch
            resume_step = resume_global_step % (num_update_steps_per_epoch * args.gradient_accumulation_steps)
            harness.resumed(path, global_step)

    for epoch in range(first_epoch, args.num_epochs):
        model.train()
        for step, batch in enumerate(train_dataloader):
            if args.resume_from_checkpoint and epoch == first_epoch and step < resume_step:
                continue  # the batches the checkpoint had consumed

            clean_images = batch["input"].to(weight_dtype)
            noise = torch.randn(clean_images.shape, dtype=weight_dtype, device=clean_images.device)
            bsz = clean_images.shape[0]
            timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (bsz,),
                                      device=clean_images.device).long()
            noisy_images = noise_scheduler.add_noise(clean_images, noise, timesteps)

            with accelerator.accumulate(model):
                model_output = model(noisy_images, timesteps).sample
                if args.prediction_type == "epsilon":
                    loss = F.mse_loss(model_output.float(), noise.float())
                else:
                    alpha_t = alphas_at(noise_scheduler.alphas_cumprod, timesteps, (clean_images.shape[0], 1, 1, 1))
                    snr_weights = alpha_t / (1 - alpha_t)
                    loss = (snr_weights * F.mse_loss(model_output.float(), clean_images.float(), reduction="none")).mean()
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()

            if accelerator.sync_gradients:
                if args.use_ema:
                    ema_model.step(model.parameters())
                global_step += 1
                if accelerator.is_main_process and global_step % args.checkpointing_steps == 0:
                    if args.checkpoints_total_limit is not None:
                        existing = checkpoint_dirs(args.output_dir)
                        if len(existing) >= args.checkpoints_total_limit:
                            for name in existing[: len(existing) - args.checkpoints_total_limit + 1]:
                                shutil.rmtree(os.path.join(args.output_dir, name))
                    accelerator.save_state(os.path.join(args.output_dir, f"checkpoint-{global_step}"))

            harness.loss(global_step if accelerator.sync_gradients else global_step + 1, loss.detach().item(),
                         epoch=epoch, lr=lr_scheduler.get_last_lr()[0])
            if accelerator.sync_gradients:
                harness.step_done(global_step)

        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            last = epoch == args.num_epochs - 1
            if epoch % args.save_images_epochs == 0 or last:
                unet = accelerator.unwrap_model(model)
                if args.use_ema:
                    ema_model.store(unet.parameters())
                    ema_model.copy_to(unet.parameters())
                pipeline = DDPMPipeline(unet=unet, scheduler=noise_scheduler)
                generator = torch.Generator(device=pipeline.device).manual_seed(0)
                pipeline.set_progress_bar_config(disable=True)
                pipeline(generator=generator, batch_size=args.eval_batch_size,
                         num_inference_steps=args.ddpm_num_inference_steps, output_type="np")
                if args.use_ema:
                    ema_model.restore(unet.parameters())
            if epoch % args.save_model_epochs == 0 or last:
                unet = accelerator.unwrap_model(model)
                if args.use_ema:
                    ema_model.store(unet.parameters())
                    ema_model.copy_to(unet.parameters())
                DDPMPipeline(unet=unet, scheduler=noise_scheduler).save_pretrained(args.output_dir)
                if args.use_ema:
                    ema_model.restore(unet.parameters())

    tensors = {**_harness.module_tensors(accelerator.unwrap_model(model), "unet"),
               **_harness.optimizer_tensors(optimizer)}
    counters = {"global_step": global_step, "lr_scheduler": lr_scheduler.state_dict()}
    if args.use_ema:
        tensors.update({f"ema.{i}": p for i, p in enumerate(ema_model.shadow_params)})
        counters.update(ema_optimization_step=ema_model.optimization_step, ema_decay=ema_model.cur_decay_value)
    harness.final(tensors, counters)
    accelerator.end_training()


if __name__ == "__main__":
    main(parse_args())
