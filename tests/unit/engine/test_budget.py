"""Async saves under a host-memory budget (engine/budget.py): the committed checkpoint is a
synchronous save's at the call, bit for bit, with the writer held back and training going on;
the ring never holds more than the budget; an in-place write before staging fails the save.

The writer is held back by gating :meth:`PieceRing.chunks` on an event (no sleeps); an
optimizer step is seen waiting through the step barrier's log line."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from safetensors.torch import load_file

import statekit
from statekit.api.asyncsave import AsyncSaveError
from statekit.api.saveload import save_objects
from statekit.engine import budget
from statekit.engine.budget import MIN_BUDGET_BYTES, RESERVED_BYTES, PieceRing, budget_bytes, piece_bytes, ring_bytes
from statekit.engine.entries import classify
from statekit.engine.staging import StagingPool
from statekit.manager.manager import checkpoint_name

WAIT_S = 60  # a bound against a hang, never reached when the test passes


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.BatchNorm1d(512), torch.nn.Linear(512, 8))
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    _train(model, optim)
    return model, optim


def _train(model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
    optim.zero_grad()
    model(torch.randn(16, 256)).square().mean().backward()
    optim.step()


@pytest.fixture
def gate(monkeypatch):
    """Hold the writer of budgeted saves before its first byte until ``gate.set()``."""
    event = threading.Event()
    chunks = PieceRing.chunks

    def gated(self, nbytes):
        assert event.wait(WAIT_S)
        yield from chunks(self, nbytes)

    monkeypatch.setattr(PieceRing, "chunks", gated)
    yield event
    event.set()


@pytest.fixture
def step_waits():
    """An event set when an optimizer step starts waiting for the step barrier."""
    event = threading.Event()

    class Seen(logging.Handler):
        def emit(self, record):
            if record.getMessage().startswith("optimizer step waits for"):
                event.set()

    barrier = logging.getLogger("statekit.engine.step_barrier")
    handler, level = Seen(), barrier.level
    barrier.addHandler(handler)
    barrier.setLevel(logging.INFO)
    yield event
    barrier.removeHandler(handler)
    barrier.setLevel(level)


def _files(url) -> dict[str, dict[str, torch.Tensor]]:
    from pathlib import Path

    return {p.name: load_file(str(p)) for p in sorted(Path(url).glob("*.safetensors"))}


def test_the_checkpoint_equals_a_sync_save_at_the_call_with_training_beside_it(tmp_path, plugin_manager, gate, step_waits):
    model, optim = _model()
    entries = lambda: [classify("model", model), classify("optim", optim)]  # noqa: E731
    sync = save_objects(str(tmp_path / "sync"), entries())
    pool = StagingPool()
    largest = max(t.numel() * t.element_size() for t in model.state_dict().values())
    assert MIN_BUDGET_BYTES < largest  # a budget smaller than the largest tensor: it is split into pieces
    pending = save_objects(str(tmp_path / "async"), entries(), blocking=False, staging=pool,
                           host_memory_budget=MIN_BUDGET_BYTES)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()
    model(torch.randn(16, 256)).square().mean().backward()  # forward (BatchNorm's statistics) and backward run on
    stepping = threading.Thread(target=optim.step)  # the step waits: the weights are not all staged yet
    stepping.start()
    assert step_waits.wait(WAIT_S)
    assert torch.equal(model[0].weight, before["0.weight"])  # still the weights of the call
    gate.set()
    manifest = pending.wait()
    stepping.join()
    assert not torch.equal(model[0].weight, before["0.weight"])  # the step ran, after the staging
    saved, expected = _files(tmp_path / "async"), _files(tmp_path / "sync")
    assert saved.keys() == expected.keys() and saved
    for rel in expected:
        assert saved[rel].keys() == expected[rel].keys()
        for name, t in expected[rel].items():
            assert torch.equal(saved[rel][name], t), (rel, name)
    for rel, entry in sync.files.items():  # the same bytes: the same checksums
        assert manifest.files[rel].checksum == entry.checksum, rel
    assert 0 < pool.ring.high_water_bytes <= MIN_BUDGET_BYTES


def test_the_host_buffers_stay_within_the_budget_from_save_to_save(tmp_path, plugin_manager):
    model, optim = _model()
    pool = StagingPool()
    for step in (1, 2, 3):
        pending = save_objects(str(tmp_path / f"c{step}"), [classify("model", model), classify("optim", optim)],
                               blocking=False, staging=pool, host_memory_budget=0.1)
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        pending.wait()
        _train(model, optim)
    state = sum(t.numel() * t.element_size() for f in _files(tmp_path / "c3").values() for t in f.values())
    limit = budget_bytes(0.1, state)  # a fraction of every tensor file's data: model, optimizer state, the rest
    assert MIN_BUDGET_BYTES < limit < state and 0 < pool.ring.high_water_bytes <= ring_bytes(limit) < limit
    assert pool.ring.host_bytes <= limit  # what stays between saves: the pieces, reused by the next one
    fresh, _ = _model()
    statekit.load(str(tmp_path / "c3"), {"model": fresh})
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in expected.items())


def test_a_budget_holds_the_peak_to_it_when_only_parameters_and_optimizer_state_are_saved(tmp_path, plugin_manager):
    torch.manual_seed(1)
    model = torch.nn.Linear(1024, 300)  # 1.2 MB weight, no buffers: everything is staged after the call
    optim = torch.optim.AdamW(model.parameters())
    _train_linear(model, optim)
    pool = StagingPool()
    pending = save_objects(str(tmp_path / "a"), [classify("model", model), classify("optim", optim)],
                           blocking=False, staging=pool, host_memory_budget=200_000)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    pending.wait()
    assert 0 < pool.ring.high_water_bytes <= 200_000
    fresh = torch.nn.Linear(1024, 300)
    statekit.load(str(tmp_path / "a"), {"model": fresh})
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in expected.items())


def _train_linear(model, optim):
    optim.zero_grad()
    model(torch.randn(4, 1024)).sum().backward()
    optim.step()


def test_an_in_place_write_before_staging_fails_the_save_and_keeps_the_last_checkpoint(tmp_path, plugin_manager, gate):
    model, optim = _model()
    manager = statekit.CheckpointManager({"model": model, "optim": optim}, str(tmp_path),
                                         async_save=statekit.AsyncPolicy(host_memory_budget=MIN_BUDGET_BYTES))
    gate.set()
    manager.save(1)
    manager.wait()
    committed = {k: v.clone() for k, v in model.state_dict().items()}
    _train(model, optim)  # (an unchanged file would be reused from checkpoint 1, never staged)
    gate.clear()
    manager.save(2)
    with torch.no_grad():
        model[2].bias.add_(1.0)  # not an optimizer step, and the last tensor of the file: not staged yet
    gate.set()
    with pytest.raises(AsyncSaveError, match=r"model\.safetensors: tensor '2\.bias' was modified in place after "
                                             r"the async save of step 2 to .* was called"):
        manager.wait()
    assert manager.latest().endswith(checkpoint_name(1))
    assert not (tmp_path / checkpoint_name(2) / "manifest.json").exists()
    fresh, _ = _model()
    statekit.load(manager.latest(), {"model": fresh})
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in committed.items())
    _train(model, optim)  # no optimizer step is left waiting


def test_a_statekit_load_into_the_model_before_staging_fails_the_save(tmp_path, plugin_manager, gate):
    """statekit's own loads fill tensors through a NumPy view, which bumps no version
    counter by itself: the reader bumps it (format/tensors.py), so a load into the live
    model while a budgeted save is pending is seen like any in-place write (found by a
    docs-only trial: the checkpoint held the loaded weights)."""
    model, optim = _model()
    other, _ = _model()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    gate.set()
    statekit.save(str(tmp_path / "other"), {"model": other})
    gate.clear()
    pending = statekit.save(str(tmp_path / "a"), {"model": model, "optim": optim}, blocking=False,
                            host_memory_budget=MIN_BUDGET_BYTES)
    statekit.load(str(tmp_path / "other"), {"model": model})  # the writer is held: nothing is staged yet
    gate.set()
    with pytest.raises(AsyncSaveError, match=r"model\.safetensors: tensor .* was modified in place after the async save"):
        pending.wait()
    assert not (tmp_path / "a" / "statekit.json").exists()


def test_a_write_through_data_is_the_blind_spot(tmp_path, plugin_manager, gate):
    """``.data`` has a version counter of its own: such a write is not seen (docs/design-notes.md,
    "Async saves"); the checkpoint holds whatever the stager copied."""
    model, optim = _model()
    pending = statekit.save(str(tmp_path / "a"), {"model": model, "optim": optim}, blocking=False,
                            host_memory_budget=MIN_BUDGET_BYTES)
    model[2].bias.data.fill_(7.0)  # not yet staged (the writer is held): no version bump, no error
    gate.set()
    pending.wait()
    assert torch.equal(load_file(str(tmp_path / "a" / "model.safetensors"))["2.bias"], torch.full((8,), 7.0))


def test_a_failed_write_leaves_no_step_waiting(tmp_path, plugin_manager, monkeypatch):
    from statekit.engine import step_barrier
    from statekit.engine.file_writer import FileWriter

    def broken(self, rel, *args):
        raise OSError(f"disk gone while writing {rel}")

    model, optim = _model()
    monkeypatch.setattr(FileWriter, "_write_tensors", broken)
    pending = statekit.save(str(tmp_path / "a"), {"model": model, "optim": optim}, blocking=False,
                            host_memory_budget=MIN_BUDGET_BYTES)
    with pytest.raises(AsyncSaveError, match="disk gone while writing"):
        pending.wait()
    assert step_barrier.wait_for_readers(timeout=WAIT_S)  # the stager ended with the save
    _train(model, optim)


def test_stalled_storage_gives_the_save_up_and_the_step_goes_on(tmp_path, plugin_manager, gate, monkeypatch):
    monkeypatch.setattr(budget, "STALLED_AFTER_S", 0.05)  # the bound under test (default 300 s)
    model, optim = _model()
    pending = statekit.save(str(tmp_path / "a"), {"model": model, "optim": optim}, blocking=False,
                            host_memory_budget=MIN_BUDGET_BYTES)
    before = model[0].weight.clone()
    _train(model, optim)  # the writer never gives a piece back: the stager gives up, the step runs
    assert not torch.equal(model[0].weight, before)
    gate.set()
    with pytest.raises(AsyncSaveError, match=r"wrote nothing back to the staging budget for 0.05 s \(stalled storage\?\)"):
        pending.wait()
    assert not (tmp_path / "a" / "manifest.json").exists()


def test_buffers_and_tensors_outside_an_optimizer_are_copied_during_the_call(tmp_path, plugin_manager, gate):
    model, optim = _model()
    extra = torch.arange(10.0)
    pending = statekit.save(str(tmp_path / "a"), {"model": model, "optim": optim, "extra": extra},
                            blocking=False, host_memory_budget=MIN_BUDGET_BYTES)
    stats = model[1].running_mean.clone()
    model.train()
    model(torch.randn(16, 256))  # BatchNorm updates its statistics in place: they were copied already
    extra.add_(1.0)
    gate.set()
    pending.wait()
    loaded = load_file(str(tmp_path / "a" / "model.safetensors"))
    assert torch.equal(loaded["1.running_mean"], stats) and not torch.equal(model[1].running_mean, stats)
    target = {"extra": torch.zeros(10)}
    statekit.load(str(tmp_path / "a"), target)
    assert torch.equal(target["extra"], torch.arange(10.0))


def test_manager_round_trip_with_a_budget(tmp_path, plugin_manager):
    model, optim = _model()
    manager = statekit.CheckpointManager({"model": model, "optim": optim}, str(tmp_path),
                                         async_save=statekit.AsyncPolicy(host_memory_budget=0.25))
    for step in (1, 2):
        _train(model, optim)
        manager.save(step)
    manager.wait()
    expected_model = {k: v.clone() for k, v in model.state_dict().items()}
    expected_optim = optim.state_dict()
    fresh_model, fresh_optim = _model()
    _train(fresh_model, fresh_optim)
    fresh = statekit.CheckpointManager({"model": fresh_model, "optim": fresh_optim}, str(tmp_path))
    assert fresh.resume() is not None
    assert all(torch.equal(fresh_model.state_dict()[k], v) for k, v in expected_model.items())
    for param, state in expected_optim["state"].items():
        for key, value in state.items():
            assert torch.equal(fresh_optim.state_dict()["state"][param][key], value), (param, key)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (0, r"host_memory_budget must be at least 65536 bytes \(64 KiB\), got 0"),
        (1000, r"host_memory_budget must be at least 65536 bytes \(64 KiB\), got 1000"),
        (1.5, r"host_memory_budget as a fraction of the state must be in \(0, 1\], got 1.5"),
        (0.0, r"host_memory_budget as a fraction of the state must be in \(0, 1\], got 0.0"),
        ("2GiB", r"host_memory_budget must be a number of bytes \(int\), a fraction of the state in \(0, 1\] \(float\) "
                 r"or None, got '2GiB'"),
        (True, r"host_memory_budget must be a number of bytes .* got True"),
    ],
)
def test_invalid_budgets_are_refused_naming_the_value(tmp_path, plugin_manager, value, message):
    with pytest.raises(statekit.InvalidOptionError, match=f"AsyncPolicy.{message}"):
        statekit.AsyncPolicy(host_memory_budget=value)
    with pytest.raises(statekit.InvalidOptionError, match=message):
        statekit.save(str(tmp_path / "x"), {"t": torch.ones(2)}, blocking=False, host_memory_budget=value)
    assert not (tmp_path / "x").exists()


def test_the_ring_leaves_part_of_the_budget_to_the_writer_in_pieces_of_a_quarter_up_to_16_mib():
    assert ring_bytes(MIN_BUDGET_BYTES) == 32 * 1024 and piece_bytes(ring_bytes(MIN_BUDGET_BYTES)) == 8 * 1024
    assert ring_bytes(2**30) == 2**30 - RESERVED_BYTES
    assert piece_bytes(100_000) == 24 * 1024
    assert piece_bytes(2**33) == 16 * 1024 * 1024
    assert budget_bytes(0.5, 10**9) == 5 * 10**8 and budget_bytes(0.5, 1000) == MIN_BUDGET_BYTES
    assert budget.protected_storages([object()]) == set()
