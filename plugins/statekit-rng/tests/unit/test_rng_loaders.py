"""Data-loader generators: attach leaves a run as it is, a loader's own generators
round-trip by stable key, and a mid-epoch resume keeps the global stream aligned."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset

import statekit
import statekit.hooks.registry
import statekit_rng.plugin as rng_plugin
from statekit_rng.loaders import generator_holders


def _dataset(n: int = 20) -> TensorDataset:
    return TensorDataset(torch.arange(n))


def _attach(pm, objects: dict) -> None:
    """Call statekit_attach the way the host does (one plugin at a time)."""
    statekit.hooks.registry.call_each(pm, "statekit_attach", None, {"accelerator": None, "objects": objects})


def _epoch(loader) -> list[list[int]]:
    return [batch[0].tolist() for batch in loader]


class LoaderKeeper:
    """Takes data loaders away from the core on save and load (as a data plugin would),
    so the loaders' own position is not under test here."""

    @staticmethod
    def _take(checkpoint) -> None:
        for key in [k for k, o in checkpoint.objects.items() if isinstance(o, DataLoader)]:
            checkpoint.objects.pop(key)

    @statekit.hookimpl
    def statekit_save_state_pre(self, checkpoint) -> None:
        self._take(checkpoint)

    @statekit.hookimpl
    def statekit_load_state_pre(self, checkpoint) -> None:
        self._take(checkpoint)


def _with_generators(n: int = 20, seed: int = 0) -> DataLoader:
    """A shuffled loader whose sampler and workers' seed draw from generators of its own."""
    sampler = RandomSampler(_dataset(n), generator=torch.Generator().manual_seed(seed))
    return DataLoader(_dataset(n), batch_size=4, sampler=sampler, generator=torch.Generator().manual_seed(seed + 1))


def test_attach_changes_nothing_of_the_run(pm) -> None:
    """Attaching gives loaders no generators of their own (that changed the data order of a
    run from its first batch): the batches and the global stream are those of a run
    without statekit."""

    def run(attach: bool) -> list:
        torch.manual_seed(0)
        loader = DataLoader(_dataset(), batch_size=4, shuffle=True)
        if attach:
            statekit.attach(None, {"dl": loader})
            assert loader.generator is None and loader.sampler.generator is None
        return [(_epoch(loader), torch.rand(2).tolist()) for _ in range(2)]

    assert run(attach=True) == run(attach=False)


def test_attach_keeps_existing_generators(pm) -> None:
    sampler_generator = torch.Generator().manual_seed(7)  # as Accelerate sets in multi-process runs
    loader_generator = torch.Generator().manual_seed(8)
    sampler = RandomSampler(_dataset(), generator=sampler_generator)
    loader = DataLoader(_dataset(), batch_size=4, sampler=sampler, generator=loader_generator)
    _attach(pm, {"dl": loader})
    assert loader.sampler.generator is sampler_generator
    assert loader.generator is loader_generator


def test_sampler_generator_found_inside_batch_sampler() -> None:
    sampler = RandomSampler(_dataset())
    loader = DataLoader(_dataset(), batch_size=None, sampler=BatchSampler(sampler, 4, drop_last=False))
    assert generator_holders(loader)["sampler"] is sampler


def test_loader_generators_round_trip(pm, url: str, fake_devices) -> None:
    fake_devices(None)
    pm.register(LoaderKeeper(), name="keeper")
    loader = _with_generators()
    _epoch(loader)  # advance both generators
    manifest = statekit.save(url, {"dl": loader, "w": torch.ones(2)})
    saved = (loader.generator.get_state(), loader.sampler.generator.get_state())
    next_epoch = _epoch(loader)

    loader.generator.manual_seed(1)
    loader.sampler.generator.manual_seed(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", statekit.StatekitWarning)
        statekit.load(url, {"dl": loader, "w": torch.ones(2)})
    assert torch.equal(loader.generator.get_state(), saved[0])
    assert torch.equal(loader.sampler.generator.get_state(), saved[1])
    assert _epoch(loader) == next_epoch
    assert manifest.records["rng"]["loaders"] == ["dl"]
    assert manifest.objects["dl"].owner == "keeper"


def test_loader_without_generator_gets_the_saved_one(pm, memory_url: str, fake_devices) -> None:
    fake_devices(None)
    pm.register(LoaderKeeper(), name="keeper")
    loader = _with_generators()
    statekit.save(memory_url, {"dl": loader})
    next_epoch = _epoch(loader)

    fresh = DataLoader(_dataset(), batch_size=4, shuffle=True)  # never attached
    assert fresh.generator is None and fresh.sampler.generator is None
    statekit.load(memory_url, {"dl": fresh})
    before = torch.get_rng_state()
    assert _epoch(fresh) == next_epoch
    assert torch.equal(torch.get_rng_state(), before)


def test_loader_that_lost_its_random_sampler_warns(pm, memory_url: str, fake_devices) -> None:
    fake_devices(None)
    pm.register(LoaderKeeper(), name="keeper")
    loader = _with_generators()
    statekit.save(memory_url, {"dl": loader})
    sequential = DataLoader(_dataset(), batch_size=4, shuffle=False)
    with pytest.warns(statekit.StatekitWarning, match=r"data loader 'dl': sampler generator"):
        statekit.load(memory_url, {"dl": sequential})
    assert isinstance(sequential.generator, torch.Generator)  # the loader's own one was restored


def test_loader_saved_by_the_core_round_trips(pm, memory_url: str, fake_devices) -> None:
    pytest.importorskip("statekit.loaders.data", reason="the core's data-loader support (statekit/loaders/data.py) is not there yet")
    fake_devices(None)
    loader = _with_generators()
    _epoch(loader)
    statekit.save(memory_url, {"dl": loader})
    saved = (loader.generator.get_state(), loader.sampler.generator.get_state())
    loader.generator.manual_seed(1)
    loader.sampler.generator.manual_seed(2)
    statekit.load(memory_url, {"dl": loader})
    assert torch.equal(loader.generator.get_state(), saved[0])
    assert torch.equal(loader.sampler.generator.get_state(), saved[1])


def _run(url: str, *, save_at: int | None, resume: bool) -> list[tuple[list[int], float]]:
    """One epoch and a half of a toy loop: each step yields (batch, a 'dropout' draw)."""
    torch.manual_seed(123)
    loader = DataLoader(_dataset(24), batch_size=4, shuffle=True)
    state = {"dl": loader}
    statekit.attach(None, state)
    if resume:
        statekit.load(url, state)
    steps: list[tuple[list[int], float]] = []
    for _epoch_index in range(2):
        for batch in loader:
            steps.append((batch[0].tolist(), torch.rand(()).item()))
            if save_at is not None and len(steps) == save_at:
                statekit.save(url, state)
    return steps


def test_mid_epoch_resume_keeps_global_stream_aligned(pm, memory_url: str, fake_devices) -> None:
    """With the core's attach and loader tracking: a resume after step 3 of 6 continues
    with the same batches *and* the same global-RNG draws as the uninterrupted run."""
    if not hasattr(statekit, "attach"):
        pytest.skip("statekit.attach is not in this core")
    fake_devices(None)
    full = _run(memory_url, save_at=3, resume=False)
    resumed = _run(memory_url, save_at=None, resume=True)
    assert len(full) == 12
    assert resumed == full[3:]
