"""Gradient accumulation with a real FSDP2 model (one gloo rank, in its own process: the test
process stays without a process group): a save mid-window is refused, naming the model and
what to do (the in-process cases are in ``unit/engine/test_grad_accumulation.py``)."""

from __future__ import annotations

import pytest


_FSDP2_REFUSAL = """
import os, sys, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from statekit.engine.gradients import refuse_unsupported
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
from torch.distributed.device_mesh import init_device_mesh
fully_shard(model, mesh=init_device_mesh("cpu", (1,)))  # FSDP2: DTensor parameters (a CPU mesh: the default is CUDA where a GPU is)
class Accelerator:
    gradient_accumulation_steps, step, distributed_type = 4, 2, "DistributedType.FSDP"
try:
    refuse_unsupported(Accelerator(), [model])
finally:
    dist.destroy_process_group()
"""


@pytest.mark.slow
def test_fully_sharded_model_mid_accumulation_is_refused():
    """A real FSDP2 model (one gloo rank, in its own process: the test process stays
    without a process group)."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run([sys.executable, "-c", _FSDP2_REFUSAL, str(port)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "StatekitError: FSDPSequential (FSDP) holds sharded gradients" in proc.stderr, proc.stderr[-3000:]
    assert "save when accelerator.sync_gradients is True" in proc.stderr
