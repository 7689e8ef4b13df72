"""The state check after a load (statekit.checks.state_check, issue 38): faults injected
into the load path are named by object and tensor; clean loads, deliberate dtype changes,
strict=False and offloaded tensors are not false alarms; the verdict reaches the next
save's resume_audit, `statekit ls` and `inspect`."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from click.testing import CliRunner

import statekit
from statekit.cli import main as cli
from statekit.engine import read
from statekit.checks.state_check import MODE_ENV


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 8)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(4)])
        self.norm = torch.nn.BatchNorm1d(8)
        self.head = torch.nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = torch.relu(layer(h))
        return self.head(self.norm(h))


def trained(optimizer_cls=torch.optim.AdamW, **kwargs):
    torch.manual_seed(0)
    model = Net()
    optimizer = optimizer_cls(model.parameters(), lr=0.01, **kwargs)
    for _ in range(2):
        torch.nn.functional.cross_entropy(model(torch.arange(10)), torch.arange(10)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def fresh(optimizer_cls=torch.optim.AdamW, **kwargs):
    torch.manual_seed(1)
    model = Net()
    return model, optimizer_cls(model.parameters(), lr=0.01, **kwargs)


@pytest.fixture
def saved(tmp_path):
    model, optimizer = trained()
    url = str(tmp_path / "ckpt")
    statekit.save(url, {"model": model, "optimizer": optimizer})
    return url


def test_a_clean_load_is_verified_and_the_next_save_records_it(saved, tmp_path):
    model, optimizer = fresh()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning of any kind
        statekit.load(saved, {"model": model, "optimizer": optimizer})
    manifest = statekit.save(str(tmp_path / "next"), {"model": model, "optimizer": optimizer})
    state = manifest.resume_audit.state
    assert state["verdict"] == "verified" and state["sampled"] is True
    assert state["compared"] == len(model.state_dict()) + sum(len(s) for s in optimizer.state.values())
    assert manifest.resume_audit.verdict == "verified"  # no data loader: the state check is the resume's verdict


def load_with_fault(monkeypatch, url, fault, target=None, strict_resume=False, objects=None):
    """Load ``url`` with ``fault(obj)`` applied inside the load path: to the optimizer
    ``objects[target]`` right after its ``load_state_dict``, or to the model (``target`` None
    or ``"model"``) right after statekit's reads filled it (``statekit.engine.read.LoadPlan.read``)."""
    objects = objects or dict(zip(("model", "optimizer"), fresh()))
    victim = objects[target or "model"]
    optimizer = isinstance(victim, torch.optim.Optimizer)
    if optimizer:
        cls, method = torch.optim.Optimizer, "load_state_dict"
    else:
        cls, method = read.LoadPlan, "read"
    original = getattr(cls, method)

    def faulty(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if not optimizer or self is victim:
            with torch.no_grad():
                fault(victim)
        return result

    monkeypatch.setattr(cls, method, faulty)
    statekit.load(url, objects, strict_resume=strict_resume)
    return objects


def drop_moments(optimizer):
    for state in optimizer.state.values():
        state["exp_avg"].zero_()


@pytest.mark.parametrize("fault, target, named", [
    (drop_moments, "optimizer",
     r"optimizer 'optimizer': exp_avg of 'embed\.weight' is all zeros, differs from the saved state"),
    (lambda m: m.layers[2].weight[3:5].zero_(), "model", r"model 'model': layers\.2\.weight differs"),
    (lambda m: m.layers[1].weight.copy_(torch.cat([m.layers[1].weight[4:], m.layers[1].weight[:4]])),
     "model", r"model 'model': layers\.1\.weight differs"),
    (lambda m: m.norm.running_mean.fill_(0.5), "model", r"model 'model': norm\.running_mean differs"),
    (lambda m: m.norm.num_batches_tracked.zero_(), "model", r"model 'model': norm\.num_batches_tracked is all zeros"),
], ids=["moments-dropped", "slice-zeroed", "shards-swapped", "buffer-not-restored", "counter-reset"])
def test_a_fault_in_the_load_path_is_named_by_object_and_tensor(saved, monkeypatch, fault, target, named):
    with pytest.warns(statekit.StateCheckWarning, match=named):
        load_with_fault(monkeypatch, saved, fault, target)


def test_a_broken_tie_with_other_values_is_named(saved, monkeypatch):
    def untie(model):
        model.head.weight = torch.nn.Parameter(torch.randn_like(model.embed.weight))

    with pytest.warns(statekit.StateCheckWarning, match=r"model 'model': head\.weight differs"):
        load_with_fault(monkeypatch, saved, untie)


def test_sgd_momentum_dropped_is_named(tmp_path, monkeypatch):
    model, optimizer = trained(torch.optim.SGD, momentum=0.9)
    url = str(tmp_path / "sgd")
    statekit.save(url, {"model": model, "optimizer": optimizer})

    def drop(opt):
        for state in opt.state.values():
            state["momentum_buffer"].zero_()

    with pytest.warns(statekit.StateCheckWarning, match=r"momentum_buffer of 'layers\.0\.weight' is all zeros"):
        load_with_fault(monkeypatch, url, drop, "optimizer",
                        objects=dict(zip(("model", "optimizer"), fresh(torch.optim.SGD, momentum=0.9))))


def test_strict_resume_raises_naming_the_tensors_and_the_next_save_records_it(saved, monkeypatch, tmp_path):
    objects = dict(zip(("model", "optimizer"), fresh()))
    with pytest.raises(statekit.StateMismatchError, match=r"exp_avg of 'embed\.weight' is all zeros") as raised:
        load_with_fault(monkeypatch, saved, drop_moments, "optimizer", strict_resume=True, objects=objects)
    assert "optimizer:state.0.exp_avg" in raised.value.mismatched
    assert "the load completed" in str(raised.value)
    audit = statekit.save(str(tmp_path / "next"), objects).resume_audit  # the user caught it and went on
    assert audit.state["verdict"] == "mismatch" and audit.verdict == "diverged"


def test_off_at_load_compares_nothing(saved, monkeypatch):
    monkeypatch.setenv(MODE_ENV, "off")
    with warnings.catch_warnings():
        warnings.simplefilter("error", statekit.StateCheckWarning)
        load_with_fault(monkeypatch, saved, drop_moments, "optimizer")  # not compared: no warning


def saved_bf16_optimizer(tmp_path):
    """The URL of a saved AdamW (one step taken) over bfloat16 parameters."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4, dtype=torch.bfloat16)).sum().backward()
    optimizer.step()
    url = str(tmp_path / "bf16")
    statekit.save(url, {"optimizer": optimizer})
    return url


def test_moments_cast_to_the_parameters_dtype_are_named_not_a_false_alarm(tmp_path):
    """``Optimizer.load_state_dict`` casts the moments to the parameters' dtype: a widening
    cast is compared after the cast back, a narrowing one is named and not compared."""
    url = saved_bf16_optimizer(tmp_path)
    wider = torch.optim.AdamW(torch.nn.Linear(4, 4).parameters())
    statekit.load(url, {"optimizer": wider})
    state = statekit.save(str(tmp_path / "next"), {"optimizer": wider}).resume_audit.state
    assert state["verdict"] == "verified"
    assert "4 tensor(s) loaded as float32 (saved bfloat16), equal after the cast back" in state["detail"]

    wide = torch.optim.AdamW(torch.nn.Linear(4, 4).parameters())
    wide.load_state_dict(wider.state_dict())
    url = str(tmp_path / "fp32")
    statekit.save(url, {"optimizer": wide})
    narrow = torch.optim.AdamW(torch.nn.Linear(4, 4).to(torch.bfloat16).parameters())
    statekit.load(url, {"optimizer": narrow})
    state = statekit.save(str(tmp_path / "next2"), {"optimizer": narrow}).resume_audit.state
    assert state["verdict"] == "verified" and "loaded as bfloat16 (saved float32)" in state["detail"]


def test_strict_false_leaves_out_keys_without_a_false_alarm(tmp_path):
    model, _ = trained()
    url = str(tmp_path / "ckpt")
    statekit.save(url, {"model": model})
    smaller = torch.nn.Module()
    smaller.embed = torch.nn.Embedding(10, 8)
    manifest = statekit.load(url, {"model": smaller}, strict=False)
    assert torch.equal(smaller.embed.weight, model.embed.weight)
    state = statekit.save(str(tmp_path / "next"), {"model": smaller}).resume_audit.state
    assert state["verdict"] == "verified" and "not loaded (strict=False)" in state["detail"]
    assert manifest.incompatible_keys["model"]["unexpected_keys"]


def test_a_manager_resume_is_checked_and_ls_and_inspect_show_it(tmp_path, monkeypatch):
    model, optimizer = trained()
    root = str(tmp_path / "run")
    statekit.CheckpointManager({"model": model, "optimizer": optimizer}, root).save(step=1)
    model, optimizer = fresh()
    manager = statekit.CheckpointManager({"model": model, "optimizer": optimizer}, root)
    monkeypatch.setattr(torch.optim.AdamW, "load_state_dict",
                        lambda self, sd, _orig=torch.optim.Optimizer.load_state_dict: (_orig(self, sd), drop_moments(self))[0])
    with pytest.warns(statekit.StateCheckWarning):
        assert manager.resume() == 1
    manager.save(step=2)
    listing = CliRunner().invoke(cli, ["ls", root])
    assert listing.exit_code == 0 and "diverged (from 1), state mismatch" in listing.output
    shown = CliRunner().invoke(cli, ["inspect", f"{root}/checkpoint-00000002"])
    assert "state check: mismatch" in shown.output and "exp_avg of 'embed.weight' is all zeros" in shown.output
    assert "emix64 digests of" in shown.output


@pytest.mark.parametrize("mode, sampled", [("full", False), ("sampled", True)])
def test_the_mode_is_chosen_by_the_environment(tmp_path, monkeypatch, mode, sampled):
    monkeypatch.setenv(MODE_ENV, mode)
    model, optimizer = trained()
    manifest = statekit.save(str(tmp_path / "c"), {"model": model, "optimizer": optimizer})
    assert (manifest.state_digest.sampling["stride"] > manifest.state_digest.sampling["block"]) is sampled


def test_the_check_can_be_turned_off_and_an_unknown_mode_is_refused(tmp_path, monkeypatch):
    model, _ = trained()
    monkeypatch.setenv(MODE_ENV, "off")
    manifest = statekit.save(str(tmp_path / "off"), {"model": model})
    assert manifest.state_digest is None and "state_digest" not in json.loads((tmp_path / "off" / "statekit.json").read_text())
    monkeypatch.setenv(MODE_ENV, "sometimes")
    with pytest.raises(statekit.InvalidOptionError, match=r"STATEKIT_STATE_CHECK='sometimes'"):
        statekit.save(str(tmp_path / "bad"), {"model": model})
    assert not (tmp_path / "bad").exists()  # refused before anything is created


def test_an_unknown_mode_refuses_a_load_and_a_resume_before_anything_changes(tmp_path, monkeypatch):
    root = str(tmp_path / "run")
    manager = statekit.CheckpointManager(dict(zip(("model", "optimizer"), trained())), root)
    manager.save(1)
    manager.save(2)
    monkeypatch.setenv(MODE_ENV, "ful")
    model, optimizer = fresh()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(statekit.InvalidOptionError, match=r"STATEKIT_STATE_CHECK='ful'"):
        statekit.load(manager.url_for(2), {"model": model, "optimizer": optimizer})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no checkpoint is skipped as unloadable: the setting is the caller's error
        with pytest.raises(statekit.InvalidOptionError, match=r"STATEKIT_STATE_CHECK='ful'"):
            statekit.CheckpointManager({"model": model, "optimizer": optimizer}, root).resume()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(statekit.InvalidOptionError, match=r"STATEKIT_STATE_CHECK='ful'"):
        manager.save(3)
    assert [i.step for i in manager.list()] == [1, 2]  # no incomplete folder


def test_an_adapter_not_loaded_is_named(tmp_path, monkeypatch):
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    config = peft.LoraConfig(r=2, target_modules=["0", "2"], init_lora_weights=False)
    model = peft.get_peft_model(base, config)
    url = str(tmp_path / "lora")
    statekit.save(url, {"model": model})
    torch.manual_seed(0)
    other = peft.get_peft_model(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)),
                                peft.LoraConfig(r=2, target_modules=["0", "2"], init_lora_weights=False))

    def skip_adapters(module):  # the adapter's weights stay at a fresh initialisation
        for name, p in module.named_parameters():
            if "lora_B" in name:
                p.normal_()

    with pytest.warns(statekit.StateCheckWarning, match=r"lora_B"):
        load_with_fault(monkeypatch, url, skip_adapters, objects={"model": other})


def test_attach_mode_load_state_is_checked(tmp_path, monkeypatch):
    """``accelerator.load_state`` of an attached accelerator: clean, then with the moments dropped."""
    from accelerate import Accelerator

    def prepared():
        accelerator = Accelerator(cpu=True)
        model, optimizer = accelerator.prepare(*trained())
        statekit.attach(accelerator)
        return accelerator, model, optimizer

    accelerator, _, _ = prepared()
    accelerator.save_state(str(tmp_path / "acc"))
    accelerator, model, optimizer = prepared()
    with warnings.catch_warnings():
        warnings.simplefilter("error", statekit.StateCheckWarning)
        accelerator.load_state(str(tmp_path / "acc"))
    accelerator, model, optimizer = prepared()
    original = torch.optim.Optimizer.load_state_dict
    monkeypatch.setattr(torch.optim.Optimizer, "load_state_dict",
                        lambda self, sd: (original(self, sd), drop_moments(self))[0])
    with pytest.warns(statekit.StateCheckWarning, match=r"optimizer 'optimizer_0': exp_avg of 'embed\.weight' is all zeros"):
        accelerator.load_state(str(tmp_path / "acc"))


def test_a_fault_behind_a_widening_cast_is_a_difference_not_a_deliberate_cast(tmp_path, monkeypatch):
    url = saved_bf16_optimizer(tmp_path)
    wider = torch.optim.AdamW(torch.nn.Linear(4, 4).parameters())  # float32: every bfloat16 value fits
    with pytest.warns(statekit.StateCheckWarning, match=r"loaded as float32 \(saved bfloat16\) differs from the saved state"):
        load_with_fault(monkeypatch, url, drop_moments, "optimizer", objects={"optimizer": wider})


def test_each_optimizers_state_is_named_after_its_own_parameters_even_when_dropped(tmp_path, monkeypatch):
    """Two AdamW over two models number their states from 0 alike: each difference is named
    after a parameter of its own optimizer, and a parameter's state the load dropped
    (``state.1.*`` missing) after that parameter, not by its bare path."""
    torch.manual_seed(0)
    gen = torch.nn.Sequential(torch.nn.Linear(4, 4))  # 'gen.0.weight', 'gen.0.bias'
    disc = torch.nn.Sequential(torch.nn.Identity(), torch.nn.Linear(4, 1))  # 'disc.1.weight', 'disc.1.bias'
    opt_g, opt_d = torch.optim.AdamW(gen.parameters()), torch.optim.AdamW(disc.parameters())
    disc(gen(torch.randn(2, 4))).sum().backward()
    opt_g.step()
    opt_d.step()
    objects = {"gen": gen, "disc": disc, "opt_g": opt_g, "opt_d": opt_d}
    url = str(tmp_path / "gan")
    statekit.save(url, objects)

    def fault(optimizer):
        optimizer.state[gen[0].weight]["exp_avg"].zero_()
        optimizer.state.pop(gen[0].bias)

    with pytest.warns(statekit.StateCheckWarning) as caught:
        load_with_fault(monkeypatch, url, fault, "opt_g", objects=objects)
    message = str(caught[0].message)
    assert "4 tensor(s) differ" in message
    for slot in ("step", "exp_avg", "exp_avg_sq"):
        assert f"optimizer 'opt_g': {slot} of 'gen.0.bias' is missing after the load" in message
    assert "optimizer 'opt_g': exp_avg of 'gen.0.weight' is all zeros" in message  # (two models: the key first)
    assert "'disc." not in message and "state." not in message


def test_an_optimizer_over_two_models_names_each_models_tensors(tmp_path, monkeypatch):
    torch.manual_seed(0)
    enc, dec = torch.nn.Linear(3, 3), torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW([*enc.parameters(), *dec.parameters()], lr=0.1)
    dec(enc(torch.randn(2, 3))).sum().backward()
    opt.step()
    url = str(tmp_path / "ckpt")
    statekit.save(url, {"enc": enc, "dec": dec, "opt": opt})
    enc2, dec2 = torch.nn.Linear(3, 3), torch.nn.Linear(3, 2)
    opt2 = torch.optim.AdamW([*enc2.parameters(), *dec2.parameters()], lr=0.1)
    with pytest.warns(statekit.StateCheckWarning) as caught:
        load_with_fault(monkeypatch, url, drop_moments, "opt", objects={"enc": enc2, "dec": dec2, "opt": opt2})
    message = str(caught[0].message)
    for name in ("enc.weight", "enc.bias", "dec.weight", "dec.bias"):
        assert f"exp_avg of '{name}' is all zeros" in message, message
