"""The device digest of incremental saves (statekit.checks.digest): it tells every
change apart, and an incremental save of a state on an accelerator decides reuse with it,
on the device, without hashing the bytes on the host.

The arithmetic is the same on every device, so its properties are tested on the CPU here;
``test_cuda.py`` runs the same save on a GPU where one is present.
"""

from __future__ import annotations

import os

import pytest
import torch

import statekit
from statekit.checks import digest as device_digest, files as checked_files
from statekit.format import tensors as tensor_files
from lora_helpers import lora_run, train_step


def digest(tensors: dict[str, torch.Tensor]) -> str:
    header, planned = tensor_files.plan_file(tensors, None)
    return device_digest.file_digest(header, [p.tensor for p in planned])


def test_any_single_word_change_changes_the_digest():
    torch.manual_seed(0)
    t = torch.randn(1001)  # 4004 bytes: the last word padded
    before = device_digest.tensor_sum(t, 0)
    words = t.view(torch.uint8).numel()
    for byte in list(range(0, words, 97)) + [words - 1]:
        changed = t.clone()
        changed.view(torch.uint8)[byte] ^= 0x80
        assert device_digest.tensor_sum(changed, 0) != before, byte


@pytest.mark.parametrize("edit", ["two sign flips", "two values swapped", "one ulp", "tensors reordered", "dtype"])
def test_changes_that_cancel_in_a_plain_sum_change_the_digest(edit):
    torch.manual_seed(1)
    a, b = torch.randn(64, 64), torch.randn(64)
    original = digest({"a": a, "b": b})
    a2 = a.clone()
    if edit == "two sign flips":  # the same high bit of two words: a linear hash would cancel it
        a2.view(-1)[1] *= -1
        a2.view(-1)[3] *= -1
        changed = {"a": a2, "b": b}
    elif edit == "two values swapped":
        a2.view(-1)[0], a2.view(-1)[2] = a.view(-1)[2].clone(), a.view(-1)[0].clone()
        changed = {"a": a2, "b": b}
    elif edit == "one ulp":
        a2.view(torch.int32).view(-1)[17] += 1
        changed = {"a": a2, "b": b}
    elif edit == "tensors reordered":
        changed = {"b": b, "a": a}
    else:  # the same bytes, read as another dtype: the header differs
        changed = {"a": a.view(torch.int32), "b": b}
    assert digest(changed) != original


def test_views_digest_as_the_bytes_they_write():
    torch.manual_seed(2)
    base = torch.randn(40, 30)
    strided = base.t()  # non-contiguous: written row-major
    assert digest({"x": strided}) == digest({"x": strided.contiguous()})
    raw = torch.arange(100, dtype=torch.uint8)
    misaligned = raw[3:50]  # storage offset 3 bytes: not a whole word
    assert device_digest.tensor_sum(misaligned, 0) == device_digest.tensor_sum(misaligned.clone(), 0)
    z = torch.randn(8, dtype=torch.complex64)
    assert digest({"z": z.conj()}) == digest({"z": z.conj().resolve_conj()})
    assert digest({"e": torch.empty(0, 3)}) == digest({"e": torch.empty(0, 3)})


def test_digest_is_one_chunk_or_many_alike(monkeypatch):
    torch.manual_seed(3)
    t = torch.randn(10_000, dtype=torch.float64)
    whole = device_digest.tensor_sum(t, 2)
    monkeypatch.setattr(device_digest, "DIGEST_CHUNK_WORDS", 333)
    assert device_digest.tensor_sum(t, 2) == whole


@pytest.fixture
def as_if_on_an_accelerator(monkeypatch):
    """Treat CPU tensors as an accelerator's for the choice of comparison (the arithmetic is
    the same on every device), and fail any comparison that hashes bytes on the host."""
    monkeypatch.setattr(checked_files, "on_accelerator", lambda tensors: True)
    host_compares = []

    class NoHostCompare(checked_files.PrefixCheck):
        def __init__(self, *args, **kwargs):
            host_compares.append(args)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(checked_files, "PrefixCheck", NoHostCompare)
    return host_compares


def test_an_accelerator_state_is_compared_by_its_device_digest(tmp_path, as_if_on_an_accelerator, monkeypatch):
    model, optim = lora_run()
    root = tmp_path / "run"
    manager = statekit.CheckpointManager({"model": model, "optim": optim}, str(root))
    train_step(model, optim)
    first = manager.save(1)
    frozen = "model.frozen-00000.safetensors"
    assert first.files[frozen].digest.startswith("mix64:")
    train_step(model, optim)
    second = manager.save(2)
    assert second.files[frozen].reused_from == "checkpoint-00000001"
    assert second.files[frozen].digest == first.files[frozen].digest  # carried with the reuse
    assert second.files["model.safetensors"].reused_from is None
    assert as_if_on_an_accelerator == []  # decided by digests alone: no byte hashed on the host

    with torch.no_grad():
        model[0].base.weight[5, 5] = -model[0].base.weight[5, 5]  # a frozen weight edited in place
    digests = []
    real_digest = device_digest.file_digest
    monkeypatch.setattr(checked_files, "file_digest", lambda *a: digests.append(a) or real_digest(*a))
    third = manager.save(3)
    tensor_files_saved = [rel for rel in third.files if rel.endswith(".safetensors")]
    assert len(digests) == len(tensor_files_saved)  # one pass per file: a changed file's write reuses its comparison's
    assert third.files[frozen].reused_from is None and third.files[frozen].digest != first.files[frozen].digest
    fresh, fresh_optim = lora_run(seed=9)
    statekit.load(str(root / "checkpoint-00000003"), {"model": fresh, "optim": fresh_optim})
    for (name, x), y in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(x, y), name
    statekit.verify(str(root / "checkpoint-00000002"))


def test_a_host_state_keeps_xxh3_and_records_no_digest(tmp_path):
    model, optim = lora_run()
    manager = statekit.CheckpointManager({"model": model, "optim": optim}, str(tmp_path / "run"))
    train_step(model, optim)
    manifest = manager.save(1)
    assert all(entry.digest is None for entry in manifest.files.values())
    text = open(os.path.join(tmp_path, "run", "checkpoint-00000001", "statekit.json")).read()
    assert '"digest"' not in text
