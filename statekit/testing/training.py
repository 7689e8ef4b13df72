"""A tiny, seeded, prepared Accelerate training setup for plugin tests (:class:`TinyAccelerate`);
accelerate is imported only inside the functions that need it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["TinyAccelerate", "build_tiny_accelerate", "reset_accelerate_state"]


@dataclass
class TinyAccelerate:
    """A small prepared Accelerate training setup (yielded by the ``tiny_accelerate`` fixture).

    Attributes:
        accelerator: a CPU ``accelerate.Accelerator`` (fresh state).
        model: a prepared ``Linear(4, 8) -> ReLU -> Dropout(0.1) -> Linear(8, 2)`` model.
        optimizer: a prepared ``torch.optim.AdamW`` (lr 1e-2) over the model's parameters.
        loader: a prepared, shuffled ``DataLoader`` of 32 samples (4 features, 2 classes) in
            batches of 4.
        scheduler: a prepared ``LambdaLR`` with a linear decay over 100 steps.
    """

    accelerator: Any
    model: Any
    optimizer: Any
    loader: Any
    scheduler: Any

    def train_step(self, batch: Any) -> float:
        """Run one optimisation step (cross-entropy) on a ``(inputs, targets)`` batch of
        :attr:`loader`; returns the loss as a float."""
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.model(x), y)
        self.accelerator.backward(loss)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad()
        return float(loss.detach())


def reset_accelerate_state() -> None:
    """Reset Accelerate's process-wide state, so the next ``Accelerator`` starts fresh.

    Raises:
        ImportError: accelerate is not installed.
    """
    from accelerate.state import AcceleratorState, GradientState  # lazy: see the module docstring

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def build_tiny_accelerate() -> TinyAccelerate:
    """Build the :class:`TinyAccelerate` setup on the CPU, seeded (``accelerate.utils.set_seed(0)``):
    two calls in one test build identical runs. Call :func:`reset_accelerate_state` before and after.

    Raises:
        ImportError: accelerate is not installed.
    """
    from accelerate import Accelerator  # lazy: see the module docstring
    from accelerate.utils import set_seed

    set_seed(0)
    accelerator = Accelerator(cpu=True)
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(32, 4, generator=g)
    y = torch.randint(0, 2, (32,), generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: max(0.0, 1.0 - step / 100))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    return TinyAccelerate(accelerator, model, optimizer, loader, scheduler)
