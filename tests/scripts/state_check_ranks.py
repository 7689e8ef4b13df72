"""Run under torchrun (gloo, CPU, 1 to 3 ranks): the state check's fault matrix
(tests/integration/torchrun/test_state_check_ranks.py, which gives the cases and judges).

Usage: torchrun --nproc_per_node N state_check_ranks.py CASES ROOT OUT

CASES: a JSON file, a list of ``{"id", "model", "optimizer", "fault", "ranks", "strict"}``
(``ranks``: ``"all"`` or ``"last"``, the ranks the fault is injected on). Per (model,
optimizer) this trains two steps (each rank on its own batch; DDP through
``Accelerator.prepare``, which wraps the model under torchrun even with one process) and
saves once with ``statekit.save_state``; then, per case, it builds fresh objects (another
seed), prepares them with a fresh Accelerator and loads with ``statekit.load_state``, the
fault injected into the live objects inside the load path.

The seam: a plugin registered in code whose ``statekit_load_state_post`` hook applies the
fault. That hook runs on every rank after the core restored every object and before the
state check (``statekit.api.loading.load_objects`` calls ``check_loaded_state`` after
``_load_native`` returns), so the check sees exactly what a buggy load path would leave.
No statekit code is patched for the injection. To read each rank's verdict (not only the
warnings), ``statekit.checks.state_check.check`` is wrapped to keep what it returns.

Each rank writes OUT.rank<r>.json: per case id, the verdict, what it compared and named,
the deliberate differences, every warning raised during the load and the error, if any;
and the MLP's BatchNorm running mean as this rank held it when it saved.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings

import torch
from torch import nn

sys.path.insert(0, __file__.rsplit("/scripts/", 1)[0])
from accelerate_helpers import fresh_accelerator  # noqa: E402

import statekit  # noqa: E402
from statekit.checks import state_check  # noqa: E402


class Mlp(nn.Module):
    """Linear, BatchNorm (buffers), Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.norm = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


class Tied(nn.Module):
    """An embedding and an output head sharing one weight."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(12, 8)
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 12, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.proj(self.embed(x))))


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def lora() -> nn.Module:
    import peft

    base = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    return peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["0", "2"]))


MODELS = {"mlp": Mlp, "tied": Tied, "lora": lora, "bf16": lambda: Small().to(torch.bfloat16)}
OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
}
WEIGHT = {"mlp": "fc1.weight", "tied": "embed.weight", "lora": "base_model.model.0.base_layer.weight", "bf16": "fc1.weight"}
"""The weight the slice and swap faults hit, per model."""


def build(model_name: str, optimizer_name: str, seed: int):
    torch.manual_seed(seed)
    accelerator = fresh_accelerator()
    model = MODELS[model_name]()
    optimizer = OPTIMIZERS[optimizer_name]([p for p in model.parameters() if p.requires_grad])
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer


def train(accelerator, model, optimizer, model_name: str) -> None:
    """Two steps, each rank on its own batch: the moments come from the all-reduced
    gradients, the same on every rank; BatchNorm's running statistics are each rank's own
    (DDP broadcasts rank 0's at the start of each forward), different when they save."""
    g = torch.Generator().manual_seed(100 + accelerator.process_index)
    for _ in range(2):
        if model_name == "tied":
            x = torch.randint(0, 12, (6,), generator=g)
        else:
            x = torch.randn(6, 8, generator=g, dtype=torch.bfloat16 if model_name == "bf16" else torch.float32)
        loss = model(x).float().square().mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()


def moment(optimizer: torch.optim.Optimizer) -> str:
    return "exp_avg" if isinstance(optimizer, torch.optim.AdamW) else "momentum_buffer"


def drop_moments(model, optimizer, model_name, world):
    for state in optimizer.state.values():
        state[moment(optimizer)].zero_()


def drop_one_parameters_state(model, optimizer, model_name, world):
    optimizer.state.pop(dict(model.named_parameters())["fc2.weight"])


def zero_slice(model, optimizer, model_name, world):
    model.get_parameter(WEIGHT[model_name])[1:4].zero_()


def swap_shards(model, optimizer, model_name, world):
    """The rows of rank 0's and rank 1's shards of the weight exchanged (a reshard that
    puts each rank's contribution in the other's place); on one rank, two rows."""
    weight = model.get_parameter(WEIGHT[model_name])
    k = 1 if world == 1 else weight.shape[0] // world
    first, second = weight[:k].clone(), weight[k:2 * k].clone()
    weight[:k], weight[k:2 * k] = second, first


def reset_buffers(model, optimizer, model_name, world):
    model.norm.reset_running_stats()


def break_tie(model, optimizer, model_name, world):
    untied = model.embed.weight.detach().clone()
    untied[0] += 1.0
    model.head.weight = nn.Parameter(untied)


def skip_adapters(model, optimizer, model_name, world):
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.zero_()


def _cast_moments(optimizer, dtype, scale_of=None, scale=1.0):
    for p, state in optimizer.state.items():
        for k in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
            if k in state:
                state[k] = state[k].to(dtype) * (scale if p is scale_of and k == moment(optimizer) else 1.0)


def narrow(model, optimizer, model_name, world):
    """The model and the moments narrowed to bfloat16 after the load: deliberate."""
    model.to(torch.bfloat16)
    _cast_moments(optimizer, torch.bfloat16)


def widen(model, optimizer, model_name, world):
    """The bfloat16 model and moments widened to float32, values kept: deliberate."""
    model.to(torch.float32)
    _cast_moments(optimizer, torch.float32)


def widen_other_values(model, optimizer, model_name, world):
    """Widened to float32 by a path that also changed fc1.weight and its moment (x 1.5)."""
    model.to(torch.float32)
    model.fc1.weight.mul_(1.5)
    _cast_moments(optimizer, torch.float32, scale_of=model.fc1.weight, scale=1.5)


FAULTS = {
    "clean": None,
    "moments-dropped": drop_moments,
    "state-dropped": drop_one_parameters_state,
    "slice-zeroed": zero_slice,
    "shards-swapped": swap_shards,
    "buffer-not-restored": reset_buffers,
    "tie-broken": break_tie,
    "adapter-not-loaded": skip_adapters,
    "narrowing-cast": narrow,
    "widening-cast": widen,
    "widening-cast-other-values": widen_other_values,
}


class FaultInjector:
    """A plugin: applies the current case's fault to the live objects at the end of the load."""

    def __init__(self) -> None:
        self.case: dict | None = None
        self.applied = False

    @statekit.hookimpl
    def statekit_load_state_post(self, models, input_dir, checkpoint):
        case = self.case
        if case is None or FAULTS[case["fault"]] is None:
            return
        if case["ranks"] == "last" and checkpoint.rank != checkpoint.world_size - 1:
            return
        (model,) = models
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        (optimizer,) = [o for o in checkpoint.objects.values() if isinstance(getattr(o, "optimizer", o), torch.optim.Optimizer)]
        with torch.no_grad():
            FAULTS[case["fault"]](model, getattr(optimizer, "optimizer", optimizer), case["model"], checkpoint.world_size)
        self.applied = True


def main(cases_file: str, root: str, out: str) -> None:
    with open(cases_file) as f:
        cases = json.load(f)
    injector = FaultInjector()
    statekit.get_plugin_manager().register(injector, name="fault-injector")
    verdicts: list[state_check.StateVerdict] = []
    original_check = state_check.check

    def observed(*args, **kwargs):
        verdict = original_check(*args, **kwargs)
        verdicts.append(verdict)
        return verdict

    state_check.check = observed  # observation only: the verdict each rank's check returned

    results: dict[str, dict] = {}
    saved: dict[tuple[str, str], str] = {}
    running_means: dict[str, list[float]] = {}
    rank = world = None
    started = time.perf_counter()
    for case in cases:
        combo = (case["model"], case["optimizer"])
        if combo not in saved:
            accelerator, model, optimizer = build(*combo, seed=0)
            # under torchrun Accelerate is MULTI_CPU even with one process: DDP over 1 to 3 ranks
            assert isinstance(model, nn.parallel.DistributedDataParallel), type(model)
            train(accelerator, model, optimizer, case["model"])
            saved[combo] = f"{root}/{case['model']}-{case['optimizer']}"
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                statekit.save_state(accelerator, saved[combo])
            assert not caught, [str(w.message) for w in caught]
            if case["model"] == "mlp":  # this rank's own running mean when it saved (rank 0's was saved)
                running_means[case["optimizer"]] = accelerator.unwrap_model(model).norm.running_mean.tolist()
        accelerator, model, optimizer = build(*combo, seed=1)
        rank, world = accelerator.process_index, accelerator.num_processes
        injector.case, injector.applied = case, False
        verdicts.clear()
        error = None
        manifest = None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                manifest = statekit.load_state(accelerator, saved[combo], strict_resume=case["strict"])
            except statekit.StateMismatchError as exc:
                error = {"type": type(exc).__name__, "message": str(exc), "mismatched": sorted(exc.mismatched)}
        injector.case = None
        (verdict,) = verdicts
        if manifest is None:
            manifest = statekit.format.manifest.read_manifest(statekit.storage.Storage(saved[combo]))
        results[case["id"]] = {
            "applied": injector.applied,
            "verdict": verdict.verdict,
            "compared": verdict.compared,
            "recorded": sum(len(v) for v in manifest.state_digest.objects.values()),
            "differences": verdict.differences,
            "mismatched": sorted(verdict.mismatched),
            "deliberate": [list(d) for d in verdict.deliberate],
            "warnings": [{"category": w.category.__name__, "message": str(w.message)} for w in caught],
            "error": error,
        }
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump({"rank": rank, "world_size": world, "seconds": time.perf_counter() - started,
                   "running_means": running_means, "cases": results}, f)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    # outputs written, every rank past the barrier: skip interpreter finalization, as
    # ddp_resume.py does (gloo threads freed out of order can abort a finished process)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:4])
