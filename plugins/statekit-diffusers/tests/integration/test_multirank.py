"""Two ranks (gloo, DDP-wrapped UNet): rank 0 writes the folders, every rank takes and loads the model."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

WORKER = textwrap.dedent(
    """
    import sys, warnings
    import torch, torch.distributed as dist
    warnings.simplefilter("ignore")
    sys.path.insert(0, {tests!r})
    from conftest import tiny_unet, train_step
    import statekit
    from diffusers.training_utils import EMAModel

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    unet = tiny_unet(0)
    ema = EMAModel(unet.parameters(), decay=0.5)
    ddp = torch.nn.parallel.DistributedDataParallel(unet)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    train_step(ddp.module, opt, ema)
    manifest = statekit.save({url!r}, {{"unet": ddp, "ema": ema}})
    assert manifest.objects["unet"].owner == "diffusers", manifest.objects
    writers = {{f: e.rank for f, e in manifest.files.items() if f.startswith("unet")}}
    assert writers and set(writers.values()) == {{0}}, writers
    fresh = tiny_unet(1 + rank)
    fresh_ema = EMAModel(fresh.parameters())
    statekit.load({url!r}, {{"unet": torch.nn.parallel.DistributedDataParallel(fresh), "ema": fresh_ema}})
    for a, b in zip(unet.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)
    assert fresh_ema.decay == 0.5 and fresh_ema.optimization_step == 1
    print(f"rank {{rank}} ok", flush=True)  # one write of a whole line: the two ranks share the pipe
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
def test_two_ranks_ddp(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(tests=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), url=str(tmp_path / "ckpt")))
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(script)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "rank 0 ok" in result.stdout and "rank 1 ok" in result.stdout
