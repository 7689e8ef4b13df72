"""A reproduction of diffusers' ``examples/dreambooth/train_dreambooth_lora.py``
(huggingface/diffusers at 58eb52c0803ea9af3abec60841c2a093bdf1f951), written for statekit's
tests: the same calls, in the same order, with the same random draws; no code of theirs.

What it keeps, as upstream does it:
- the tokenizer with ``AutoTokenizer.from_pretrained(..., subfolder="tokenizer", use_fast=False)``,
  the text encoder's class read from its config's ``architectures``; every base model frozen and
  moved to the device; ``unet.add_adapter(LoraConfig(..., target_modules=[to_k, to_q, to_v, to_out.0,
  add_k_proj, add_v_proj]))`` and, with ``--train_text_encoder``, a LoRA on the text encoder's
  ``q_proj, k_proj, v_proj, out_proj`` (each adapter's initial weights drawn from torch's generator);
- the pre-hooks, registered before ``prepare``: the save hook (main process only) sorts each
  model by class (UNet or text encoder, anything else ``ValueError``), takes
  ``convert_state_dict_to_diffusers(get_peft_model_state_dict(model))``, pops one ``weights`` entry
  per model, and writes ``StableDiffusionLoraLoaderMixin.save_lora_weights(output_dir,
  unet_lora_layers=..., text_encoder_lora_layers=...)``; the load hook pops every model, reads
  ``lora_state_dict(input_dir)``, loads the ``unet.`` keys with ``convert_unet_state_dict_to_peft`` +
  ``set_peft_model_state_dict`` and, with ``--train_text_encoder``, the ``text_encoder.`` keys with
  ``_set_state_dict_into_text_encoder``;
- ``DreamBoothDataset`` (the instance folder listed with ``iterdir()``, each image through Resize,
  RandomCrop/CenterCrop, ToTensor, Normalize; the prompt tokenized per item) and its collate
  function (``input_ids`` concatenated, ``attention_mask`` a list); a shuffled ``DataLoader``;
- ``params_to_optimize`` as a list (so ``clip_grad_norm_`` clips it), the step arithmetic,
  ``--resume_from_checkpoint latest`` with ``first_epoch`` and no skip (the resumed epoch restarts
  from its first batch); per micro-batch inside ``accumulate(unet)``: VAE sample, ``randn_like``
  noise, ``randint`` timesteps, ``add_noise``, ``encode_prompt``, the UNet, MSE, backward, clip on sync
  steps, step, schedule, ``zero_grad``; then (main process) the checkpoint deletion and
  ``save_state``; ``break`` at ``max_train_steps``;
- at the end: the LoRA layers saved with ``save_lora_weights``, a fresh
  ``DiffusionPipeline.from_pretrained(base)`` and ``load_lora_weights(output_dir)``.

What differs: tiny models from a pipeline folder the tests write, 12 local images; ``_tv`` for
torchvision; no prior preservation (class images), validation, trackers, progress bars, hub
upload, 8-bit Adam, xformers or precomputed embeddings. Added by ``_harness``: ``--statekit``,
``--stop_after_steps``, ``harness_log.jsonl``, ``final_state.*``.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, set_seed
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
from PIL import Image
from PIL.ImageOps import exif_transpose
from torch.utils.data import Dataset
from transformers import AutoTokenizer, PretrainedConfig

import _diffusers_common
import _harness
import _tv
from diffusers import AutoencoderKL, DDPMScheduler, DiffusionPipeline, UNet2DConditionModel
from diffusers.loaders import StableDiffusionLoraLoaderMixin
from diffusers.optimization import get_scheduler
from diffusers.training_utils import _set_state_dict_into_text_encoder, cast_training_params
from diffusers.utils import convert_state_dict_to_diffusers, convert_unet_state_dict_to_peft
from diffusers.utils.torch_utils import is_compiled_module


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="train_dreambooth_lora.py, reproduced for statekit's tests")
    p.add_argument("--pretrained_model_name_or_path", required=True)
    p.add_argument("--revision", default=None)
    p.add_argument("--variant", default=None)
    p.add_argument("--tokenizer_name", default=None)
    p.add_argument("--instance_data_dir", required=True)
    p.add_argument("--instance_prompt", required=True)
    p.add_argument("--output_dir", default="lora-dreambooth-model")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--resolution", type=int, default=512)
    p.add_argument("--center_crop", action="store_true")
    p.add_argument("--train_text_encoder", action="store_true")
    p.add_argument("--train_batch_size", type=int, default=4)
    p.add_argument("--num_train_epochs", type=int, default=1)
    p.add_argument("--max_train_steps", type=int, default=None)
    p.add_argument("--checkpointing_steps", type=int, default=500)
    p.add_argument("--checkpoints_total_limit", type=int, default=None)
    p.add_argument("--resume_from_checkpoint", default=None)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--learning_rate", type=float, default=5e-4)
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
    p.add_argument("--tokenizer_max_length", type=int, default=None)
    p.add_argument("--text_encoder_use_attention_mask", action="store_true")
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--lora_dropout", type=float, default=0.0)
    p.add_argument("--image_interpolation_mode", default="lanczos", choices=["bilinear", "bicubic", "lanczos", "nearest"])
    _harness.add_arguments(p)
    return p.parse_args(argv)


def tokenize_prompt(tokenizer, prompt, tokenizer_max_length=None):
    max_length = tokenizer_max_length if tokenizer_max_length is not None else tokenizer.model_max_length
    return tokenizer(prompt, truncation=True, padding="max_length", max_length=max_length, return_tensors="pt")


def encode_prompt(text_encoder, input_ids, attention_mask, text_encoder_use_attention_mask=None):
    mask = attention_mask.to(text_encoder.device) if text_encoder_use_attention_mask else None
    return text_encoder(input_ids.to(text_encoder.device), attention_mask=mask, return_dict=False)[0]


class DreamBoothDataset(Dataset):
    """The instance images (no class images: prior preservation is not reproduced)."""

    def __init__(self, instance_data_root, instance_prompt, tokenizer, size, center_crop, interpolation,
                 tokenizer_max_length=None):
        self.tokenizer, self.tokenizer_max_length = tokenizer, tokenizer_max_length
        self.instance_data_root = Path(instance_data_root)
        if not self.instance_data_root.exists():
            raise ValueError("Instance images root doesn't exists.")
        self.instance_images_path = list(self.instance_data_root.iterdir())
        self.num_instance_images = len(self.instance_images_path)
        self.instance_prompt = instance_prompt
        self.image_transforms = _tv.Compose([
            _tv.Resize(size, interpolation=interpolation),
            _tv.CenterCrop(size) if center_crop else _tv.RandomCrop(size),
            _tv.to_tensor,
            _tv.normalize_half,
        ])

    def __len__(self):
        return self.num_instance_images

    def __getitem__(self, index):
        image = exif_transpose(Image.open(self.instance_images_path[index % self.num_instance_images]))
        if image.mode != "RGB":
            image = image.convert("RGB")
        text = tokenize_prompt(self.tokenizer, self.instance_prompt, tokenizer_max_length=self.tokenizer_max_length)
        return {"instance_images": self.image_transforms(image), "instance_prompt_ids": text.input_ids,
                "instance_attention_mask": text.attention_mask}


def collate_fn(examples):
    pixel_values = torch.stack([e["instance_images"] for e in examples]).to(memory_format=torch.contiguous_format).float()
    return {"input_ids": torch.cat([e["instance_prompt_ids"] for e in examples], dim=0), "pixel_values": pixel_values,
            "attention_mask": [e["instance_attention_mask"] for e in examples]}


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
    try:
        vae = AutoencoderKL.from_pretrained(base, subfolder="vae", revision=args.revision, variant=args.variant)
    except OSError:
        vae = None
    unet = UNet2DConditionModel.from_pretrained(base, subfolder="unet", revision=args.revision, variant=args.variant)
    if vae is not None:
        vae.requires_grad_(False)
    text_encoder.requires_grad_(False)
    unet.requires_grad_(False)

    weight_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(accelerator.mixed_precision, torch.float32)
    unet.to(accelerator.device, dtype=weight_dtype)
    if vae is not None:
        vae.to(accelerator.device, dtype=weight_dtype)
    text_encoder.to(accelerator.device, dtype=weight_dtype)

    unet.add_adapter(LoraConfig(r=args.rank, lora_alpha=args.rank, lora_dropout=args.lora_dropout,
                                init_lora_weights="gaussian",
                                target_modules=["to_k", "to_q", "to_v", "to_out.0", "add_k_proj", "add_v_proj"]))
    if args.train_text_encoder:
        text_encoder.add_adapter(LoraConfig(r=args.rank, lora_alpha=args.rank, lora_dropout=args.lora_dropout,
                                            init_lora_weights="gaussian",
                                            target_modules=["q_proj", "k_proj", "v_proj", "out_proj"]))

    def unwrap_model(model):
        model = accelerator.unwrap_model(model)
        return model._orig_mod if is_compiled_module(model) else model

    def save_model_hook(models, weights, output_dir):
        if not accelerator.is_main_process:
            return
        unet_layers, text_encoder_layers = None, None
        for model in models:
            if isinstance(model, type(unwrap_model(unet))):
                unet_layers = convert_state_dict_to_diffusers(get_peft_model_state_dict(model))
            elif isinstance(model, type(unwrap_model(text_encoder))):
                text_encoder_layers = convert_state_dict_to_diffusers(get_peft_model_state_dict(model))
            else:
                raise ValueError(f"unexpected save model: {model.__class__}")
            weights.pop()  # Accelerate must not save this model again
        StableDiffusionLoraLoaderMixin.save_lora_weights(output_dir, unet_lora_layers=unet_layers,
                                                         text_encoder_lora_layers=text_encoder_layers)

    def load_model_hook(models, input_dir):
        unet_, text_encoder_ = None, None
        while models:
            model = models.pop()
            if isinstance(model, type(unwrap_model(unet))):
                unet_ = model
            elif isinstance(model, type(unwrap_model(text_encoder))):
                text_encoder_ = model
            else:
                raise ValueError(f"unexpected save model: {model.__class__}")
        lora_state_dict, _network_alphas = StableDiffusionLoraLoaderMixin.lora_state_dict(input_dir)
        unet_state_dict = {k.replace("unet.", ""): v for k, v in lora_state_dict.items() if k.startswith("unet.")}
        unet_state_dict = convert_unet_state_dict_to_peft(unet_state_dict)
        incompatible = set_peft_model_state_dict(unet_, unet_state_dict, adapter_name="default")
        if incompatible is not None and getattr(incompatible, "unexpected_keys", None):
            print(f"Loading adapter weights led to unexpected keys: {incompatible.unexpected_keys}")
        if args.train_text_encoder:
            _set_state_dict_into_text_encoder(lora_state_dict, prefix="text_encoder.", text_encoder=text_encoder_)
        if args.mixed_precision == "fp16":
            cast_training_params([unet_] + ([text_encoder_] if args.train_text_encoder else []), dtype=torch.float32)

    accelerator.register_save_state_pre_hook(save_model_hook)
    accelerator.register_load_state_pre_hook(load_model_hook)

    if args.scale_lr:
        args.learning_rate *= args.gradient_accumulation_steps * args.train_batch_size * accelerator.num_processes
    if args.mixed_precision == "fp16":
        cast_training_params([unet] + ([text_encoder] if args.train_text_encoder else []), dtype=torch.float32)
    params_to_optimize = list(filter(lambda p: p.requires_grad, unet.parameters()))
    if args.train_text_encoder:
        params_to_optimize += list(filter(lambda p: p.requires_grad, text_encoder.parameters()))
    optimizer = torch.optim.AdamW(params_to_optimize, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                                  weight_decay=args.adam_weight_decay, eps=args.adam_epsilon)

    train_dataset = DreamBoothDataset(args.instance_data_dir, args.instance_prompt, tokenizer, args.resolution,
                                      args.center_crop, _diffusers_common.INTERPOLATION[args.image_interpolation_mode],
                                      tokenizer_max_length=args.tokenizer_max_length)
    train_dataloader = torch.utils.data.DataLoader(train_dataset, batch_size=args.train_batch_size, shuffle=True,
                                                   collate_fn=collate_fn, num_workers=args.dataloader_num_workers)

    num_warmup_steps_for_scheduler = args.lr_warmup_steps * accelerator.num_processes
    if args.max_train_steps is None:
        len_after_sharding = math.ceil(len(train_dataloader) / accelerator.num_processes)
        num_update_steps_per_epoch = math.ceil(len_after_sharding / args.gradient_accumulation_steps)
        num_training_steps_for_scheduler = args.num_train_epochs * accelerator.num_processes * num_update_steps_per_epoch
    else:
        num_training_steps_for_scheduler = args.max_train_steps * accelerator.num_processes
    lr_scheduler = get_scheduler(args.lr_scheduler, optimizer=optimizer, num_warmup_steps=num_warmup_steps_for_scheduler,
                                 num_training_steps=num_training_steps_for_scheduler, num_cycles=args.lr_num_cycles,
                                 power=args.lr_power)

    if args.train_text_encoder:
        unet, text_encoder, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
            unet, text_encoder, optimizer, train_dataloader, lr_scheduler)
    else:
        unet, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(unet, optimizer, train_dataloader,
                                                                              lr_scheduler)
    harness.attach(accelerator, "prepare")

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
        unet.train()
        if args.train_text_encoder:
            text_encoder.train()
        for step, batch in enumerate(train_dataloader):
            with accelerator.accumulate(unet):
                pixel_values = batch["pixel_values"].to(dtype=weight_dtype)
                if vae is not None:
                    model_input = vae.encode(pixel_values).latent_dist.sample() * vae.config.scaling_factor
                else:
                    model_input = pixel_values
                noise = torch.randn_like(model_input)
                bsz, channels, _height, _width = model_input.shape
                timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (bsz,),
                                          device=model_input.device).long()
                noisy_model_input = noise_scheduler.add_noise(model_input, noise, timesteps)
                encoder_hidden_states = encode_prompt(text_encoder, batch["input_ids"], batch["attention_mask"],
                                                      text_encoder_use_attention_mask=args.text_encoder_use_attention_mask)
                if unwrap_model(unet).config.in_channels == channels * 2:
                    noisy_model_input = torch.cat([noisy_model_input, noisy_model_input], dim=1)
                model_pred = unet(noisy_model_input, timesteps, encoder_hidden_states, class_labels=None,
                                  return_dict=False)[0]
                if model_pred.shape[1] == 6:
                    model_pred, _ = torch.chunk(model_pred, 2, dim=1)
                if noise_scheduler.config.prediction_type == "epsilon":
                    target = noise
                elif noise_scheduler.config.prediction_type == "v_prediction":
                    target = noise_scheduler.get_velocity(model_input, noise, timesteps)
                else:
                    raise ValueError(f"Unknown prediction type {noise_scheduler.config.prediction_type}")
                loss = F.mse_loss(model_pred.float(), target.float(), reduction="mean")
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(params_to_optimize, args.max_grad_norm)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()

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
    tensors = {**_harness.module_tensors(unwrap_model(unet), "unet"), **_harness.optimizer_tensors(optimizer)}
    if args.train_text_encoder:
        tensors.update(_harness.module_tensors(unwrap_model(text_encoder), "text_encoder"))
    harness.final(tensors, {"global_step": global_step, "lr_scheduler": lr_scheduler.state_dict()})
    if accelerator.is_main_process:
        unet = unwrap_model(unet).to(torch.float32)
        unet_lora_state_dict = convert_state_dict_to_diffusers(get_peft_model_state_dict(unet))
        text_encoder_state_dict = None
        if args.train_text_encoder:
            text_encoder_state_dict = convert_state_dict_to_diffusers(get_peft_model_state_dict(unwrap_model(text_encoder)))
        StableDiffusionLoraLoaderMixin.save_lora_weights(save_directory=args.output_dir,
                                                         unet_lora_layers=unet_lora_state_dict,
                                                         text_encoder_lora_layers=text_encoder_state_dict)
        pipeline = DiffusionPipeline.from_pretrained(base, revision=args.revision, variant=args.variant,
                                                     torch_dtype=weight_dtype)
        pipeline.load_lora_weights(args.output_dir, weight_name="pytorch_lora_weights.safetensors")
    accelerator.end_training()


if __name__ == "__main__":
    main(parse_args())
