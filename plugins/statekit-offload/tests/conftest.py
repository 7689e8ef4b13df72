"""Fixtures for statekit-offload tests: a fresh plugin manager holding this plugin, small
models (tied weights, buffers, a module that can be split across cpu and disk)."""

from __future__ import annotations

import gc
import warnings
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import statekit
import statekit.hooks.registry
import statekit_offload.plugin


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    """Silence the core's once-per-process "no RNG plugin" warning and Accelerate's
    "parameters on the meta device" log line: neither is what these tests check."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="no installed plugin saves random", category=statekit.StatekitWarning)
        yield
    gc.collect()


@pytest.fixture
def pm() -> Iterator[statekit.hooks.registry.PluginManager]:
    """A fresh process-wide plugin manager with only statekit-offload registered (as ``offload``)."""
    manager = statekit.hooks.registry.build_plugin_manager(autoload=False)
    manager.register(statekit_offload.plugin, name="offload")
    with statekit.hooks.registry.use_plugin_manager(manager):
        yield manager


class Block(nn.Module):
    """Linear + LayerNorm with a persistent and a non-persistent buffer."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.register_buffer("scale", torch.tensor(1.5))
        self.register_buffer("mask", torch.ones(d), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x) * self.scale * self.mask)


class Net(nn.Module):
    """Embedding -> Block -> Linear -> head, the head's weight tied to the embedding's."""

    def __init__(self, vocab: int = 11, d: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.block = Block(d)
        self.out = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.out(self.block(self.embed(ids))))


def build_net(seed: int = 0, meta: bool = False) -> Net:
    """A :class:`Net` with seeded weights and ``block.scale`` = 2.5 (the constructor says
    1.5, so a load that skipped the buffer shows); on the meta device with ``meta``."""
    if meta:
        from accelerate import init_empty_weights

        with init_empty_weights():
            return Net()
    torch.manual_seed(seed)
    net = Net()
    net.block.scale.fill_(2.5)
    return net


IDS = torch.tensor([[1, 4, 7, 10], [0, 2, 3, 9]])
"""A batch of token ids for :class:`Net`."""


SPLIT_MAP = {
    "embed": "cpu",
    "block.lin": "disk",
    "block.norm": "cpu",
    "block.scale": "cpu",
    "out": "disk",
    "head": "disk",
}
"""A device map that splits ``block`` across cpu and disk and the tied pair too."""


ALL_DISK = {"embed": "disk", "block": "disk", "out": "disk", "head": "disk"}
"""Every module of :class:`Net` on disk."""


@pytest.fixture
def saved(tmp_path, pm):
    """``(url, net, reference_output)``: a :class:`Net` saved with statekit on local disk."""
    net = build_net()
    url = str(tmp_path / "ckpt")
    statekit.save(url, {"model": net})
    with torch.no_grad():
        ref = net(IDS)
    return url, net, ref


def raised(error: BaseException, cls: type[BaseException]) -> BaseException:
    """The ``cls`` error a plugin raised, as the caller sees it: the error itself (the core
    lets statekit's specific errors through, attributed to the plugin) or the
    ``__cause__`` of a :class:`statekit.PluginError` (cores that wrap every plugin error)."""
    if not isinstance(error, cls) and isinstance(error, statekit.PluginError):
        error = error.__cause__  # type: ignore[assignment]
    assert isinstance(error, cls), f"expected {cls.__name__}, got {type(error).__name__}: {error}"
    return error
