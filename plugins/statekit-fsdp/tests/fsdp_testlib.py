"""Helpers of the statekit-fsdp tests: the torchrun launcher and full-state comparison."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

WORKER = Path(__file__).with_name("fsdp_worker.py")
"""The torchrun worker script."""

TORCHRUN_TIMEOUT_S = 300
"""Wall-clock limit of one torchrun launch (the machine may be shared and slow)."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess:
    """Run ``fsdp_worker.py ARGS`` under ``python -m torch.distributed.run`` with ``nproc``
    CPU processes (gloo) on a free port; fail the test with the output on a non-zero exit.

    The environment (``AWS_ENDPOINT_URL`` and credentials of the moto server included)
    is passed on to the processes.
    """
    env = dict(os.environ, OMP_NUM_THREADS="1", FSDP_WORKER_TIMEOUT_S=str(TORCHRUN_TIMEOUT_S - 30))
    env.pop("STATEKIT_DISABLE_PLUGIN_AUTOLOAD", None)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={_free_port()}",
        str(WORKER),
        *args,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TORCHRUN_TIMEOUT_S, env=env)
    if proc.returncode != 0:
        pytest.fail(
            f"torchrun --nproc_per_node={nproc} {' '.join(args)} exited with {proc.returncode}\n"
            f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-12000:]}"
        )
    return proc


def load_full(path: str | Path) -> tuple[dict[str, Any], list[Any]]:
    """Read a full-state dump of the worker: ``(tensors, param_groups)``."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
        groups = json.loads((f.metadata() or {}).get("param_groups", "[]"))
    return tensors, groups


def assert_full_equal(expected: str | Path | dict, actual: str | Path | dict, *, model_only: bool = False) -> None:
    """Assert two full states (dump paths or tensor dicts) hold identical tensors."""
    import torch

    a = load_full(expected)[0] if not isinstance(expected, dict) else expected
    b = load_full(actual)[0] if not isinstance(actual, dict) else actual
    if model_only:
        a = {k: v for k, v in a.items() if k.startswith("model.")}
        b = {k: v for k, v in b.items() if k.startswith("model.")}
    assert sorted(a) == sorted(b)
    different = [k for k in a if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape or not torch.equal(a[k], b[k])]
    assert not different, f"tensors differ: {different}"


def capturing_verdicts() -> tuple[list[Any], Any]:
    """Record the verdict of every state check from now on: ``(verdicts, undo)``, the list
    filled with each :class:`statekit.checks.state_check.StateVerdict` (``undo()`` ends it)."""
    from statekit.checks import state_check

    verdicts: list[Any] = []
    original = state_check.check

    def check(*args: Any, **kwargs: Any) -> Any:
        verdicts.append(original(*args, **kwargs))
        return verdicts[-1]

    state_check.check = check

    def undo() -> None:
        state_check.check = original

    return verdicts, undo


def verdict_json(verdict: Any) -> dict[str, Any]:
    """A verdict as JSON (what the worker writes with ``--verdicts``)."""
    return {"verdict": verdict.verdict, "compared": verdict.compared, "differences": verdict.differences,
            "deliberate": [list(d) for d in verdict.deliberate]}


def read_verdicts(path: str | Path, nproc: int) -> list[dict[str, Any]]:
    """Every rank's state-check verdicts of one ``--verdicts`` worker run, by rank:
    ``[{"verdicts": [...], "warnings": [...]}, ...]``."""
    return [json.loads(Path(f"{path}.rank{r}.json").read_text()) for r in range(nproc)]


def fault_after_load(model: Any, optim: Any) -> Any:
    """Make the plugin's load path faulty (``set_state_dict``, as the plugin calls it): after
    it installed the state, the last rank zeroes a row of its shard of ``hidden.weight``
    and every rank zeroes its shard of the ``exp_avg`` of ``out.weight``. Returns ``undo()``."""
    import torch
    import torch.distributed.checkpoint.state_dict as dcp_state

    original = dcp_state.set_state_dict

    def faulty(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        import torch.distributed as dist

        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        with torch.no_grad():
            weight = model.hidden.weight
            local = weight.to_local() if hasattr(weight, "to_local") else weight
            if rank == world - 1 and local.shape[0]:
                local[-1].zero_()
            moment = optim.state[model.out.weight]["exp_avg"]
            (moment.to_local() if hasattr(moment, "to_local") else moment).zero_()
        return result

    dcp_state.set_state_dict = faulty

    def undo() -> None:
        dcp_state.set_state_dict = original

    return undo
