"""World-size change: a checkpoint saved by 2 ranks (a real torchrun, gloo) loads in one
process with rank 0's state restored and rank 1 reported as not restored."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import statekit
import statekit_rng.plugin as rng_plugin
from statekit.engine.context import Checkpoint
from statekit.storage import Storage

SCRIPT = Path(__file__).resolve().parent.parent / "_rng_two_ranks.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_saved_by_two_ranks_loaded_by_one_warns_rank_1(pm, tmp_path, fake_devices) -> None:
    url, out = str(tmp_path / "ckpt"), tmp_path / "rank0.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("STATEKIT_")}
    env.update(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
        f"--master_port={_free_port()}", str(SCRIPT), url, str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rank0 = json.loads(out.read_text())
    assert rank0["world_size"] == 2

    fake_devices(None)
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        manifest = statekit.load(url, {"w": torch.ones(2)})
    messages = [str(w.message) for w in caught if "statekit-rng" in str(w.message)]
    assert len(messages) == 1, messages
    assert "RNG state of rank 1 (saved with world size 2, loaded with 1)" in messages[0]
    assert "rank 0" not in messages[0]
    assert {"rng/rank-00000.json", "rng/rank-00001.json"} <= set(manifest.files)
    assert manifest.files["rng/rank-00001.json"].rank == 1

    got = {"python": random.random(), "numpy": float(np.random.rand()), "torch": torch.rand(3).tolist()}
    assert got == rank0["expected"]


def test_rank_without_saved_state_warns(pm, memory_url: str, fake_devices) -> None:
    """Saved by one process, loaded as rank 1 of 2: rank 1 has no file and says so."""
    fake_devices(None)
    manifest = statekit.save(memory_url, {"w": torch.ones(2)})
    checkpoint = Checkpoint(Storage(memory_url), mode="load", rank=1, world_size=2, manifest=manifest)
    checkpoint.plugin = "rng"  # as statekit.hooks.registry.call_each sets it
    torch.manual_seed(4)
    before = torch.get_rng_state()
    with pytest.warns(statekit.StatekitWarning) as caught:
        rng_plugin.statekit_load_state_post(checkpoint)
    (message,) = [str(w.message) for w in caught]
    assert "all RNG state of rank 1" in message
    assert "no rng/rank-00001.json (saved with world size 1, loaded with 2)" in message
    assert torch.equal(torch.get_rng_state(), before)
