"""The state check's structural faults (statekit.checks.state_check, issue 44): a load that
keeps every value but changes how training goes on from there is named like a value fault.
A tie broken by the load (a GPT-2's ``lm_head.weight`` no longer ``transformer.wte.weight``:
the two get separate updates from the next step) and a cast by the load path that neither
widens nor narrows (bfloat16 to float16: other arithmetic) are a StateCheckWarning, or the
StateMismatchError of ``strict_resume=True``, on statekit.load, CheckpointManager.resume
and attach mode's accelerator.load_state; clean resumes of tied and bfloat16 models, and
the deliberate casts (a widening or a narrowing one), are not."""

from __future__ import annotations

import warnings

import pytest
import torch

import statekit
from statekit.engine import read
from statekit.checks.state_check import _cast, tie_groups

transformers = pytest.importorskip("transformers")

TIE = (r"model '{key}': lm_head\.weight tied to 'transformer\.wte\.weight' at save, not tied now "
       r"\(they would be updated separately\)")
CAST = (r"model '{key}': {path} loaded as float16 \(saved bfloat16\): a cast that neither widens nor narrows, "
        r"equal values after the cast back; the run goes on in float16 arithmetic")


def gpt2(seed: int = 0) -> torch.nn.Module:
    """A tiny GPT-2 language model, its output head tied to its token embedding."""
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=8, n_layer=1, n_head=2,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight
    return model


def trained_gpt2(seed: int = 0):
    model = gpt2(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    ids = torch.arange(12).reshape(2, 6)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def bf16_model(seed: int = 0) -> torch.nn.Module:
    """A bfloat16 model whose values are small integers: float16 holds them exactly."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randint(-8, 8, p.shape))
    return model


def untie(model: torch.nn.Module) -> None:
    """A load path that replaces the head's weight by a copy: equal values, no longer tied."""
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())


def to_half(model: torch.nn.Module) -> None:
    """A load path that casts the model to float16 (``model.half()``)."""
    model.half()


def no_warning(callable_, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # none at all: a clean resume
        return callable_(*args, **kwargs)


@pytest.fixture
def faulty_read(monkeypatch):
    """``fault(model)`` applied right after statekit's reads filled the model (inside the load)."""

    def install(model, fault):
        original = read.LoadPlan.read

        def faulty(self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            with torch.no_grad():
                fault(model)
            return result

        monkeypatch.setattr(read.LoadPlan, "read", faulty)

    return install


def test_the_save_records_the_tie_groups_of_a_tied_model_only(tmp_path):
    model, optimizer = trained_gpt2()
    manifest = statekit.save(str(tmp_path / "tied"), {"model": model, "optimizer": optimizer})
    assert manifest.state_digest.ties == {"model": [["transformer.wte.weight", "lm_head.weight"]]}
    manifest = statekit.save(str(tmp_path / "plain"), {"model": bf16_model()})
    assert manifest.state_digest.ties is None
    assert "ties" not in manifest.state_digest.to_json()  # (an untied model's manifest is as before)


def test_a_clean_load_and_resume_of_a_tied_model_are_verified(tmp_path):
    model, optimizer = trained_gpt2()
    root = str(tmp_path / "run")
    statekit.CheckpointManager({"model": model, "optimizer": optimizer}, root).save(step=1)
    other = gpt2(1)
    manager = statekit.CheckpointManager({"model": other, "optimizer": torch.optim.AdamW(other.parameters())}, root)
    assert no_warning(manager.resume, strict_resume=True) == 1
    assert other.lm_head.weight is other.transformer.wte.weight
    state = manager.save(step=2).resume_audit.state
    assert state["verdict"] == "verified", state
    fresh = gpt2(2)
    no_warning(statekit.load, manager.url_for(2), {"model": fresh}, strict=False)  # the model alone: verified too


def test_a_tie_broken_by_the_load_with_equal_values_is_named(tmp_path, faulty_read):
    model, _ = trained_gpt2()
    url = str(tmp_path / "ckpt")
    statekit.save(url, {"model": model})
    other = gpt2(1)
    faulty_read(other, untie)
    with pytest.warns(statekit.StateCheckWarning, match=TIE.format(key="model")) as caught:
        statekit.load(url, {"model": other})
    assert torch.equal(other.lm_head.weight, other.transformer.wte.weight)  # the values are equal: only the tie
    assert "1 tensor(s) differ from the state saved" in str(caught[0].message)
    state = statekit.save(str(tmp_path / "next"), {"model": other}).resume_audit.state
    assert state["verdict"] == "mismatch"
    assert "lm_head.weight tied to 'transformer.wte.weight' at save" in state["detail"]


def test_strict_resume_raises_for_a_broken_tie(tmp_path, faulty_read):
    model, _ = trained_gpt2()
    url = str(tmp_path / "ckpt")
    statekit.save(url, {"model": model})
    other = gpt2(1)
    faulty_read(other, untie)
    with pytest.raises(statekit.StateMismatchError, match=TIE.format(key="model")) as raised:
        statekit.load(url, {"model": other}, strict_resume=True)
    assert raised.value.mismatched == {"model:lm_head.weight": "tied to 'transformer.wte.weight' at save, not tied now"}


def test_a_manager_resume_with_strict_resume_raises_for_a_broken_tie(tmp_path, faulty_read):
    model, optimizer = trained_gpt2()
    root = str(tmp_path / "run")
    statekit.CheckpointManager({"model": model, "optimizer": optimizer}, root).save(step=1)
    other = gpt2(1)
    manager = statekit.CheckpointManager({"model": other, "optimizer": torch.optim.AdamW(other.parameters())}, root)
    faulty_read(other, untie)
    with pytest.raises(statekit.StateMismatchError, match=TIE.format(key="model")):
        manager.resume(strict_resume=True)
    assert manager.save(step=2).resume_audit.state["verdict"] == "mismatch"  # recorded before it was raised


def test_a_broken_tie_with_other_values_is_one_difference_naming_both(tmp_path, faulty_read):
    model, _ = trained_gpt2()
    url = str(tmp_path / "ckpt")
    statekit.save(url, {"model": model})
    other = gpt2(1)

    def untie_and_change(m):
        m.lm_head.weight = torch.nn.Parameter(m.lm_head.weight.detach() + 1)

    faulty_read(other, untie_and_change)
    with pytest.warns(statekit.StateCheckWarning) as caught:
        statekit.load(url, {"model": other})
    message = str(caught[0].message)
    assert "1 tensor(s) differ from the state saved: model 'model': lm_head.weight differs from the saved state " \
           "(saved digest " in message
    assert "); tied to 'transformer.wte.weight' at save, not tied now" in message


def test_a_bf16_parameter_cast_to_fp16_by_the_load_is_named(tmp_path, faulty_read):
    model = bf16_model()
    url = str(tmp_path / "bf16")
    statekit.save(url, {"model": model})
    other = bf16_model(1)
    faulty_read(other, to_half)
    with pytest.warns(statekit.StateCheckWarning, match=CAST.format(key="model", path=r"0\.weight")) as caught:
        statekit.load(url, {"model": other})
    assert "4 tensor(s) differ" in str(caught[0].message)  # the two weights and biases
    assert all(torch.equal(a.to(torch.bfloat16), b) for a, b in zip(other.parameters(), model.parameters()))


def test_strict_resume_raises_for_a_bf16_parameter_cast_to_fp16(tmp_path, faulty_read):
    model = bf16_model()
    url = str(tmp_path / "bf16")
    statekit.save(url, {"model": model})
    other = bf16_model(1)
    faulty_read(other, to_half)
    with pytest.raises(statekit.StateMismatchError, match=CAST.format(key="model", path=r"2\.bias")) as raised:
        statekit.load(url, {"model": other}, strict_resume=True)
    assert raised.value.mismatched["model:0.weight"] == "saved bfloat16, live float16"
    assert set(raised.value.mismatched) == {f"model:{p}" for p in ("0.weight", "0.bias", "2.weight", "2.bias")}


def test_a_cast_to_fp16_with_other_values_names_both_digests(tmp_path, faulty_read):
    model = bf16_model()
    url = str(tmp_path / "bf16")
    statekit.save(url, {"model": model})
    other = bf16_model(1)
    faulty_read(other, lambda m: (m.half(), m[0].weight.add_(0.5)))
    with pytest.warns(statekit.StateCheckWarning) as caught:
        statekit.load(url, {"model": other})
    assert "model 'model': 0.weight loaded as float16 (saved bfloat16): a cast that neither widens nor narrows, " \
           "other values after the cast back (saved digest " in str(caught[0].message)


def test_a_clean_resume_of_a_bf16_model_is_verified(tmp_path):
    model = bf16_model()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4, dtype=torch.bfloat16)).sum().backward()
    optimizer.step()
    root = str(tmp_path / "run")
    statekit.CheckpointManager({"model": model, "optimizer": optimizer}, root).save(step=1)
    other = bf16_model(1)
    manager = statekit.CheckpointManager({"model": other, "optimizer": torch.optim.AdamW(other.parameters())}, root)
    assert no_warning(manager.resume, strict_resume=True) == 1
    assert manager.save(step=2).resume_audit.state["verdict"] == "verified"


@pytest.mark.parametrize("saved_dtype, loaded_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
                                                       (torch.float32, torch.float16)],
                         ids=["widening", "narrowing-bf16", "narrowing-fp16"])
def test_a_widening_or_narrowing_cast_stays_deliberate(tmp_path, faulty_read, saved_dtype, loaded_dtype):
    """A precision policy widens (float32 master weights) or narrows (bfloat16 to save
    memory): named in the verdict as before, not a fault, with strict_resume too."""
    model = bf16_model().to(saved_dtype)
    url = str(tmp_path / "ckpt")
    statekit.save(url, {"model": model})
    other = bf16_model(1).to(saved_dtype)
    faulty_read(other, lambda m: m.to(loaded_dtype))
    no_warning(statekit.load, url, {"model": other}, strict_resume=True)
    state = statekit.save(str(tmp_path / "next"), {"model": other}).resume_audit.state
    assert state["verdict"] == "verified"
    assert f"loaded as {str(loaded_dtype)[6:]} (saved {str(saved_dtype)[6:]})" in state["detail"]


@pytest.mark.parametrize("saved, live, kind", [
    ("bfloat16", "float16", "lateral"), ("float16", "bfloat16", "lateral"), ("int64", "float32", "lateral"),
    ("float32", "int32", "lateral"), ("bool", "uint8", "lateral"), ("int8", "uint8", "lateral"),
    ("float8_e4m3fn", "float8_e5m2", "lateral"), ("complex64", "float32", "narrowing"),
    ("bfloat16", "float32", "widening"), ("float16", "float64", "widening"), ("int32", "int64", "widening"),
    ("complex64", "complex128", "widening"), ("float32", "complex64", "widening"), ("float32", "bfloat16", "narrowing"),
    ("float64", "float16", "narrowing"), ("int64", "int16", "narrowing"), ("float32", "no_such_dtype", None),
])
def test_how_a_cast_is_judged(saved, live, kind):
    assert _cast(saved, live) == kind


def test_tie_groups_are_one_tensor_only():
    weight = torch.nn.Parameter(torch.randn(4, 3))
    flat = torch.randn(12)
    named = {
        "a": weight.detach(), "b": weight.detach(), "c": weight.detach().clone(),  # a and b: one tensor
        "first": flat[:6], "second": flat[6:],  # one storage, other offsets: two tensors
        "same_storage_other_shape": flat.view(3, 4), "whole": flat,  # other shapes
        "meta": torch.empty(4, device="meta"), "meta2": torch.empty(4, device="meta"),  # offloaded: no storage
        "empty": torch.empty(0), "empty2": torch.empty(0),
    }
    assert tie_groups(named) == [["a", "b"]]


def test_a_dtensor_is_never_in_a_tie_group():
    import torch.distributed as dist

    pytest.importorskip("torch.distributed.tensor")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        d = distribute_tensor(torch.randn(4, 4), init_device_mesh("cpu", (1,)), [Replicate()])
        assert tie_groups({"a": d, "b": d}) == []
    finally:
        dist.destroy_process_group()


def attached(model):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    statekit.attach(accelerator)
    return accelerator, model


def faulty_model_load(monkeypatch, model, fault):
    """``fault(model)`` right after Accelerate's ``load_state`` filled the model."""
    cls = type(model)
    original = cls.load_state_dict

    def faulty(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if self is model:
            with torch.no_grad():
                fault(self)
        return result

    monkeypatch.setattr(cls, "load_state_dict", faulty)


def test_attach_mode_names_a_broken_tie_and_a_clean_load_state_is_verified(tmp_path, monkeypatch):
    accelerator, _ = attached(trained_gpt2()[0])
    accelerator.save_state(str(tmp_path / "acc"))
    accelerator, model = attached(gpt2(1))
    no_warning(accelerator.load_state, str(tmp_path / "acc"))
    assert model.lm_head.weight is model.transformer.wte.weight
    accelerator, model = attached(gpt2(1))
    faulty_model_load(monkeypatch, model, untie)
    with pytest.warns(statekit.StateCheckWarning, match=TIE.format(key="model_0")):
        accelerator.load_state(str(tmp_path / "acc"))


def test_attach_mode_names_a_cast_to_fp16_and_a_clean_load_state_is_verified(tmp_path, monkeypatch):
    accelerator, _ = attached(bf16_model())
    accelerator.save_state(str(tmp_path / "acc"))
    accelerator, model = attached(bf16_model(1))
    no_warning(accelerator.load_state, str(tmp_path / "acc"))
    accelerator, model = attached(bf16_model(1))
    faulty_model_load(monkeypatch, model, to_half)
    with pytest.warns(statekit.StateCheckWarning, match=CAST.format(key="model_0", path=r"0\.weight")):
        accelerator.load_state(str(tmp_path / "acc"))
