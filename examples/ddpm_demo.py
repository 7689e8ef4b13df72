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
import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

import torch
import torch.nn.functional as F

IMAGE_SIZE = 16
TRAIN_TIMESTEPS = 200


# --------------------------------------------------------------------------- the training run


def digits() -> torch.utils.data.TensorDataset:
    """scikit-learn's digits, 16x16, scaled to [-1, 1]: 1,797 images of shape (1, 16, 16)."""
    from sklearn.datasets import load_digits

    x = torch.tensor(load_digits().images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = F.interpolate(x, size=(IMAGE_SIZE, IMAGE_SIZE), mode="bilinear", align_corners=False)
    return torch.utils.data.TensorDataset(x.clamp(0, 1) * 2 - 1)


def make_unet():
    from diffusers import UNet2DModel

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
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from diffusers import DDPMScheduler
    from diffusers.training_utils import EMAModel

    import statekit
    import statekit_diffusers

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
    manager = statekit.CheckpointManager(accelerator, args.url, keep_last=args.keep_last)
    return accelerator, unet, optimizer, loader, lr_schedule, noise_scheduler, ema, manager


class Abandon(Exception):
    """Stands in for SIGKILL when the checkpoints live in this process (memory://)."""


def train(args: argparse.Namespace, log, resume: bool, abandon_at: int | None = None) -> None:
    """Train to ``args.steps``; log every step, save and resume as JSON lines to ``log``."""
    import statekit

    accelerator, unet, optimizer, loader, lr_schedule, noise_scheduler, ema, manager = build(args)
    step = 0
    if resume:
        started = time.perf_counter()
        step = manager.resume() or 0
        log({"event": "resume", "step": step, "seconds": time.perf_counter() - started})
    unet.train()
    while step < args.steps:
        for (clean,) in loader:
            noise = torch.randn_like(clean)
            timesteps = torch.randint(0, TRAIN_TIMESTEPS, (clean.shape[0],))
            noisy = noise_scheduler.add_noise(clean, noise, timesteps)
            loss = F.mse_loss(unet(noisy, timesteps).sample, noise)
            accelerator.backward(loss)
            optimizer.step()
            lr_schedule.step()
            optimizer.zero_grad()
            ema.step(unet.parameters())
            step += 1
            log({"event": "step", "step": step, "loss": loss.item()})
            if abandon_at is not None and step == abandon_at:
                raise Abandon(step)
            if step % args.save_every == 0:
                started = time.perf_counter()
                manifest = manager.save(step, metrics={"loss": loss.item()})
                size = sum(f["size_bytes"] for f in manifest["files"].values())
                log({"event": "save", "step": step, "seconds": time.perf_counter() - started, "bytes": size,
                     "folders": sorted({p.split("/")[0] for p in manifest["files"] if "/" in p})})
            if step >= args.steps:
                break
    manager.wait()
    plugins = sorted(name for name, _ in statekit.get_plugin_manager().list_name_plugin() if name)
    log({"event": "done", "step": step, "plugins": plugins, "latest": manager.latest()})
    final = {"unet": accelerator.unwrap_model(unet), "optimizer": optimizer.optimizer, "ema": ema}
    statekit.save(args.final, final, step=step, overwrite=True)


# --------------------------------------------------------------------------- orchestration


def jsonl_logger(path: Path):
    handle = path.open("a", buffering=1)

    def log(record: dict) -> None:
        handle.write(json.dumps(record) + "\n")
        handle.flush()

    return log


def read_log(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def worker_command(args: argparse.Namespace, log: Path, final: str, resume: bool) -> list[str]:
    cmd = [sys.executable, __file__, "--worker", "--url", args.url, "--steps", str(args.steps),
           "--save-every", str(args.save_every), "--batch-size", str(args.batch_size), "--seed", str(args.seed),
           "--lr", str(args.lr), "--keep-last", str(args.keep_last), "--log", str(log), "--final", final]
    if resume:
        cmd.append("--resume")
    return cmd


def run_to_end(cmd: list[str]) -> None:
    result = subprocess.run(cmd)
    if result.returncode != 0:
        raise SystemExit(f"worker failed with exit code {result.returncode}: {' '.join(cmd)}")


def run_and_kill(cmd: list[str], log: Path, kill_at: int) -> int:
    """Start the worker and SIGKILL it once it reports step >= kill_at; returns the last step seen."""
    child = subprocess.Popen(cmd)
    try:
        while child.poll() is None:
            steps = [r["step"] for r in read_log(log) if r["event"] == "step"]
            if steps and steps[-1] >= kill_at:
                os.kill(child.pid, signal.SIGKILL)
                child.wait()
                return steps[-1]
            time.sleep(0.002)
    finally:
        if child.poll() is None:
            child.kill()
    raise SystemExit(f"the worker finished (exit code {child.returncode}) before it could be killed at step {kill_at}")


def compare_final(a: str, b: str) -> list[str]:
    """Differences between two final states written by ``train`` (empty if bit-identical)."""
    from statekit.engine.context import Checkpoint
    from statekit.api.saveload import read_manifest
    from statekit.storage import Storage

    states = {}
    for name, url in (("reference", a), ("resumed", b)):
        storage = Storage(url)
        manifest = read_manifest(storage)
        checkpoint = Checkpoint(storage, mode="load", manifest=manifest)
        states[name] = {
            "unet": checkpoint.load_tensors("unet/diffusion_pytorch_model.safetensors"),
            "ema": checkpoint.load_tensors("unet_ema/diffusion_pytorch_model.safetensors"),
            "counters": manifest["records"]["diffusers"]["ema"]["counters"],
            "optimizer": checkpoint.load_state("optimizer"),
        }
    ref, res = states["reference"], states["resumed"]
    problems = []
    for part in ("unet", "ema"):
        for key, t in ref[part].items():
            if not torch.equal(t, res[part][key]):
                problems.append(f"{part} weight {key} differs (max abs diff {(t - res[part][key]).abs().max().item():.3g})")
    if ref["counters"] != res["counters"]:
        problems.append(f"EMA counters differ: {ref['counters']} vs {res['counters']}")
    for index, state in ref["optimizer"]["state"].items():
        for name, value in state.items():
            if not torch.equal(torch.as_tensor(value), torch.as_tensor(res["optimizer"]["state"][index][name])):
                problems.append(f"optimizer state {index}.{name} differs")
    if ref["optimizer"]["param_groups"] != res["optimizer"]["param_groups"]:
        problems.append("optimizer param_groups differ")
    return problems


def export_and_sample(checkpoint_url: str, export_dir: Path, png: Path, count: int, seed: int) -> dict:
    """``statekit convert CKPT OUT --to diffusers``, then sample a grid from the exported pipeline."""
    started = time.perf_counter()
    command = shutil.which("statekit") or os.path.join(os.path.dirname(sys.executable), "statekit")
    if os.path.exists(command) and not checkpoint_url.startswith("memory://"):  # memory:// is per process
        subprocess.run([command, "convert", checkpoint_url, str(export_dir), "--to", "diffusers"], check=True)
        how = "statekit convert --to diffusers"
    else:  # the CLI is not installed: call the converter it would call
        import statekit_diffusers

        statekit_diffusers.convert(checkpoint_url, str(export_dir))
        how = "statekit_diffusers.convert()"
    export_seconds = time.perf_counter() - started

    from diffusers import DDPMPipeline
    from PIL import Image

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


def start_moto() -> tuple[subprocess.Popen, str]:
    """Start moto's S3 server on a free local port; returns (process, endpoint URL)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            urllib.request.urlopen(endpoint, timeout=1)
            break
        except Exception:
            time.sleep(0.05)
    os.environ.update({"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1"})
    import s3fs

    s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}).mkdir("statekit-demo")
    return server, endpoint


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="ddpm_samples.png", help="PNG grid of samples (default: ddpm_samples.png)")
    parser.add_argument("--url", default=None, help="checkpoint root URL (default: ./runs/ddpm-demo-<id>)")
    parser.add_argument("--moto", action="store_true", help="start a local moto S3 server and use s3://statekit-demo/...")
    parser.add_argument("--steps", type=int, default=300, help="training steps (default 300: about 5.4 epochs)")
    parser.add_argument("--save-every", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--keep-last", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--samples", type=int, default=25, help="images in the grid")
    parser.add_argument("--kill-at", type=int, default=None, help="step to kill at (default: random, mid-epoch)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--log", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--final", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        train(args, jsonl_logger(Path(args.log)), resume=args.resume)
        return 0

    started = time.perf_counter()
    server = None
    if args.moto:
        server, endpoint = start_moto()
        args.url = args.url or f"s3://statekit-demo/ddpm-demo-{uuid.uuid4().hex[:8]}"
        print(f"moto S3 server at {endpoint}")
    args.url = args.url or str(Path("runs") / f"ddpm-demo-{uuid.uuid4().hex[:8]}")
    in_process = args.url.startswith("memory://")
    work = Path(tempfile.mkdtemp(prefix="statekit-ddpm-demo-"))
    batches_per_epoch = 1797 // args.batch_size
    kill_at = args.kill_at
    rng = random.Random()
    while kill_at is None or kill_at % batches_per_epoch == 0:
        kill_at = rng.randrange(args.save_every + 1, args.steps - 1)
    print(f"statekit DDPM demo: {args.steps} steps, checkpoint every {args.save_every} to {args.url}")
    try:
        ref_log, run_log = work / "reference.jsonl", work / "run.jsonl"
        ref_final, run_final = str(work / "final-reference"), str(work / "final-resumed")
        ref_args = argparse.Namespace(**{**vars(args), "url": f"{args.url.rstrip('/')}-reference", "log": str(ref_log), "final": ref_final})
        run_args = argparse.Namespace(**{**vars(args), "log": str(run_log), "final": run_final})
        print("1. reference run ...", flush=True)
        if in_process:
            train(ref_args, jsonl_logger(ref_log), resume=False)
        else:
            run_to_end(worker_command(ref_args, ref_log, ref_final, resume=False))
        print(f"2. run killed at step {kill_at} (mid-epoch: batch {kill_at % batches_per_epoch} of {batches_per_epoch}) ...", flush=True)
        if in_process:
            try:
                train(run_args, jsonl_logger(run_log), resume=False, abandon_at=kill_at)
            except Abandon:
                pass
            killed_at = kill_at
        else:
            killed_at = run_and_kill(worker_command(run_args, run_log, run_final, resume=False), run_log, kill_at)
        print(f"   killed after step {killed_at}")
        print("3. resumed run ...", flush=True)
        if in_process:
            train(run_args, jsonl_logger(run_log), resume=True)
        else:
            run_to_end(worker_command(run_args, run_log, run_final, resume=True))
        run_events = read_log(run_log)
        latest = [r for r in run_events if r["event"] == "done"][-1]["latest"]
        print(f"4. export {latest} as a diffusers pipeline and sample {args.samples} digits ...", flush=True)
        exported = export_and_sample(latest, work / "pipeline", Path(args.out), args.samples, args.seed)
        return report(args, read_log(ref_log), run_events, ref_final, run_final, exported, time.perf_counter() - started)
    finally:
        if server is not None:
            server.terminate()


def report(args, ref_events, run_events, ref_final, run_final, exported, total_seconds) -> int:
    ref_losses = {r["step"]: r["loss"] for r in ref_events if r["event"] == "step"}
    resume_events = [r for r in run_events if r["event"] == "resume"]
    resumed_step = resume_events[-1]["step"]
    first_run = run_events[: run_events.index(resume_events[-1])]
    second_run = run_events[run_events.index(resume_events[-1]) :]
    history = {r["step"]: r["loss"] for r in first_run if r["event"] == "step" and r["step"] <= resumed_step}
    history.update({r["step"]: r["loss"] for r in second_run if r["event"] == "step"})
    replayed = {r["step"]: r["loss"] for r in first_run if r["event"] == "step" and r["step"] > resumed_step}
    problems = [f"loss at step {s} differs: {history.get(s)!r} vs reference {l!r}" for s, l in ref_losses.items() if history.get(s) != l]
    problems += [f"replayed step {s} differs from the killed run" for s, l in replayed.items() if history.get(s) != l]
    problems += compare_final(ref_final, run_final)
    saves = [r for r in run_events if r["event"] == "save"]
    done = [r for r in run_events if r["event"] == "done"][-1]
    first_loss = sum(list(ref_losses.values())[:20]) / 20
    last_loss = sum(list(ref_losses.values())[-20:]) / 20
    print()
    print("statekit DDPM demo report")
    print(f"  checkpoint root      {args.url}")
    print(f"  steps                {args.steps} (loss {first_loss:.3f} -> {last_loss:.3f}, mean of 20 steps)")
    print(f"  resumed from step    {resumed_step} (killed after step {max(replayed) if replayed else resumed_step})")
    print(f"  checkpoints written  {len(saves)}, {saves[-1]['bytes'] if saves else 0:,} bytes each")
    print(f"  checkpoint folders   {', '.join(saves[-1]['folders']) if saves else '-'}")
    print(f"  save seconds         median {sorted(r['seconds'] for r in saves)[len(saves) // 2]:.4f}" if saves else "")
    print(f"  load seconds         {resume_events[-1]['seconds']:.4f}")
    print(f"  plugins active       {', '.join(done['plugins']) or 'none'}")
    print(f"  export               {exported['how']}: {', '.join(exported['components'])} ({exported['export_seconds']:.2f} s)")
    print(f"  samples              {args.samples} from DDPMPipeline.from_pretrained, {TRAIN_TIMESTEPS} steps "
          f"({exported['sample_seconds']:.1f} s) -> {args.out}")
    print(f"  total seconds        {total_seconds:.0f}")
    if problems:
        print(f"  RESUME NOT EXACT: {len(problems)} differences")
        for p in problems[:20]:
            print(f"    - {p}")
        return 1
    print("  resume exact         yes: UNet, EMA weights and counters, optimizer state and all per-step losses")
    print("                       equal the reference bit for bit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
