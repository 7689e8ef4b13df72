"""A LoRA-style model (frozen base weights, trainable adapters) and its training step:
the state of the incremental-save tests (``unit/engine/test_incremental.py``,
``unit/format/test_device_digest.py``)."""

from __future__ import annotations

import torch
from torch import nn


class LoRALinear(nn.Module):
    """A frozen weight with a trainable low-rank adapter between its state-dict entries."""

    def __init__(self, width: int = 512, rank: int = 4) -> None:
        super().__init__()
        self.base = nn.Linear(width, width)
        self.base.requires_grad_(False)
        self.lora_A = nn.Parameter(torch.randn(rank, width) * 0.01)
        self.lora_B = nn.Parameter(torch.zeros(width, rank))
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_A.T) @ self.lora_B.T


def lora_run(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(LoRALinear(), nn.ReLU(), LoRALinear())
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def train_step(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    model(torch.randn(8, 512)).square().mean().backward()
    optim.step()
    optim.zero_grad()
