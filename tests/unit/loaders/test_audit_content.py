"""The resume audit checks content behind every loader (issue 35, item 2).

A user's own stateful ``IterableDataset`` that restores wrongly (one sample late, its
shuffle seed forgotten, the loaded state ignored), and a Hugging Face shuffled stream
resumed from its own inexact state (statekit's re-read reverted), resume on other batches.
Behind a plain ``DataLoader``, torchdata's ``StatefulDataLoader`` and Accelerate's
``DataLoaderShard`` and ``DataLoaderDispatcher`` the audit names the divergence at the first
resumed batch, from the content of the batch the saved run yielded right after the save
(``next-batch/<key>/rank-<r>.json`` beside the checkpoint). A correct one is verified.
"""

from __future__ import annotations

import json
import logging
import warnings

import pytest
import torch
from click.testing import CliRunner

import statekit
from statekit.cli import main as cli

pytest.importorskip("accelerate")
StatefulDataLoader = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader

N, BATCH, SAVE_AT = 40, 4, 13  # 10 batches an epoch; step 13 is batch 3 of epoch 1
X = torch.randn(N, 3, generator=torch.Generator().manual_seed(1))


class UserStream(torch.utils.data.IterableDataset):
    """A stream with torchdata's Stateful protocol: a new order each epoch from its seed.

    ``fault``: None (correct), ``"late"`` (restores one sample late), ``"seed"`` (its state
    leaves out the shuffle seed, and a load falls back to seed 0), ``"ignore"`` (ignores a
    loaded state)."""

    def __init__(self, fault: str | None = None) -> None:
        self.fault, self.seed, self.epoch, self.pos = fault, 5, 0, 0

    def __iter__(self):
        order = torch.randperm(N, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        while self.pos < N:
            i = order[self.pos]
            self.pos += 1
            yield X[i], i
        self.epoch, self.pos = self.epoch + 1, 0

    def state_dict(self):
        state = {"epoch": self.epoch, "pos": self.pos}
        return state if self.fault == "seed" else {**state, "seed": self.seed}

    def load_state_dict(self, state):
        if self.fault == "ignore":
            return
        self.epoch, self.pos = state["epoch"], state["pos"] + (1 if self.fault == "late" else 0)
        self.seed = state.get("seed", 0)


LOADERS = ["plain", "stateful", "accelerate-shard", "accelerate-dispatch"]


def _build(loader_kind: str, dataset, root: str):
    if loader_kind == "plain":
        loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH)
    elif loader_kind == "stateful":
        loader = StatefulDataLoader(dataset, batch_size=BATCH)
    else:
        from accelerate import Accelerator, DataLoaderConfiguration
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        dispatch = None if loader_kind == "accelerate-dispatch" else False
        accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(dispatch_batches=dispatch))
        loader = accelerator.prepare(torch.utils.data.DataLoader(dataset, batch_size=BATCH))
        return loader, statekit.CheckpointManager(accelerator, root)
    return loader, statekit.CheckpointManager({"loader": loader}, root)


def _ids(batch) -> list[int]:
    return batch[1].tolist()


def _save_and_go_on(loader_kind: str, dataset, root: str) -> list[list[int]]:
    """Train past an epoch, save at SAVE_AT, take two more batches (the run then dies)."""
    loader, manager = _build(loader_kind, dataset, root)
    seen, step = [], 0
    while step < SAVE_AT + 2:
        for batch in loader:
            seen.append(_ids(batch))
            step += 1
            if step == SAVE_AT:
                manager.save(step)
            if step == SAVE_AT + 2:
                break
    manager.wait()
    return seen


def _resume_first_batch(loader_kind: str, dataset, root: str, strict: bool = False):
    loader, manager = _build(loader_kind, dataset, root)
    assert manager.resume(strict_resume=strict) == SAVE_AT
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = _ids(next(iter(loader)))
    return first, [w for w in caught if issubclass(w.category, statekit.StatekitWarning)], manager


@pytest.fixture(autouse=True)
def _plugins(installed_plugin_manager):
    logging.getLogger("datasets").setLevel(logging.ERROR)


@pytest.mark.parametrize("loader_kind", LOADERS)
def test_a_correct_stream_is_verified_by_content(tmp_path, loader_kind):
    root = str(tmp_path / "run")
    seen = _save_and_go_on(loader_kind, UserStream(), root)
    first, caught, manager = _resume_first_batch(loader_kind, UserStream(), root)
    assert first == seen[SAVE_AT]
    assert not caught, [str(w.message) for w in caught]
    manager.save(SAVE_AT + 1)
    listed = json.loads(CliRunner().invoke(cli, ["ls", root, "--json"]).output)
    audit = [c for c in listed if c["step"] == SAVE_AT + 1][0]["resume_audit"]
    assert audit["verdict"] == "verified", audit


@pytest.mark.parametrize("fault", ["late", "seed", "ignore"])
@pytest.mark.parametrize("loader_kind", LOADERS)
def test_a_stream_that_restores_wrongly_is_named_at_the_first_batch(tmp_path, loader_kind, fault):
    root = str(tmp_path / "run")
    seen = _save_and_go_on(loader_kind, UserStream(fault), root)
    first, caught, _ = _resume_first_batch(loader_kind, UserStream(fault), root)
    assert first != seen[SAVE_AT]
    messages = [str(w.message) for w in caught if issubclass(w.category, statekit.ResumeAuditWarning)]
    assert len(messages) == 1, [str(w.message) for w in caught]
    assert f"after the resume from step {SAVE_AT} does not continue where the saved run stood" in messages[0]
    assert "batch 3 of epoch 1" in messages[0] and "content" in messages[0]
    assert "the recorded indices" not in messages[0]  # none were recorded for a stream


def test_strict_resume_raises_from_the_for_loop(tmp_path):
    root = str(tmp_path / "run")
    _save_and_go_on("plain", UserStream("late"), root)
    loader, manager = _build("plain", UserStream("late"), root)
    manager.resume(strict_resume=True)
    with pytest.raises(statekit.ResumeAuditError, match="differs in content from the batch the saved run yielded right after the save"):
        next(iter(loader))


@pytest.mark.parametrize("loader_kind", ["plain", "stateful", "accelerate-dispatch"])
def test_a_shuffle_buffer_resumed_from_its_own_state_is_named(tmp_path, monkeypatch, loader_kind):
    """statekit's re-read of a shuffle buffer reverted: the dataset's own state loses the buffer; the audit alone names it."""
    from data_stacks import make_dataset
    from statekit.loaders import hf_iterable

    monkeypatch.setattr(hf_iterable, "inexact_state", lambda dataset: None)
    root = str(tmp_path / "run")

    def stream():
        return make_dataset("shuffled").map(lambda e: e).with_format("torch")

    def ids(batch):
        return batch["idx"].tolist()

    loader, manager = _build(loader_kind, stream(), root)
    it = iter(loader)
    for step in range(1, 8):
        next(it)
        if step == 5:
            manager.save(step)
    manager.wait()
    loader, manager = _build(loader_kind, stream(), root)
    assert manager.resume() == 5
    with pytest.warns(statekit.ResumeAuditWarning, match=r"batch 5 of epoch 0 differs in content from the batch the saved run yielded right after the save"):
        ids(next(iter(loader)))


def test_a_run_that_died_before_its_next_batch_is_unverifiable_and_says_so(tmp_path):
    root = str(tmp_path / "run")
    loader, manager = _build("plain", UserStream(), root)
    it = iter(loader)
    for _ in range(3):
        next(it)
    manager.save(3)  # dies here: no batch after the save
    loader, manager = _build("plain", UserStream(), root)
    manager.resume()
    with pytest.warns(statekit.StatekitWarning, match=r"resume audit: loader \(DataLoader over UserStream\) after the resume from step 3 cannot be verified"):
        next(iter(loader))


def test_the_record_is_written_after_an_async_commit_and_names_its_checkpoint(tmp_path):
    root = tmp_path / "run"
    loader = torch.utils.data.DataLoader(UserStream(), batch_size=BATCH)
    manager = statekit.CheckpointManager({"loader": loader}, str(root), async_save=True)
    it = iter(loader)
    next(it), next(it)
    manager.save(2)
    third = _ids(next(it))  # may come before the background commit
    manager.wait()
    record = json.loads((root / "checkpoint-00000002" / "next-batch" / "loader" / "rank-00000.json").read_text())
    manifest = json.loads((root / "checkpoint-00000002" / "statekit.json").read_text())
    assert record["manifest_checksum"] == manifest["manifest_checksum"]
    assert (record["epoch"], record["batch"]) == (0, 2)
    verified = torch.utils.data.DataLoader(UserStream(), batch_size=BATCH)
    again = statekit.CheckpointManager({"loader": verified}, str(root))
    assert again.resume() == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error", statekit.StatekitWarning)
        assert _ids(next(iter(verified))) == third


def test_a_damaged_record_is_ignored_with_a_log_line(tmp_path, caplog):
    root = tmp_path / "run"
    seen = _save_and_go_on("plain", UserStream(), str(root))
    path = root / f"checkpoint-{SAVE_AT:08d}" / "next-batch" / "loader" / "rank-00000.json"
    path.write_text(path.read_text().replace('"batch": 3', '"batch": 4'))
    loader, manager = _build("plain", UserStream(), str(root))
    manager.resume()
    with caplog.at_level(logging.WARNING, logger="statekit"), pytest.warns(statekit.StatekitWarning, match="cannot be verified"):
        assert _ids(next(iter(loader))) == seen[SAVE_AT]
    assert "is not a valid next-batch record; ignored" in caplog.text


def _at_epoch_end(loader_kind: str, fault: str | None, root: str, die_after_save: bool = False) -> list[list[int]]:
    loader, manager = _build(loader_kind, UserStream(fault), root)
    seen = []
    for epoch in range(2):
        for batch in loader:
            seen.append(_ids(batch))
            if len(seen) == N // BATCH:
                manager.save(len(seen))  # the last batch of epoch 0
    manager.wait()
    return seen


def test_a_stream_saved_at_its_epochs_end_is_verified_by_the_next_epochs_first_batch(tmp_path):
    """A plain loader over a stream learns that its epoch ended only when it asks for one more
    batch: the resumed epoch yields nothing, as the saved run's did, and the next epoch's first
    batch is checked by content (no false "ended without yielding")."""
    root = str(tmp_path / "run")
    seen = _at_epoch_end("plain", None, root)
    record = json.loads((tmp_path / "run" / "checkpoint-00000010" / "next-batch" / "loader" / "rank-00000.json").read_text())
    assert record["ends_epoch"] is True and (record["epoch"], record["batch"]) == (0, 10)
    loader, manager = _build("plain", UserStream(), root)
    assert manager.resume() == 10
    with warnings.catch_warnings():
        warnings.simplefilter("error", statekit.StatekitWarning)
        assert [_ids(b) for b in loader] == []  # the rest of epoch 0
        assert [_ids(b) for b in loader] == seen[10:]
    manager.save(20)
    listed = json.loads(CliRunner().invoke(cli, ["ls", root, "--json"]).output)
    assert [c for c in listed if c["step"] == 20][0]["resume_audit"]["verdict"] == "verified"


def test_a_stream_restored_wrongly_at_its_epochs_end_is_named(tmp_path):
    root = str(tmp_path / "run")
    _at_epoch_end("plain", "ignore", root)
    loader, manager = _build("plain", UserStream("ignore"), root)
    assert manager.resume() == 10
    with pytest.warns(statekit.ResumeAuditWarning, match=r"the saved run's epoch 0 ended after batch 9, but the resumed epoch yields another batch there"):
        next(iter(loader))


def test_attach_mode_save_state_records_the_next_batch_too(tmp_path):
    """accelerator.save_state with statekit attached: the record is written after
    Accelerate's folder committed, and attach mode's load_state names a stream restored late."""
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.state import AcceleratorState, GradientState

    def attached(fault):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(dispatch_batches=None))
        loader = accelerator.prepare(torch.utils.data.DataLoader(UserStream(fault), batch_size=BATCH))
        statekit.attach(accelerator)
        return accelerator, loader

    accelerator, loader = attached("late")
    it = iter(loader)
    for _ in range(3):
        next(it)
    accelerator.save_state(str(tmp_path / "c"))
    expected = _ids(next(it))
    assert (tmp_path / "c" / "next-batch" / "dataloader_0" / "rank-00000.json").exists()
    accelerator, loader = attached("late")
    accelerator.load_state(str(tmp_path / "c"))
    with pytest.warns(statekit.ResumeAuditWarning, match=r"dataloader_0 \(DataLoaderDispatcher over UserStream\).*batch 3 of epoch 0 differs in content"):
        assert _ids(next(iter(loader))) != expected
