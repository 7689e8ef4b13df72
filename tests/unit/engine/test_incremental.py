"""Incremental checkpoints (issue 29): a tensor file whose bytes did not change since the run's
last committed checkpoint is reused from it (hard link locally, a copy on fsspec stores), and
every checkpoint still resumes the whole state exactly on its own."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from torch import nn

import statekit
from lora_helpers import lora_run, train_step
from repo_paths import TESTS


def assert_same_state(a: nn.Module, b: nn.Module, oa: torch.optim.Optimizer, ob: torch.optim.Optimizer) -> None:
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name
    sa, sb = oa.state_dict()["state"], ob.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for k in sa:
        for field in sa[k]:
            assert torch.equal(torch.as_tensor(sa[k][field]), torch.as_tensor(sb[k][field])), (k, field)


def inode(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def test_unchanged_frozen_weights_are_linked_and_every_checkpoint_resumes_exactly(tmp_path):
    model, optim = lora_run()
    root = str(tmp_path / "run")
    manager = statekit.CheckpointManager({"model": model, "optim": optim}, root)
    states = {}
    for step in (1, 2, 3):
        train_step(model, optim)
        manifest = manager.save(step)
        states[step] = ({k: v.clone() for k, v in model.state_dict().items()}, manifest)

    first, third = states[1][1], states[3][1]
    frozen = "model.frozen-00000.safetensors"
    assert first.format == "statekit/2" and set(first.objects["model"].files) == {"model.safetensors", frozen}
    assert first.files[frozen].reused_from is None  # the run's first save writes everything
    assert third.files[frozen].reused_from == "checkpoint-00000002"
    assert third.files["model.safetensors"].reused_from is None  # the adapters changed
    assert third.files["optim.safetensors"].reused_from is None
    # one copy of the frozen bytes on disk, listed by every checkpoint
    paths = [os.path.join(root, f"checkpoint-{s:08d}", frozen) for s in (1, 2, 3)]
    assert len({inode(p) for p in paths}) == 1
    # the frozen file holds only frozen tensors; the adapters and buffers are in the other
    with safe_open(paths[-1], "pt") as f:
        assert set(f.keys()) == {"0.base.weight", "0.base.bias", "2.base.weight", "2.base.bias"}

    for step in (1, 3):  # each checkpoint on its own: verified and exact
        url = os.path.join(root, f"checkpoint-{step:08d}")
        statekit.verify(url)
        fresh, fresh_optim = lora_run(seed=99)
        statekit.load(url, {"model": fresh, "optim": fresh_optim})
        for name, tensor in fresh.state_dict().items():
            assert torch.equal(tensor, states[step][0][name]), (step, name)
    fresh, fresh_optim = lora_run(seed=99)
    statekit.load(os.path.join(root, "checkpoint-00000003"), {"model": fresh, "optim": fresh_optim})
    assert_same_state(model, fresh, optim, fresh_optim)


def test_a_frozen_weight_edited_in_place_is_written_again(tmp_path):
    model, optim = lora_run()
    manager = statekit.CheckpointManager({"model": model, "optim": optim}, str(tmp_path / "run"))
    train_step(model, optim)
    manager.save(1)
    with torch.no_grad():
        model[2].base.weight[3, 7] += 1.0  # requires_grad is still False: only the bytes tell
    manifest = manager.save(2)
    assert manifest.files["model.frozen-00000.safetensors"].reused_from is None
    assert manifest.files["model.safetensors"].reused_from == "checkpoint-00000001"  # nothing else changed
    fresh, fresh_optim = lora_run(seed=5)
    statekit.load(str(tmp_path / "run" / "checkpoint-00000002"), {"model": fresh, "optim": fresh_optim})
    assert torch.equal(fresh[2].base.weight, model[2].base.weight)


def test_retention_keeps_the_bytes_a_kept_checkpoint_needs(tmp_path):
    model, optim = lora_run()
    root = tmp_path / "run"
    manager = statekit.CheckpointManager({"model": model, "optim": optim}, str(root), keep_last=1)
    for step in (1, 2, 3):
        train_step(model, optim)
        manager.save(step)
    assert sorted(os.listdir(root)) == ["checkpoint-00000003", "latest"]
    statekit.verify(str(root / "checkpoint-00000003"))  # the first save's frozen bytes, through the link
    fresh, fresh_optim = lora_run(seed=7)
    assert statekit.CheckpointManager({"model": fresh, "optim": fresh_optim}, str(root)).resume() == 3
    assert_same_state(model, fresh, optim, fresh_optim)


def test_a_copied_away_checkpoint_is_whole(tmp_path):
    model, optim = lora_run()
    manager = statekit.CheckpointManager({"model": model, "optim": optim}, str(tmp_path / "run"))
    for step in (1, 2):
        train_step(model, optim)
        manager.save(step)
    copy = tmp_path / "elsewhere"
    shutil.copytree(tmp_path / "run" / "checkpoint-00000002", copy)
    shutil.rmtree(tmp_path / "run")
    statekit.verify(str(copy))
    fresh, fresh_optim = lora_run(seed=3)
    statekit.load(str(copy), {"model": fresh, "optim": fresh_optim})
    assert_same_state(model, fresh, optim, fresh_optim)


def test_a_resumed_run_reuses_the_files_of_the_checkpoint_it_resumed_from(tmp_path):
    model, optim = lora_run()
    root = str(tmp_path / "run")
    statekit.CheckpointManager({"model": model, "optim": optim}, root).save(1)
    again, again_optim = lora_run(seed=11)
    manager = statekit.CheckpointManager({"model": again, "optim": again_optim}, root)
    assert manager.resume() == 1
    train_step(again, again_optim)
    manifest = manager.save(2)
    assert manifest.files["model.frozen-00000.safetensors"].reused_from == "checkpoint-00000001"


def test_a_fully_trained_model_stays_one_file_of_format_1(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = statekit.CheckpointManager({"model": model, "optim": optim}, str(tmp_path / "run"))
    first = manager.save(1)
    model(torch.randn(2, 64)).sum().backward()
    optim.step()
    second = manager.save(2)
    third = manager.save(3)  # nothing changed since step 2
    assert first.format == "statekit/1" and first.objects["model"].files == ("model.safetensors",)
    assert second.files["model.safetensors"].reused_from is None
    assert third.files["model.safetensors"].reused_from == "checkpoint-00000002"
    raw = json.loads((tmp_path / "run" / "checkpoint-00000002" / "statekit.json").read_text())
    entry = raw["files"]["model.safetensors"]
    assert set(entry) == {"size_bytes", "checksum", "rank", "writer", "prefixes"}
    assert entry["prefixes"][0][0] < entry["size_bytes"]  # the end of the header: the first comparison


class TiedLM(nn.Module):
    """A frozen embedding tied to the output head (GPT-2's ``lm_head.weight is wte.weight``),
    1 MiB, around a trainable layer."""

    def __init__(self, vocab: int = 2048, width: int = 128) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.mid = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.wte.weight
        self.wte.requires_grad_(False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.mid(self.wte(ids)))


def test_a_frozen_tied_embedding_is_one_frozen_file_reused_and_stays_tied(tmp_path):
    torch.manual_seed(0)
    model = TiedLM()
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    root = tmp_path / "run"
    manager = statekit.CheckpointManager({"model": model, "optim": optim}, str(root))
    manifests = []
    for step in (1, 2):
        model(torch.randint(0, 2048, (2, 8))).square().mean().backward()
        optim.step()
        optim.zero_grad()
        manifests.append(manager.save(step))

    frozen = "model.frozen-00000.safetensors"
    assert set(manifests[1].objects["model"].files) == {"model.safetensors", frozen}  # the tie stays in one file
    assert manifests[1].files[frozen].reused_from == "checkpoint-00000001"
    assert manifests[1].reused_bytes >= model.wte.weight.numel() * 4  # stored once, not once per name
    with safe_open(str(root / "checkpoint-00000002" / "model.safetensors"), "pt") as f:
        assert "head.weight" not in f.keys() and "wte.weight" not in f.keys()

    torch.manual_seed(1)
    fresh = TiedLM()
    statekit.load(str(root / "checkpoint-00000002"), {"model": fresh})
    assert fresh.head.weight is fresh.wte.weight
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name


def test_incremental_false_writes_every_byte_as_before(tmp_path):
    model, optim = lora_run()
    manager = statekit.CheckpointManager({"model": model, "optim": optim}, str(tmp_path / "run"), incremental=False)
    manager.save(1)
    manifest = manager.save(2)
    assert manifest.format == "statekit/1" and manifest.objects["model"].files == ("model.safetensors",)
    assert all(e.reused_from is None and e.prefixes is None for e in manifest.files.values())


def test_an_async_save_reuses_and_resumes_exactly(tmp_path):
    model, optim = lora_run()
    root = str(tmp_path / "run")
    with statekit.CheckpointManager({"model": model, "optim": optim}, root, async_save=True) as manager:
        train_step(model, optim)
        manager.save(1)
        train_step(model, optim)
        manager.save(2)
        manifest = manager.wait()
    assert manifest.files["model.frozen-00000.safetensors"].reused_from == "checkpoint-00000001"
    fresh, fresh_optim = lora_run(seed=4)
    statekit.load(os.path.join(root, "checkpoint-00000002"), {"model": fresh, "optim": fresh_optim})
    assert_same_state(model, fresh, optim, fresh_optim)


def test_a_base_file_deleted_meanwhile_is_written_instead(tmp_path):
    model, optim = lora_run()
    root = tmp_path / "run"
    manager = statekit.CheckpointManager({"model": model, "optim": optim}, str(root))
    manager.save(1)
    os.unlink(root / "checkpoint-00000001" / "model.frozen-00000.safetensors")  # another process's gc, say
    manifest = manager.save(2)
    assert manifest.files["model.frozen-00000.safetensors"].reused_from is None
    statekit.verify(str(root / "checkpoint-00000002"))


def test_incremental_saves_on_every_storage(storage_url):
    model, optim = lora_run()
    manager = statekit.CheckpointManager({"model": model, "optim": optim}, storage_url)
    train_step(model, optim)
    manager.save(1)
    train_step(model, optim)
    manifest = manager.save(2)
    assert manifest.files["model.frozen-00000.safetensors"].reused_from == "checkpoint-00000001"
    fresh, fresh_optim = lora_run(seed=8)
    resumed = statekit.CheckpointManager({"model": fresh, "optim": fresh_optim}, storage_url)
    assert resumed.resume() == 2
    assert_same_state(model, fresh, optim, fresh_optim)


def test_with_accelerate_prepared_objects(tmp_path):
    from accelerate_helpers import fresh_accelerator

    model, optim = lora_run()
    accelerator = fresh_accelerator()  # (Accelerate's shared state reset: an earlier test's accumulation skips steps)
    model, optim = accelerator.prepare(model, optim)
    manager = statekit.CheckpointManager(accelerator, str(tmp_path / "run"))
    train_step(model, optim)
    manager.save(1)
    train_step(model, optim)
    manifest = manager.save(2)
    assert manifest.files["model_0.frozen-00000.safetensors"].reused_from == "checkpoint-00000001"
    assert manifest.files["model_0.safetensors"].reused_from is None


def test_a_run_resumed_from_a_full_checkpoint_compares_whole_files(tmp_path):
    model, optim = lora_run()
    train_step(model, optim)
    root = str(tmp_path / "run")
    full = statekit.CheckpointManager({"model": model, "optim": optim}, root, incremental=False).save(1)
    assert all(e.prefixes is None for e in full.files.values())
    manager = statekit.CheckpointManager({"model": model, "optim": optim}, root)
    assert manager.resume() == 1
    manifest = manager.save(2)  # nothing changed: the checksum of each whole file matches
    assert manifest.files["optim.safetensors"].reused_from == "checkpoint-00000001"
    assert manifest.files["model.frozen-00000.safetensors"].reused_from is None  # a new file (split layout)
    train_step(model, optim)
    assert manager.save(3).files["model.frozen-00000.safetensors"].reused_from == "checkpoint-00000002"


def test_replication_copies_unchanged_files_server_side(tmp_path, s3_bucket, monkeypatch):
    import s3fs

    from fsspec.asyn import sync_wrapper

    calls: list[tuple[str, int]] = []  # (S3 call, request body bytes)
    original = s3fs.S3FileSystem._call_s3

    async def counting(fs, method, *args, **kwargs):
        body = kwargs.get("Body")
        calls.append((method, len(body) if body is not None and hasattr(body, "__len__") else 0))
        return await original(fs, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", counting)
    monkeypatch.setattr(s3fs.S3FileSystem, "call_s3", sync_wrapper(counting))  # what s3fs's files call
    model, optim = lora_run()
    remote = f"{s3_bucket}/run"
    manager = statekit.CheckpointManager({"model": model, "optim": optim}, str(tmp_path / "run"), replicate_to=remote)
    train_step(model, optim)
    manager.save(1)
    manager.wait()
    first_upload = sum(n for method, n in calls if method in ("put_object", "upload_part"))
    calls.clear()
    train_step(model, optim)
    manifest = manager.save(2)
    manager.wait()
    uploaded = sum(n for method, n in calls if method in ("put_object", "upload_part"))
    frozen = manifest.files["model.frozen-00000.safetensors"]
    assert frozen.reused_from == "checkpoint-00000001"
    assert any(method in ("copy_object", "upload_part_copy") for method, _ in calls)
    assert uploaded <= 1.05 * (first_upload - frozen.size_bytes)  # the frozen file was not uploaded again
    statekit.verify(f"{remote}/checkpoint-00000002")  # every byte of the remote copy, the copied file included
    fresh, fresh_optim = lora_run(seed=6)
    statekit.load(f"{remote}/checkpoint-00000002", {"model": fresh, "optim": fresh_optim})
    assert_same_state(model, fresh, optim, fresh_optim)


def test_ls_and_inspect_show_what_each_checkpoint_wrote_and_reused(tmp_path):
    from click.testing import CliRunner

    from statekit.cli import main

    model, optim = lora_run()
    root = str(tmp_path / "run")
    manager = statekit.CheckpointManager({"model": model, "optim": optim}, root)
    first = manager.save(1)
    train_step(model, optim)
    second = manager.save(2)
    assert first.written_bytes == first.size_bytes and first.reused_bytes == 0
    assert second.reused_bytes == second.files["model.frozen-00000.safetensors"].size_bytes
    assert second.written_bytes == second.size_bytes - second.reused_bytes

    listed = json.loads(CliRunner().invoke(main, ["ls", root, "--json"]).output)
    assert [(c["step"], c["written_bytes"]) for c in listed] == [(1, first.size_bytes), (2, second.written_bytes)]
    table = CliRunner().invoke(main, ["ls", root]).output
    assert "written" in table
    shown = CliRunner().invoke(main, ["inspect", f"{root}/checkpoint-00000002"]).output
    assert "reused)" in shown and "checkpoint-00000001" in shown  # the summary line and the file's "reused from"


def test_a_damaged_shared_file_fails_every_checkpoint_that_lists_it_loudly(tmp_path):
    model, optim = lora_run()
    root = tmp_path / "run"
    manager = statekit.CheckpointManager({"model": model, "optim": optim}, str(root))
    for step in (1, 2):
        train_step(model, optim)
        manager.save(step)
    shared = root / "checkpoint-00000002" / "model.frozen-00000.safetensors"
    shared.write_bytes(shared.read_bytes()[:-8])  # one file on disk: checkpoint 1 lists it too
    fresh, fresh_optim = lora_run(seed=9)
    with pytest.warns(statekit.StatekitWarning, match="cannot resume from"):
        with pytest.raises(statekit.CorruptCheckpointError, match="model.frozen-00000.safetensors"):
            statekit.CheckpointManager({"model": fresh, "optim": fresh_optim}, str(root)).resume()
