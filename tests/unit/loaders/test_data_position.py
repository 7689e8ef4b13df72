"""The data position at the edges: an epoch's last batch, and loaders statekit never tracked."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

import statekit

from accelerate_helpers import build, train_steps


def _loader(seed: int = 0) -> torch.utils.data.DataLoader:
    data = torch.utils.data.TensorDataset(torch.arange(20))
    return torch.utils.data.DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(seed))


def _epoch(loader) -> list[list[int]]:
    return [batch[0].tolist() for batch in loader]


def _reference_then_saved_at_batch_2(tmp_path, epochs: int) -> list[list[list[int]]]:
    """The batches of ``epochs`` uninterrupted epochs (root ``ref``), then a run saved as
    step 2 after two batches of its first epoch (root ``root``)."""
    reference = _loader()
    statekit.CheckpointManager({"loader": reference}, str(tmp_path / "ref"))
    expected = [_epoch(reference) for _ in range(epochs)]
    loader = _loader()
    manager = statekit.CheckpointManager({"loader": loader}, str(tmp_path / "root"))
    for i, _ in enumerate(loader):
        if i == 1:
            manager.save(2)
            break
    return expected


def test_save_after_the_last_batch_before_the_loop_ends(tmp_path, plugin_manager):
    """RandomSampler draws once more when it runs out; a save right after the last batch
    (inside the ``for`` loop) must hold the generator after that draw."""
    reference = _loader()
    statekit.CheckpointManager({"loader": reference}, str(tmp_path / "ref"))  # tracks it
    expected = [_epoch(reference) for _ in range(3)]

    loader = _loader()
    manager = statekit.CheckpointManager({"loader": loader}, str(tmp_path / "root"))
    first = []
    for i, batch in enumerate(loader):
        first.append(batch[0].tolist())
        if i == 4:  # the epoch's last batch: the loop has not asked for the next one
            manager.save(5)
    assert first == expected[0]

    resumed = _loader(seed=7)
    with pytest.warns(statekit.StatekitWarning, match=r"right after the last batch of epoch 0.*derive the epoch from the step"):
        assert statekit.CheckpointManager({"loader": resumed}, str(tmp_path / "root")).resume() == 5
    assert [_epoch(resumed) for _ in range(2)] == expected[1:]



def test_save_after_the_last_batch_of_a_resumed_epoch(tmp_path, plugin_manager):
    """The same save at the end of an epoch that was itself resumed mid-epoch: the skip
    shortens the batch sampler, but the read-ahead must still come before the epoch's last
    batch (not before its last batch counted from the resume point)."""
    expected = _reference_then_saved_at_batch_2(tmp_path, epochs=3)
    resumed = _loader(seed=7)
    manager = statekit.CheckpointManager({"loader": resumed}, str(tmp_path / "root"))
    assert manager.resume() == 2
    rest = []
    for i, batch in enumerate(resumed):
        rest.append(batch[0].tolist())
        if i == 2:  # the epoch's last batch
            manager.save(5)
    assert rest == expected[0][2:]

    again = _loader(seed=9)
    assert statekit.CheckpointManager({"loader": again}, str(tmp_path / "root")).resume() == 5
    assert [_epoch(again) for _ in range(2)] == expected[1:]


def test_untracked_plain_loader_warns_at_save_and_load(tmp_path, plugin_manager):
    loader = _loader()
    batches = iter(loader)
    next(batches)
    with pytest.warns(statekit.StatekitWarning, match=r"loader: statekit does not track this data loader.*starts epoch 0 over"):
        statekit.save(str(tmp_path / "c"), {"loader": loader})
    with pytest.warns(statekit.StatekitWarning, match=r"loader: the checkpoint holds only the epoch.*epoch 0 restarts"):
        statekit.load(str(tmp_path / "c"), {"loader": _loader()})


def test_untracked_accelerate_loader_warns_only_inside_an_epoch(tmp_path, installed_plugin_manager):
    pytest.importorskip("accelerate")
    run = build()  # statekit.save_state without attach: the loaders are not tracked
    batches = iter(run[3])
    next(batches)
    with pytest.warns(statekit.StatekitWarning, match=r"dataloader_0: statekit does not track.*statekit.attach"):
        statekit.save_state(run[0], str(tmp_path / "mid"))
    for _ in batches:  # the epoch ends
        pass
    with warnings.catch_warnings():
        warnings.simplefilter("error", statekit.StatekitWarning)
        statekit.save_state(run[0], str(tmp_path / "boundary"))


def test_attached_run_saves_without_warning(tmp_path, installed_plugin_manager):
    pytest.importorskip("accelerate")
    run = build()
    statekit.attach(run[0])
    train_steps(run, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", statekit.StatekitWarning)
        statekit.save_state(run[0], str(tmp_path / "c"))


def test_save_after_a_restore_before_iterating_keeps_the_restored_position(tmp_path, plugin_manager):
    expected = _reference_then_saved_at_batch_2(tmp_path, epochs=2)
    again = _loader(seed=3)
    manager = statekit.CheckpointManager({"loader": again}, str(tmp_path / "root"))
    assert manager.resume() == 2
    manager.save(3)  # before the loader is iterated again
    resumed = _loader(seed=5)
    assert statekit.CheckpointManager({"loader": resumed}, str(tmp_path / "root")).resume() == 3
    assert _epoch(resumed) == expected[0][2:]
    assert _epoch(resumed) == expected[1]


def test_skip_first_batches_after_an_attached_resume_is_not_applied_twice(tmp_path, installed_plugin_manager, caplog):
    """An Accelerate script kept as it was (attach mode) resumes with
    ``accelerator.skip_first_batches(loader, n)`` (transformers' run_clm_no_trainer.py,
    Accelerate's examples/by_feature/checkpointing.py): statekit's restored position already
    skips n batches, so the loader itself comes back (an exact resume: a log line, no
    warning); another n raises."""
    from accelerate import Accelerator

    def run():
        torch.manual_seed(0)
        accelerator = Accelerator()
        statekit.attach(accelerator)
        data = torch.utils.data.TensorDataset(torch.arange(20))
        return accelerator, accelerator.prepare(torch.utils.data.DataLoader(data, batch_size=4, shuffle=True))

    accelerator, loader = run()
    expected = [_epoch(loader) for _ in range(2)]
    accelerator, loader = run()
    for i, batch in enumerate(loader):
        if i == 1:
            accelerator.save_state(str(tmp_path / "c"))
            break
    accelerator, loader = run()
    accelerator.load_state(str(tmp_path / "c"))
    with pytest.raises(statekit.StateMismatchError, match=r"skip_first_batches\(3\).*batch 2"):
        accelerator.skip_first_batches(loader, 3)
    with warnings.catch_warnings(), caplog.at_level(logging.INFO, logger="statekit"):
        warnings.simplefilter("error", statekit.StatekitWarning)
        active = accelerator.skip_first_batches(loader, 2)
    assert active is loader
    assert "skip_first_batches(2) returns the loader itself" in caplog.text
    assert [_epoch(active), _epoch(loader)] == [expected[0][2:], expected[1]]


class _Augmented(torch.utils.data.Dataset):
    """A random augmentation drawn from the global torch RNG in ``__getitem__`` (as
    torchvision transforms do), read in the training process (``num_workers=0``)."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((4,), float(i)) + torch.rand(4)


class _AugmentedStream(torch.utils.data.IterableDataset):
    """The same augmentation in a stream without state: a resume re-reads the consumed batches."""

    def __iter__(self):
        for i in range(64):
            yield torch.full((4,), float(i)) + torch.rand(4)


@pytest.mark.parametrize("save_at", [3, 7, 8])  # mid-epoch, the epoch's last batch, the next epoch's first
@pytest.mark.parametrize("dataset", [_Augmented, _AugmentedStream])  # indices skipped / batches re-read
def test_random_draws_of_a_batch_accelerate_fetched_ahead_are_replayed(tmp_path, installed_plugin_manager, save_at, dataset):
    """Accelerate's loader fetches batch k+1 (and draws its augmentation) before it yields
    batch k; a save after step k holds states past those draws. The resume fetches batch
    k+1 again from the states before its first fetch, then goes on from the saved ones:
    the same augmented batches and the same dropout masks as the uninterrupted run."""
    from accelerate_helpers import fresh_accelerator

    def run(root, stop=None, resume=False):
        torch.manual_seed(0)
        accelerator = fresh_accelerator()
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
        loader = torch.utils.data.DataLoader(dataset(), batch_size=8, shuffle=dataset is _Augmented)
        model, loader = accelerator.prepare(model, loader)
        manager = statekit.CheckpointManager(accelerator, str(root))
        step = manager.resume() if resume else 0
        seen = []
        while step < 12:
            for batch in loader:
                step += 1
                seen.append((batch.clone(), model(batch).detach()))  # the batch and its dropout mask's output
                if step == stop:
                    manager.save(step)
                    return seen
                if step == 12:
                    break
        return seen

    expected = run(tmp_path / "ref")
    run(tmp_path / "run", stop=save_at)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "resumed epoch", statekit.StatekitWarning)  # the stream is re-read
        resumed = run(tmp_path / "run", resume=True)
    assert len(resumed) == 12 - save_at
    for (batch, out), (want_batch, want_out) in zip(resumed, expected[save_at:]):
        assert torch.equal(batch, want_batch)
        assert torch.equal(out, want_out)


def test_read_ahead_states_saved_with_more_devices_resume(tmp_path, installed_plugin_manager, monkeypatch):
    """The replayed fetch states hold the generators of every device the saving process saw;
    a resume on a process with fewer devices sets those it has (torch.cuda's
    set_rng_state_all indexes past the last device: IndexError at the first batch)."""
    from accelerate_helpers import fresh_accelerator

    import statekit.devices

    class Devices:  # behaves like torch.cuda's generator functions
        def __init__(self, n):
            self.gens = [torch.Generator() for _ in range(n)]

        def get_rng_state_all(self):
            return [g.get_state() for g in self.gens]

        def set_rng_state_all(self, states):
            for i, s in enumerate(states):
                self.gens[i].set_state(s)

        def device_count(self):
            return len(self.gens)

    def run(devices, stop=None, resume=False):
        module = Devices(devices)
        monkeypatch.setattr(statekit.devices, "accelerator_generators", lambda initialised_only=False: ("cuda", module))
        torch.manual_seed(0)
        accelerator = fresh_accelerator()
        loader = accelerator.prepare(torch.utils.data.DataLoader(_Augmented(), batch_size=8, shuffle=True))
        manager = statekit.CheckpointManager(accelerator, str(tmp_path))
        step = manager.resume() if resume else 0
        seen = []
        for batch in loader:
            step += 1
            seen.append(batch.clone())
            if step == stop:
                manager.save(step)
                return seen
        return seen

    expected = run(2)
    run(2, stop=3)
    resumed = run(1, resume=True)
    assert len(resumed) == len(expected) - 3
    assert all(torch.equal(a, b) for a, b in zip(resumed, expected[3:]))
