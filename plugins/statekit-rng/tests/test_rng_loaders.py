"""Data-loader generators: attach gives them, iterators stop consuming the global torch
generator, and their states round-trip by stable key."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset

import statekit
import statekit.hooks.registry
import statekit_rng.plugin as rng_plugin


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


def test_iterating_without_attach_consumes_global_rng() -> None:
    """The problem attach solves (control for the next tests)."""
    loader = DataLoader(_dataset(), batch_size=4, shuffle=True)
    before = torch.get_rng_state()
    next(iter(loader))
    assert not torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("shuffle", [True, False])
def test_attach_gives_generators_and_iter_keeps_global_rng(pm, shuffle: bool) -> None:
    torch.manual_seed(0)
    loader = DataLoader(_dataset(), batch_size=4, shuffle=shuffle)
    other = torch.ones(3)
    before = torch.get_rng_state()
    _attach(pm, {"dl": loader, "w": other})
    assert torch.equal(torch.get_rng_state(), before)  # attach draws nothing
    assert isinstance(loader.generator, torch.Generator)
    if shuffle:
        assert isinstance(loader.sampler.generator, torch.Generator)
        assert loader.sampler.generator is not loader.generator
    it = iter(loader)
    next(it)
    _epoch(loader)
    assert torch.equal(torch.get_rng_state(), before)


def test_attach_seeds_deterministically_from_initial_seed_and_key(pm) -> None:
    def attached(seed: int, key: str) -> DataLoader:
        torch.manual_seed(seed)
        loader = DataLoader(_dataset(), batch_size=4, shuffle=True)
        _attach(pm, {key: loader})
        return loader

    a, b = attached(1, "dl"), attached(1, "dl")
    assert torch.equal(a.generator.get_state(), b.generator.get_state())
    assert torch.equal(a.sampler.generator.get_state(), b.sampler.generator.get_state())
    assert _epoch(a) == _epoch(b)
    assert a.sampler.generator.initial_seed() == rng_plugin.derive_seed(1, "dl", "sampler")
    assert attached(1, "other").sampler.generator.initial_seed() != a.sampler.generator.initial_seed()
    assert attached(2, "dl").sampler.generator.initial_seed() != a.sampler.generator.initial_seed()


def test_attach_keeps_existing_generators(pm) -> None:
    sampler_generator = torch.Generator().manual_seed(7)  # as Accelerate sets in multi-process runs
    loader_generator = torch.Generator().manual_seed(8)
    sampler = RandomSampler(_dataset(), generator=sampler_generator)
    loader = DataLoader(_dataset(), batch_size=4, sampler=sampler, generator=loader_generator)
    _attach(pm, {"dl": loader})
    assert loader.sampler.generator is sampler_generator
    assert loader.generator is loader_generator


def test_attach_reaches_sampler_inside_batch_sampler(pm) -> None:
    sampler = RandomSampler(_dataset())
    loader = DataLoader(_dataset(), batch_size=None, sampler=BatchSampler(sampler, 4, drop_last=False))
    _attach(pm, {"dl": loader})
    assert rng_plugin.find_sampler(loader) is sampler
    assert isinstance(sampler.generator, torch.Generator)


def test_attach_on_accelerate_dataloader_shard(pm) -> None:
    from accelerate.data_loader import DataLoaderShard

    torch.manual_seed(0)
    shard = DataLoaderShard(_dataset(), batch_size=4, shuffle=True)
    assert isinstance(shard, DataLoader)
    _attach(pm, {"dataloader_0": shard})
    assert isinstance(shard.base_dataloader.generator, torch.Generator)
    assert isinstance(rng_plugin.find_sampler(shard).generator, torch.Generator)
    before = torch.get_rng_state()
    _epoch(shard)
    assert torch.equal(torch.get_rng_state(), before)


def test_loader_generators_round_trip(pm, url: str, fake_devices) -> None:
    fake_devices(None)
    pm.register(LoaderKeeper(), name="keeper")
    torch.manual_seed(0)
    loader = DataLoader(_dataset(), batch_size=4, shuffle=True)
    _attach(pm, {"dl": loader})
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
    assert manifest["records"]["rng"]["loaders"] == ["dl"]
    assert manifest["objects"]["dl"]["owner"] == "keeper"


def test_loader_without_generator_gets_the_saved_one(pm, memory_url: str, fake_devices) -> None:
    fake_devices(None)
    pm.register(LoaderKeeper(), name="keeper")
    loader = DataLoader(_dataset(), batch_size=4, shuffle=True)
    _attach(pm, {"dl": loader})
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
    loader = DataLoader(_dataset(), batch_size=4, shuffle=True)
    _attach(pm, {"dl": loader})
    statekit.save(memory_url, {"dl": loader})
    sequential = DataLoader(_dataset(), batch_size=4, shuffle=False)
    with pytest.warns(statekit.StatekitWarning, match=r"data loader 'dl': sampler generator"):
        statekit.load(memory_url, {"dl": sequential})
    assert isinstance(sequential.generator, torch.Generator)  # the loader's own one was restored


def test_loader_saved_by_the_core_round_trips(pm, memory_url: str, fake_devices) -> None:
    pytest.importorskip("statekit.engine.data", reason="the core's data-loader support (statekit/engine/data.py) is not there yet")
    fake_devices(None)
    loader = DataLoader(_dataset(), batch_size=4, shuffle=True)
    _attach(pm, {"dl": loader})
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
