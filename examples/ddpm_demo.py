"""statekit DDPM demo: a diffusion model killed mid-epoch resumes bit-exactly, then ships as a pipeline.

A small diffusers ``UNet2DModel`` learns scikit-learn's handwritten digits (1,797 images,
upsampled from 8x8 to 16x16) as a DDPM: ``DDPMScheduler`` noise, AdamW, an ``EMAModel``
of the weights, with Accelerate; statekit's ``CheckpointManager`` checkpoints every few
steps. With statekit-diffusers installed the UNet is written as ``unet/``, its EMA as
``unet_ema/`` and the noise scheduler as ``scheduler/`` (diffusers folders), without a
single hook in this file. The demo runs:

1. a reference training to N steps, in a fresh process;
2. the same training in a child process killed with SIGKILL at a random step in the
   middle of an epoch;
3. a new process that resumes from the newest committed checkpoint and trains to N;

checks that the final weights, EMA weights, EMA counters, optimizer state and every
per-step loss equal the reference bit for bit, then exports the resumed run's last
checkpoint with ``statekit convert CKPT OUT --to diffusers``, loads it with
``DDPMPipeline.from_pretrained`` and saves a grid of generated digits as a PNG.

``memory://`` is private to each process, so with a ``memory://`` URL steps 2 and 3 run in
this process (an exception stands in for the SIGKILL).

Usage::

    python examples/ddpm_demo.py --out samples.png             # local folder under ./runs
    python examples/ddpm_demo.py --moto --out samples.png      # a local moto S3 server
    python examples/ddpm_demo.py --url s3://bucket/run --out samples.png
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import statekit_diffusers
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel
from diffusers.training_utils import EMAModel
from PIL import Image
from sklearn.datasets import load_digits

import _demo_harness as harness
import _demo_report as checks
import statekit

IMAGE_SIZE = 16
TRAIN_TIMESTEPS = 200
DIGITS = 1797


# --------------------------------------------------------------------------- the training run


def digits() -> torch.utils.data.TensorDataset:
    """scikit-learn's digits, 16x16, scaled to [-1, 1]: 1,797 images of shape (1, 16, 16)."""
    x = torch.tensor(load_digits().images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = F.interpolate(x, size=(IMAGE_SIZE, IMAGE_SIZE), mode="bilinear", align_corners=False)
    return torch.utils.data.TensorDataset(x.clamp(0, 1) * 2 - 1)


def make_unet() -> UNet2DModel:
    return UNet2DModel(
        sample_size=IMAGE_SIZE,
        in_channels=1,
        out_channels=1,
        layers_per_block=1,
        block_out_channels=(16, 32),
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
        norm_num_groups=8,
    )


def build(args: argparse.Namespace):
    """Everything a run needs, built the same way in every process."""
    set_seed(args.seed)
    torch.set_num_threads(1)  # one thread: the same float summation order in every process
    accelerator = Accelerator(cpu=True)
    loader = torch.utils.data.DataLoader(digits(), batch_size=args.batch_size, shuffle=True, drop_last=True)
    unet = make_unet()
    optimizer = torch.optim.AdamW(unet.parameters(), lr=args.lr, weight_decay=1e-4)
    warmup = max(1, args.steps // 20)
    lr_schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    noise_scheduler = DDPMScheduler(num_train_timesteps=TRAIN_TIMESTEPS, beta_schedule="squaredcos_cap_v2")
    unet, optimizer, loader, lr_schedule = accelerator.prepare(unet, optimizer, loader, lr_schedule)
    ema = EMAModel(unet.parameters(), decay=0.999, use_ema_warmup=True, power=3 / 4)
    # register both: the EMA is an object with state_dict(); the noise scheduler gets a Stateful wrapper
    accelerator.register_for_checkpointing(ema)
    accelerator.register_for_checkpointing(statekit_diffusers.NoiseScheduler(noise_scheduler))
    manager = statekit.CheckpointManager(accelerator, args.url, keep_last=args.keep_last, replicate_to=args.replicate_to,
                                         save_on_signal=harness.save_on_signal(args))
    return accelerator, unet, optimizer, loader, lr_schedule, noise_scheduler, ema, manager


def train(args: argparse.Namespace, log, resume: bool, abandon_at: int | None = None) -> None:
    """Train to ``args.steps``; log every step, save and resume as JSON lines to ``log``."""
    accelerator, unet, optimizer, loader, lr_schedule, noise_scheduler, ema, manager = build(args)

    def train_step(batch) -> float:
        (clean,) = batch
        noise = torch.randn_like(clean)
        timesteps = torch.randint(0, TRAIN_TIMESTEPS, (clean.shape[0],))
        noisy = noise_scheduler.add_noise(clean, noise, timesteps)
        loss = F.mse_loss(unet(noisy, timesteps).sample, noise)
        accelerator.backward(loss)
        optimizer.step()
        lr_schedule.step()
        optimizer.zero_grad()
        ema.step(unet.parameters())
        return loss.item()

    def folders(manifest: statekit.plugin_api.Manifest) -> dict:
        return {"folders": sorted({p.split("/")[0] for p in manifest.files if "/" in p})}

    step = harness.resume_step(manager, log) if resume else 0
    unet.train()
    step = harness.train_steps(args, manager, loader, train_step, log, step=step, abandon_at=abandon_at,
                               describe_save=folders)
    manager.wait()
    plugins = sorted(name for name, _ in statekit.get_plugin_manager().list_name_plugin() if name)
    log({"event": "done", "step": step, "plugins": plugins, "latest": manager.latest()})
    final = {"unet": accelerator.unwrap_model(unet), "optimizer": optimizer.optimizer, "ema": ema}
    statekit.save(args.final, final, step=step, overwrite=True)


# --------------------------------------------------------------------------- comparison, export, report


def compare_final(a: str, b: str) -> list[str]:
    """Differences between two final states written by ``train`` (empty if bit-identical)."""
    states = {}
    for name, url in (("reference", a), ("resumed", b)):
        checkpoint, manifest = checks.open_final(url)
        states[name] = {
            "unet": checkpoint.load_tensors("unet/diffusion_pytorch_model.safetensors"),
            "ema": checkpoint.load_tensors("unet_ema/diffusion_pytorch_model.safetensors"),
            "counters": manifest.records["diffusers"]["ema"]["counters"],
            "optimizer": checkpoint.load_state("optimizer"),
        }
    ref, res = states["reference"], states["resumed"]
    problems = []
    for part in ("unet", "ema"):
        problems += checks.tensor_differences(ref[part], res[part], f"{part} weight")
    if ref["counters"] != res["counters"]:
        problems.append(f"EMA counters differ: {ref['counters']} vs {res['counters']}")
    return problems + checks.optimizer_differences(ref["optimizer"], res["optimizer"])


def export(checkpoint_url: str, export_dir: Path) -> str:
    """``statekit convert CKPT OUT --to diffusers``; returns how it was done."""
    command = shutil.which("statekit") or os.path.join(os.path.dirname(sys.executable), "statekit")
    if os.path.exists(command) and not checkpoint_url.startswith("memory://"):  # memory:// is per process
        subprocess.run([command, "convert", checkpoint_url, str(export_dir), "--to", "diffusers"], check=True)
        return "statekit convert --to diffusers"
    statekit_diffusers.convert(checkpoint_url, str(export_dir))  # the CLI is not installed: call its converter
    return "statekit_diffusers.convert()"


def export_and_sample(checkpoint_url: str, export_dir: Path, png: Path, count: int, seed: int) -> dict:
    """``statekit convert CKPT OUT --to diffusers``, then sample a grid from the exported pipeline."""
    started = time.perf_counter()
    how = export(checkpoint_url, export_dir)
    export_seconds = time.perf_counter() - started
    pipeline = DDPMPipeline.from_pretrained(str(export_dir))
    pipeline.set_progress_bar_config(disable=True)
    started = time.perf_counter()
    images = pipeline(batch_size=count, num_inference_steps=TRAIN_TIMESTEPS, generator=torch.Generator().manual_seed(seed),
                      output_type="np").images
    sample_seconds = time.perf_counter() - started
    side = math.ceil(math.sqrt(count))
    scale = 4
    grid = Image.new("L", (side * IMAGE_SIZE * scale + (side + 1) * 2, side * IMAGE_SIZE * scale + (side + 1) * 2), 255)
    for i, image in enumerate(images):
        tile = Image.fromarray((image[..., 0] * 255).round().clip(0, 255).astype("uint8"), "L")
        tile = tile.resize((IMAGE_SIZE * scale, IMAGE_SIZE * scale), Image.NEAREST)
        row, col = divmod(i, side)
        grid.paste(tile, (2 + col * (IMAGE_SIZE * scale + 2), 2 + row * (IMAGE_SIZE * scale + 2)))
    png.parent.mkdir(parents=True, exist_ok=True)
    grid.save(png)
    return {"how": how, "export_seconds": export_seconds, "sample_seconds": sample_seconds,
            "components": sorted(p.name for p in export_dir.iterdir())}


def report(args: argparse.Namespace, runs: harness.Runs, exported: dict, total_seconds: float) -> int:
    analysis = checks.analyse(runs.ref_events(), runs.run_events())
    problems = analysis.problems + compare_final(runs.ref_final, runs.run_final)
    losses = list(analysis.ref_losses.values())
    first_loss, last_loss = sum(losses[:20]) / 20, sum(losses[-20:]) / 20
    saves = analysis.saves
    rows = [
        ("checkpoint root", args.url),
        ("steps", f"{args.steps} (loss {first_loss:.3f} -> {last_loss:.3f}, mean of 20 steps)"),
        ("resumed from step", analysis.resumed),
        ("checkpoints written", analysis.written),
        ("checkpoint folders", ", ".join(saves[-1]["folders"]) if saves else "-"),
        ("save seconds", analysis.save_seconds),
        ("load seconds", f"{analysis.load_seconds:.4f}"),
        ("plugins active", ", ".join(analysis.done["plugins"]) or "none"),
        ("export", f"{exported['how']}: {', '.join(exported['components'])} ({exported['export_seconds']:.2f} s)"),
        ("samples", f"{args.samples} from DDPMPipeline.from_pretrained, {TRAIN_TIMESTEPS} steps "
                    f"({exported['sample_seconds']:.1f} s) -> {args.out}"),
        ("total seconds", f"{total_seconds:.0f}"),
    ]
    exact = ["UNet, EMA weights and counters, optimizer state and all per-step losses",
             "equal the reference bit for bit"]
    return checks.print_report("statekit DDPM demo report", rows, problems, exact)


def main(argv: list[str] | None = None) -> int:
    parser = harness.demo_parser(__doc__, "ddpm-demo", steps=300, steps_help="about 5.4 epochs", save_every=20,
                                 keep_last=2)
    parser.add_argument("--out", default="ddpm_samples.png", help="PNG grid of samples (default: ddpm_samples.png)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--samples", type=int, default=25, help="images in the grid")
    args = parser.parse_args(argv)
    if args.preempt_eval:
        parser.error("--preempt-eval: examples/resume_demo.py only (make demo-preempt-eval)")

    if args.worker:
        train(args, harness.jsonl_logger(Path(args.log)), resume=args.resume)
        return 0

    started = time.perf_counter()
    with harness.demo_storage(args, "ddpm-demo"):
        runs = harness.kill_and_resume(
            args,
            title="statekit DDPM demo",
            script=__file__,
            train=train,
            worker_flags=["--lr", str(args.lr)],
            batches_per_epoch=DIGITS // args.batch_size,  # drop_last=True
            work_prefix="statekit-ddpm-demo-",
        )
        latest = [r for r in runs.run_events() if r["event"] == "done"][-1]["latest"]
        print(f"4. export {latest} as a diffusers pipeline and sample {args.samples} digits ...", flush=True)
        exported = export_and_sample(latest, runs.work / "pipeline", Path(args.out), args.samples, args.seed)
        return report(args, runs, exported, time.perf_counter() - started)


if __name__ == "__main__":
    sys.exit(main())
