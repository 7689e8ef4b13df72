"""Training loops over Hugging Face ``datasets`` and stateful loaders, written as users write them.

A :class:`Stack` names one data setup (the dataset, its transforms, the loader class, worker
processes, Accelerate or not, ``set_epoch`` or not). :func:`run` trains it the way a training
script does: build everything fresh (as a restarted process does), ``manager.resume()``, then
a ``while``/``for`` loop over the loader that saves at one step and stops (dies) at another.
Each step records the samples of its batch (the ``idx`` column) and its loss, so an
interrupted-and-resumed run can be compared with the uninterrupted one at every step.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch
import torch.nn.functional as F

import statekit

N, BATCH = 48, 4
STEPS_PER_EPOCH = N // BATCH  # 12
TOTAL = 40  # steps of a run: 3 epochs and 4 batches
_g = torch.Generator().manual_seed(7)
X, Y = torch.randn(N, 6, generator=_g), torch.randint(0, 3, (N,), generator=_g)


@dataclasses.dataclass(frozen=True)
class Stack:
    """One data setup.

    Attributes:
        dataset: ``map`` (``Dataset.with_format("torch")``), ``augment`` (``set_transform``
            drawing random noise), ``iterable`` (``to_iterable_dataset(num_shards=4)``),
            ``shuffled`` (iterable ``.shuffle(seed, buffer_size)``), ``chain`` (iterable
            ``.map().filter()``), ``by_node`` (iterable through ``split_dataset_by_node``,
            rank 0 of 2), ``interleave`` (``interleave_datasets`` with probabilities).
        loader: ``torch`` (``DataLoader``) or ``stateful`` (torchdata ``StatefulDataLoader``).
        workers: ``num_workers``.
        accelerate: prepare with an ``Accelerator`` (``CheckpointManager(accelerator)``);
            else a manager over a mapping.
        set_epoch: call ``dataset.set_epoch(epoch)`` before every epoch.
        stateful_accelerate: ``DataLoaderConfiguration(use_stateful_dataloader=True)``.
    """

    dataset: str
    loader: str = "torch"
    workers: int = 0
    accelerate: bool = False
    set_epoch: bool = False
    stateful_accelerate: bool = False

    @property
    def id(self) -> str:
        parts = [self.dataset, self.loader, f"w{self.workers}", "acc" if self.accelerate else "plain"]
        if self.set_epoch:
            parts.append("set_epoch")
        if self.stateful_accelerate:
            parts.append("acc_stateful")
        return "-".join(parts)


def _records(idx: list[int]) -> dict[str, list[Any]]:
    return {"idx": idx, "x": [X[i].tolist() for i in idx], "y": [int(Y[i]) for i in idx]}


def _augment(examples: dict[str, Any]) -> dict[str, Any]:
    x = torch.tensor(examples["x"])
    return {"idx": torch.tensor(examples["idx"]), "x": x + 0.1 * torch.rand(x.shape), "y": torch.tensor(examples["y"])}


def _double(example: dict[str, Any]) -> dict[str, Any]:
    return {"x": [2 * v for v in example["x"]]}


def make_dataset(kind: str) -> Any:
    """The Hugging Face dataset of a :class:`Stack` (``datasets`` is imported here)."""
    from datasets import Dataset, interleave_datasets
    from datasets.distributed import split_dataset_by_node

    full = Dataset.from_dict(_records(list(range(N))))
    if kind == "map":
        return full.with_format("torch")
    if kind == "augment":
        full.set_transform(_augment)
        return full
    stream = full.to_iterable_dataset(num_shards=4)
    if kind == "iterable":
        return stream.with_format("torch")
    if kind == "shuffled":
        return stream.shuffle(seed=3, buffer_size=16).with_format("torch")
    if kind == "chain":
        return stream.map(_double).filter(lambda e: e["idx"] % 5 != 0).with_format("torch")
    if kind == "by_node":
        # rank 0 of 2 nodes, double the samples so an epoch keeps its length
        both = Dataset.from_dict(_records(list(range(N)) * 2)).to_iterable_dataset(num_shards=4)
        return split_dataset_by_node(both, rank=0, world_size=2).with_format("torch")
    if kind == "interleave":
        a = Dataset.from_dict(_records(list(range(N // 2)))).to_iterable_dataset(num_shards=2)
        b = Dataset.from_dict(_records(list(range(N // 2, N)))).to_iterable_dataset(num_shards=2)
        return interleave_datasets([a, b], probabilities=[0.6, 0.4], seed=5).with_format("torch")
    raise ValueError(kind)


class EpochCounter:
    """The loop's epoch number, checkpointed with the run (what ``set_epoch`` is called with:
    an epoch of a filtered stream has no fixed number of steps)."""

    def __init__(self) -> None:
        self.epoch = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = state["epoch"]


@dataclasses.dataclass
class Result:
    """What one run did: per step ``(step, sample indices, loss)``; the final weights; the
    statekit warnings it raised."""

    steps: list[tuple[int, list[int], float]]
    weights: dict[str, torch.Tensor]
    warnings: list[str]


def run(stack: Stack, root: str, total: int, save_at: int | None = None, die_at: int | None = None,
        resume: bool = False, manager: bool = True) -> Result:
    """Train ``stack`` for ``total`` steps as a user's script does (see the module docstring).

    Args:
        root: the checkpoint root.
        total: the step the run ends at.
        save_at: save at this step (``manager.save(step)``).
        die_at: stop right after this step, as a process killed there (no clean-up).
        resume: ``manager.resume()`` first.
        manager: False: no statekit at all (the run without statekit).
    """
    torch.manual_seed(0)
    dataset = make_dataset(stack.dataset)
    loader_cls = torch.utils.data.DataLoader
    if stack.loader == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader as loader_cls
    shuffle = None if isinstance(dataset, torch.utils.data.IterableDataset) else True
    loader = loader_cls(dataset, batch_size=BATCH, shuffle=shuffle, num_workers=stack.workers)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    accelerator = None
    if stack.accelerate:
        from accelerate import Accelerator, DataLoaderConfiguration
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=stack.stateful_accelerate))
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    checkpoints = None
    counter = EpochCounter()
    if manager:
        objects = accelerator if accelerator is not None else {"model": model, "optimizer": optimizer, "loader": loader, "epoch": counter}
        if accelerator is not None:
            accelerator.register_for_checkpointing(counter)
        checkpoints = statekit.CheckpointManager(objects, root)
    steps: list[tuple[int, list[int], float]] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = (checkpoints.resume() or 0) if resume else 0
        while step < total:
            if stack.set_epoch:
                dataset.set_epoch(counter.epoch)
            for batch in loader:
                loss = F.cross_entropy(model(batch["x"]), batch["y"])
                if accelerator is not None:
                    accelerator.backward(loss)
                else:
                    loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                step += 1
                steps.append((step, batch["idx"].tolist(), loss.item()))
                if step == save_at:
                    checkpoints.save(step)
                if step == die_at or step >= total:
                    break
            else:
                counter.epoch += 1
                continue
            if step == die_at:
                break
        if checkpoints is not None:
            checkpoints.wait()
    unwrapped = accelerator.unwrap_model(model) if accelerator is not None else model
    weights = {k: v.detach().clone() for k, v in unwrapped.state_dict().items()}
    messages = [f"{w.category.__name__}: {w.message}" for w in caught if issubclass(w.category, Warning)
                and issubclass(w.category, statekit.StatekitWarning)]
    if stack.workers:
        _shut_down_workers(loader)
    return Result(steps, weights, messages)


def _shut_down_workers(loader: Any) -> None:
    """Stop the loader's worker processes now (a run that left its epoch with ``break``
    leaves an iterator in a reference cycle: the garbage collector would join its workers,
    5 s each, in whichever later test it happens to run)."""
    import gc

    inner = loader.__dict__.get("base_dataloader", loader)
    iterator = getattr(inner, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
    gc.collect()


def interrupted(stack: Stack, tmp_path: Any, total: int = 40, save_at: int = 17, die_at: int = 20) -> tuple[Result, Result, Result]:
    """(reference, the run that saved at ``save_at`` and died at ``die_at``, the resumed run)."""
    reference = run(stack, str(tmp_path / "reference"), total)
    root = str(tmp_path / "root")
    first = run(stack, root, total, save_at=save_at, die_at=die_at)
    resumed = run(stack, root, total, resume=True)
    return reference, first, resumed
