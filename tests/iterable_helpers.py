"""The training runs of the iterable-loader resume tests: streams with and without state,
one run (model, optimizer, loader prepared by Accelerate or not, a manager) that saves and
resumes; used in-process by ``unit/loaders/test_iterable_resume.py`` and under torchrun by
``scripts/iterable_ranks.py``."""

from __future__ import annotations

import pytest
import torch

import statekit

from accelerate_helpers import TinyNet, train_loop

pytest.importorskip("accelerate")
StatefulDataLoader = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader

N, BATCH = 60, 8  # 8 batches per epoch, the last of 4 samples
TOTAL, SAVE_AT = 20, 11  # step 11 is batch 3 of epoch 1
_g = torch.Generator().manual_seed(99)
X, Y = torch.randn(N, 6, generator=_g), torch.randint(0, 3, (N,), generator=_g)


class Stream(torch.utils.data.IterableDataset):
    """The samples in a fixed order, without state_dict(): resumed by re-reading."""

    def __iter__(self):
        for i in range(N):
            yield X[i], Y[i]


class StatefulStream(torch.utils.data.IterableDataset):
    """torchdata's Stateful protocol: a new order every epoch (a permutation seeded by the
    epoch), the position is ``{"epoch", "pos"}``; ``reads`` counts samples read."""

    def __init__(self) -> None:
        self.epoch, self.pos, self.reads = 0, 0, 0

    def __iter__(self):
        order = torch.randperm(N, generator=torch.Generator().manual_seed(self.epoch))
        while self.pos < N:
            i = order[self.pos]
            self.pos += 1
            self.reads += 1
            yield X[i], Y[i]
        self.epoch, self.pos = self.epoch + 1, 0

    def state_dict(self):
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state):
        self.epoch, self.pos = state["epoch"], state["pos"]


class Run:
    """A tiny training run; ``accelerate``: None (plain torch), "dispatch" or "shard"."""

    def __init__(self, dataset_cls, stateful: bool, accelerate: str | None, root: str) -> None:
        torch.manual_seed(0)
        self.dataset = dataset_cls()
        loader_cls = StatefulDataLoader if stateful and accelerate is None else torch.utils.data.DataLoader
        loader = loader_cls(self.dataset, batch_size=BATCH)
        model = TinyNet()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        self.accelerator = None
        if accelerate is None:
            self.objects = {"model": model, "optimizer": optimizer, "loader": loader}
            statekit.attach(objects=self.objects)
        else:
            self.accelerator = _accelerator(stateful, dispatch=accelerate == "dispatch")
            model, optimizer, loader = self.accelerator.prepare(model, optimizer, loader)
            self.manager = statekit.CheckpointManager(self.accelerator, root)
        self.model, self.optimizer, self.loader = model, optimizer, loader
        self.url = root + "/plain"

    def save(self, step: int) -> None:
        if self.accelerator is None:
            statekit.save(self.url, self.objects, step=step)
        else:
            self.manager.save(step)

    def resume(self) -> None:
        if self.accelerator is None:
            statekit.load(self.url, self.objects)
        else:
            assert self.manager.resume() == SAVE_AT

    def train(self, steps: int, start: int = 0, save_at: int | None = None) -> list[tuple[float, list[int]]]:
        """Per step: (loss, the batch's labels)."""
        return train_loop(self.model, self.optimizer, self.loader, steps, start, on_step=lambda step: self.save(step) if step == save_at else None)


def _accelerator(stateful: bool, dispatch: bool):
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    config = DataLoaderConfiguration(use_stateful_dataloader=stateful, dispatch_batches=None if dispatch else False)
    return Accelerator(cpu=True, dataloader_config=config)
