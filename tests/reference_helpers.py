"""A tiny transformers GPT-2 fine-tune that references its frozen base (statekit/engine/references.py):
the pretrained folder, the model frozen but ``h.1``, a step, exact comparison; as in
``tests/unit/engine/test_references.py``, for the tests of other layers (replication)."""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel

BASE_FILE = "model.safetensors"


def config() -> GPT2Config:
    return GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=16, bos_token_id=0, eos_token_id=0)


def base_folder(path, **save_kwargs) -> str:
    """A pretrained folder (``save_pretrained``: one safetensors file unless ``save_kwargs``
    shard it, lm_head tied)."""
    torch.manual_seed(0)
    GPT2LMHeadModel(config()).save_pretrained(str(path), **save_kwargs)
    return str(path)


def frozen_but_h1(model: torch.nn.Module) -> torch.nn.Module:
    """Every parameter frozen but ``h.1``'s; no dropout (as ``from_pretrained`` leaves it), so two models step alike."""
    model.eval()
    for name, p in model.named_parameters():
        p.requires_grad_("h.1" in name)
    return model


def optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def step(model, optim, seed: int) -> None:
    torch.manual_seed(seed)
    ids = torch.randint(0, 128, (2, 8))
    model(ids, labels=ids).loss.backward()
    optim.step()
    optim.zero_grad()


def fine_tune(folder: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """``from_pretrained`` of ``folder``, every parameter frozen but ``h.1``'s, one step."""
    model = frozen_but_h1(GPT2LMHeadModel.from_pretrained(folder))
    optim = optimizer(model)
    step(model, optim, 1)
    return model, optim


def assert_same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert sa[name].dtype == sb[name].dtype and torch.equal(sa[name], sb[name]), name
