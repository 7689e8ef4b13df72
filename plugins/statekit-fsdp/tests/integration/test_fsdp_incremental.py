"""statekit-fsdp with incremental saves (issue 29): every rank's unchanged frozen shard is
reused from the run's last checkpoint, never written again, and every checkpoint resumes
exactly.

One 2-rank torchrun (gloo, CPU) trains an FSDP2 model whose ``inp`` and ``hidden`` layers
are frozen and saves three times through ``statekit.CheckpointManager`` (incremental by
default), a training step before each save; before the third save rank 1 edits its shard
of the frozen ``hidden.weight`` in place (see ``fsdp_worker.py incremental``). The tests
read the committed manifests and the files on disk, then load the checkpoints into fresh
models in this process.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from fsdp_testlib import assert_full_equal, load_full, torchrun
from fsdp_worker import build, full_state, scheduler

import statekit

RANKS = (0, 1)

# loading the 2-rank checkpoints into one process warns (world size 2 -> 1, no rng plugin
# here): expected, and not what these tests are about
pytestmark = [pytest.mark.filterwarnings("ignore::statekit.ResumeFingerprintWarning"),
              pytest.mark.usefixtures("fsdp_only")]


def manifest_of(url: Path) -> statekit.Manifest:
    from statekit.format.manifest import read_manifest
    from statekit.storage import Storage

    return read_manifest(Storage(str(url)))


def frozen_file(rank: int) -> str:
    return f"model/rank-{rank:05d}.frozen.safetensors"


def trainable_file(rank: int) -> str:
    return f"model/rank-{rank:05d}.safetensors"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("fsdp-incremental")
    torchrun(2, "incremental", "--flavor", "fsdp2", "--url", str(d / "run"), "--full", str(d / "full"))
    return {
        "root": d / "run",
        **{f"ckpt{s}": d / "run" / f"checkpoint-{s:08d}" for s in (1, 2, 3)},
        "full2": d / "full-2.safetensors",
        "full3": d / "full-3.safetensors",
    }


def test_every_rank_reuses_its_unchanged_frozen_shard(run: dict[str, Path]) -> None:
    first, second = manifest_of(run["ckpt1"]), manifest_of(run["ckpt2"])
    for rank in RANKS:
        rel = frozen_file(rank)
        assert first.files[rel].reused_from is None  # the run's first save writes everything
        assert second.files[rel].reused_from == "checkpoint-00000001", rel
        assert second.files[rel].rank == rank and second.files[rel].writer == "fsdp"
        assert second.files[rel].checksum == first.files[rel].checksum
        before, after = os.stat(run["ckpt1"] / rel), os.stat(run["ckpt2"] / rel)
        assert after.st_ino == before.st_ino and after.st_nlink > 1, f"{rel} is not a hard link of checkpoint 1's"
        # the trainable chunks and the optimizer state changed: written again
        changed = trainable_file(rank)
        assert second.files[changed].reused_from is None, changed
        assert os.stat(run["ckpt2"] / changed).st_ino != os.stat(run["ckpt1"] / changed).st_ino
    model_files = {rel: e for rel, e in second.files.items() if rel.startswith("model/")}
    reused = {rel for rel, e in model_files.items() if e.reused_from}
    assert reused == {frozen_file(r) for r in RANKS}  # metadata.json, state.json and the rest: written
    # (the unchanged RNG state of the rng plugin, training draws no random numbers, is reused too)
    assert second.reused_bytes == sum(e.size_bytes for e in second.files.values() if e.reused_from)
    assert second.written_bytes == second.size_bytes - second.reused_bytes


def test_frozen_chunks_and_the_rest_are_in_separate_files(run: dict[str, Path]) -> None:
    from safetensors import safe_open

    for rank in RANKS:
        with safe_open(str(run["ckpt2"] / frozen_file(rank)), framework="pt") as f:
            frozen = set(f.keys())
        with safe_open(str(run["ckpt2"] / trainable_file(rank)), framework="pt") as f:
            rest = set(f.keys())
        assert {k.split("@")[0] for k in frozen} == {
            f"model.{layer}.{p}" for layer in ("inp", "hidden") for p in ("weight", "bias")
        }
        assert all(k.startswith(("model.out.", "model.scale", "optim.")) for k in rest), sorted(rest)


def test_a_frozen_shard_edited_in_place_on_one_rank_is_written_again(run: dict[str, Path]) -> None:
    third = manifest_of(run["ckpt3"])
    assert third.files[frozen_file(1)].reused_from is None  # rank 1 edited its shard
    assert third.files[frozen_file(1)].checksum != manifest_of(run["ckpt2"]).files[frozen_file(1)].checksum
    assert os.stat(run["ckpt3"] / frozen_file(1)).st_ino != os.stat(run["ckpt2"] / frozen_file(1)).st_ino
    assert third.files[frozen_file(0)].reused_from == "checkpoint-00000002"  # rank 0's did not change
    assert os.stat(run["ckpt3"] / frozen_file(0)).st_ino == os.stat(run["ckpt1"] / frozen_file(0)).st_ino
    before, after = load_full(run["full2"])[0]["model.hidden.weight"], load_full(run["full3"])[0]["model.hidden.weight"]
    assert not torch.equal(before, after)  # the edit is in the state that was saved


@pytest.mark.parametrize("step", [2, 3])
def test_each_checkpoint_resumes_exactly_in_a_fresh_process(run: dict[str, Path], step: int) -> None:
    model, optim = build("plain", seed=1, frozen=True)
    sched = scheduler(optim)
    statekit.load(str(run[f"ckpt{step}"]), {"model": model, "optim": optim, "sched": sched})
    assert sched.last_epoch == step
    assert_full_equal(run[f"full{step}"], full_state(model, optim)[0])


def test_manager_resume_restores_the_newest_checkpoint(run: dict[str, Path]) -> None:
    model, optim = build("plain", seed=1, frozen=True)
    manager = statekit.CheckpointManager({"model": model, "optim": optim, "sched": scheduler(optim)}, str(run["root"]))
    assert manager.resume() == 3
    assert_full_equal(run["full3"], full_state(model, optim)[0])


def test_consolidate_writes_the_frozen_files_of_a_core_model_too(tmp_path: Path) -> None:
    """A replicated (core) model of an incremental save spans <key>.safetensors and
    <key>.frozen-*.safetensors: ``statekit convert --to safetensors`` writes all of it."""
    from safetensors.torch import load_file
    from statekit_fsdp import consolidate

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 4))  # 1 MiB frozen base + a head
    model[0].requires_grad_(False)
    manifest = statekit.CheckpointManager({"model": model}, str(tmp_path / "run")).save(1)
    assert any(rel.startswith("model.frozen-") for rel in manifest.files)  # the split layout
    consolidate(str(tmp_path / "run" / "checkpoint-00000001"), str(tmp_path / "out"))
    out = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(out) == sorted(model.state_dict())
    assert all(torch.equal(out[k], v) for k, v in model.state_dict().items())
