"""Two real torchrun processes (gloo, CPU) with Accelerate DDP: save, kill, resume exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import statekit

from accelerate_helpers import torchrun

pytest.importorskip("accelerate")


def _torchrun(*args: str, **env: str) -> None:
    torchrun("ddp_resume.py", *args, env=env)


def _read(prefix: Path) -> list[dict]:
    return [json.loads(Path(f"{prefix}.rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_two_process_ddp_resume_is_exact(tmp_path):
    _torchrun("reference", str(tmp_path / "ref-root"), str(tmp_path / "ref"))
    root = tmp_path / "root"
    _torchrun("first", str(root), str(tmp_path / "first"))
    checkpoint = root / "checkpoint-00000009"
    manifest = statekit.format.manifest.read_manifest(statekit.storage.Storage(str(checkpoint)))
    files = manifest.files
    assert manifest.world_size == 2
    assert files["model_0.safetensors"].rank == 0  # replicated: written once
    assert not any(p.startswith("model_0") and p != "model_0.safetensors" for p in files)
    for rank in (0, 1):  # per rank: RNG and data loader position, from every rank
        assert files[f"rng/rank-{rank:05d}.json"].rank == rank
        assert files[f"dataloader_0/rank-{rank:05d}.json"].rank == rank
    statekit.verify(str(checkpoint))

    _torchrun("resume", str(root), str(tmp_path / "resumed"))
    reference, first, resumed = _read(tmp_path / "ref"), _read(tmp_path / "first"), _read(tmp_path / "resumed")
    for rank in (0, 1):
        assert first[rank]["losses"][:9] + resumed[rank]["losses"] == reference[rank]["losses"], f"rank {rank}"
        assert resumed[rank]["weights"] == reference[rank]["weights"]


@pytest.mark.slow
def test_two_process_resume_mid_gradient_accumulation_is_exact(tmp_path):
    """Accumulation 4 under DDP, saved 2 micro-batches into a window: inside ``no_sync``
    each rank holds its own unreduced gradients, saved and restored per rank."""
    _torchrun("reference", str(tmp_path / "ref-root"), str(tmp_path / "ref"), "4")
    root = tmp_path / "root"
    _torchrun("first", str(root), str(tmp_path / "first"), "4")
    checkpoint = root / "checkpoint-00000009"
    grads = []
    for rank in (0, 1):
        with safe_open(str(checkpoint / "gradients" / f"rank-{rank:05d}.safetensors"), "pt") as f:
            grads.append({k: f.get_tensor(k) for k in f.keys()})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    assert all(not torch.equal(grads[0][k], grads[1][k]) for k in grads[0])  # per rank, not reduced
    _torchrun("resume", str(root), str(tmp_path / "resumed"), "4")
    reference, first, resumed = _read(tmp_path / "ref"), _read(tmp_path / "first"), _read(tmp_path / "resumed")
    for rank in (0, 1):
        assert first[rank]["losses"][:9] + resumed[rank]["losses"] == reference[rank]["losses"], f"rank {rank}"
        assert resumed[rank]["weights"] == reference[rank]["weights"]


@pytest.mark.slow
@pytest.mark.s3
def test_two_ranks_with_separate_local_roots_replicate_into_one_remote_checkpoint(tmp_path, s3_bucket):
    """Two torchrun ranks, each with its own local root (two nodes' disks), saving
    asynchronously: each replicates the files it wrote, rank 0 commits the remote manifest
    once both parts verify; fresh, empty local roots then resume bit-exactly from it."""
    remote = f"{s3_bucket}/run"
    _torchrun("reference", str(tmp_path / "ref-root"), str(tmp_path / "ref"))
    roots = str(tmp_path / "node{rank}")
    _torchrun("first", roots, str(tmp_path / "first"), STATEKIT_TEST_REPLICATE_TO=remote, STATEKIT_TEST_ASYNC="1")
    name = "checkpoint-00000009"
    node0, node1 = tmp_path / "node0" / name, tmp_path / "node1" / name
    assert (node0 / "statekit.json").exists() and not (node1 / "statekit.json").exists()
    assert (node1 / "rng" / "rank-00001.json").exists() and not (node0 / "rng" / "rank-00001.json").exists()
    manifest = statekit.verify(f"{remote}/{name}")  # every file of both ranks, sizes and checksums
    assert manifest.world_size == 2 and (node0 / "statekit.json").read_bytes() == statekit.storage.Storage(
        f"{remote}/{name}").read_bytes("statekit.json")
    remote_files = set(statekit.storage.Storage(f"{remote}/{name}").find())
    assert remote_files == set(manifest.files) | {"statekit.json"}  # no rank markers left behind

    fresh = str(tmp_path / "fresh{rank}")
    _torchrun("resume", fresh, str(tmp_path / "resumed"), STATEKIT_TEST_REPLICATE_TO=remote)
    reference, first, resumed = _read(tmp_path / "ref"), _read(tmp_path / "first"), _read(tmp_path / "resumed")
    for rank in (0, 1):
        assert first[rank]["losses"][:9] + resumed[rank]["losses"] == reference[rank]["losses"], f"rank {rank}"
        assert resumed[rank]["weights"] == reference[rank]["weights"]
