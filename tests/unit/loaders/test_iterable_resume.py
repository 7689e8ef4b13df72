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
pytest.importorskip("torchdata.stateful_dataloader")

from iterable_helpers import N, BATCH, TOTAL, SAVE_AT, X, Y, Run, StatefulDataLoader, StatefulStream, Stream, _accelerator  # noqa: E402


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
