"""Exact mid-epoch resume of loaders over an IterableDataset (issue 13, item 2).

Each test trains a reference run without interruption, a run that saves in the middle of
an epoch and goes on, and a fresh run (new objects, as a restarted process builds them)
that resumes from the checkpoint: its batches, per-step losses, weights and optimizer
state must equal the reference's exactly. Plain torch loaders and Accelerate-prepared ones
(``DataLoaderDispatcher``, the default for iterable datasets, and ``DataLoaderShard`` with
``dispatch_batches=False``), each with torch's ``DataLoader`` and torchdata's
``StatefulDataLoader``.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import statekit
from statekit.testing import assert_state_equal

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


def _interrupted_and_resumed(dataset_cls, stateful, accelerate, tmp_path):
    """(reference steps, resumed steps, the resumed run, warnings of the resumed run)."""
    root = str(tmp_path / "run")
    reference = Run(dataset_cls, stateful, accelerate, str(tmp_path / "ref"))
    expected = reference.train(TOTAL)
    first = Run(dataset_cls, stateful, accelerate, root)
    got = first.train(SAVE_AT, save_at=SAVE_AT)
    first.train(3, start=SAVE_AT)  # the run goes on past the checkpoint, then dies
    resumed = Run(dataset_cls, stateful, accelerate, root)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed.resume()
        got += resumed.train(TOTAL - SAVE_AT, start=SAVE_AT)
    assert_state_equal(resumed.model.state_dict(), reference.model.state_dict())
    assert_state_equal(resumed.optimizer.state_dict(), reference.optimizer.state_dict())
    return expected, got, resumed, [str(w.message) for w in caught if issubclass(w.category, statekit.StatekitWarning)]


SETUPS = [(None, False), (None, True), ("dispatch", False), ("dispatch", True), ("shard", False), ("shard", True)]
IDS = [f"{a or 'plain'}-{'stateful' if s else 'default'}-loader" for a, s in SETUPS]


@pytest.mark.parametrize(("accelerate", "stateful"), SETUPS, ids=IDS)
def test_stream_without_state_resumes_by_re_reading(tmp_path, installed_plugin_manager, accelerate, stateful):
    expected, got, _, messages = _interrupted_and_resumed(Stream, stateful, accelerate, tmp_path)
    assert got == expected
    key = "loader" if accelerate is None else "dataloader_0"
    assert any(
        m.startswith(f"{key} (") and "resumed epoch 1 at batch 3 by re-reading and discarding 3 batches" in m
        and "has no state_dict()/load_state_dict()" in m
        for m in messages
    ), messages


@pytest.mark.parametrize(("accelerate", "stateful"), SETUPS, ids=IDS)
def test_stateful_stream_resumes_from_its_state_without_re_reading(tmp_path, installed_plugin_manager, accelerate, stateful):
    expected, got, resumed, messages = _interrupted_and_resumed(StatefulStream, stateful, accelerate, tmp_path)
    assert got == expected
    assert not [m for m in messages if "re-reading" in m]
    # samples read by the resumed run: the rest of epoch 1 (60 - 24) and epoch 2 up to step
    # 20 (batch 4: 32 samples), plus the one batch Accelerate's adapters read ahead
    ahead = 0 if accelerate is None else BATCH
    assert resumed.dataset.reads == (N - 3 * BATCH) + 4 * BATCH + ahead


class ShortOnRestart(torch.utils.data.IterableDataset):
    """A live stream: the resumed process can read only 2 samples of it."""

    def __init__(self, n: int = N) -> None:
        self.n = n

    def __iter__(self):
        for i in range(self.n):
            yield X[i], Y[i]


def test_a_stream_that_does_not_repeat_is_reported_not_restarted(tmp_path, installed_plugin_manager):
    run = Run(ShortOnRestart, False, None, str(tmp_path))
    run.train(SAVE_AT, save_at=SAVE_AT)
    resumed = Run(ShortOnRestart, False, None, str(tmp_path))
    resumed.dataset.n = 2
    resumed.resume()
    with pytest.warns(statekit.StatekitWarning, match=r"loader \(DataLoader over ShortOnRestart\): the re-created "
                      r"iterator of epoch 1 ended after 1 of the 3 batches consumed before the checkpoint: the "
                      r"dataset does not repeat its order"):
        assert list(resumed.loader) == []  # the one partial batch was discarded
    assert [len(y) for _, y in resumed.loader] == [2]  # the next epoch starts normally


# Two real torchrun ranks (tests/scripts/iterable_ranks.py): Accelerate's IterableDatasetShard
# makes every rank read the whole stream and keep its slice; DataLoaderDispatcher reads on
# rank 0 and sends each rank its part. A Stateful dataset inside the shard must restart its
# epoch from the saved epoch-start state (it once started over at epoch 0: a silent wrong
# resume from step 12 on).
RANK_SETUPS = [("shard", "stateful", "0"), ("shard", "stateful", "1"), ("shard", "stream", "0"), ("dispatch", "stateful", "0")]


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "dataset", "stateful"), RANK_SETUPS, ids=["-".join(s) for s in RANK_SETUPS])
def test_two_ranks_resume_an_iterable_loader_exactly(tmp_path, mode, dataset, stateful):
    import json

    from accelerate_helpers import torchrun

    torchrun("iterable_ranks.py", mode, stateful, dataset, str(tmp_path / "root"), str(tmp_path / "out"))
    for rank in (0, 1):
        result = json.loads((tmp_path / f"out.rank{rank}.json").read_text())
        assert result["got"] == result["expected"], f"rank {rank}"
        assert result["same_state"], f"rank {rank}"
