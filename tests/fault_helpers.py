"""Deterministic training state for the fault-injection trials (used by the test and its child)."""

from __future__ import annotations

import torch


def make_state(step: int) -> dict:
    """A model, an AdamW after one step, a dict and a tensor, all determined by ``step``."""
    torch.manual_seed(step)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 32)).sum().backward()
    optim.step()
    return {"model": model, "optim": optim, "extra": {"step": step, "history": (1.0, 2.0)}, "t": torch.arange(5.0) * step}
