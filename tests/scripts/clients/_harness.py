"""What the test harness adds to each client script, and nothing else of the training.

Every reproduction under ``tests/scripts/clients/`` imports this module for the same four
additions, which the tests read; the training code itself is in each script.

- ``--statekit {off,init,prepare}``: where the one documented change goes
  (docs/migrating.md, attach mode): ``off`` runs the script as upstream wrote it (statekit is
  not even imported), ``init`` calls ``statekit.attach(accelerator)`` right after
  ``Accelerator(...)``, ``prepare`` right after the script's ``accelerator.prepare(...)``;
- ``--stop_after_steps N``: once optimizer step N is done (its checkpoint included, its loss
  logged), the process SIGKILLs itself: the interruption, with nothing flushed by Python;
- ``harness_log.jsonl`` in the output dir, appended and flushed line by line (so a killed run
  keeps what it logged): one ``start`` record per process, one ``resumed`` record when the
  script loads a checkpoint, one ``loss`` record per micro-batch (``step``: the optimizer step
  the micro-batch belongs to; ``loss``: the float the script logs, exactly), and one
  ``warning`` record for every warning the process issued (category with its module, message);
- ``final_state.safetensors`` + ``final_state.json``: every tensor the run ends with (the
  trained models' state dicts, EMA shadow parameters, the optimizer's state) and its counters.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import warnings
from typing import Any

PLACEMENTS = ("off", "init", "prepare")


def add_arguments(parser: Any, placements: tuple[str, ...] = PLACEMENTS) -> None:
    group = parser.add_argument_group("statekit test harness")
    group.add_argument("--statekit", choices=placements, default="off",
                       help="where statekit.attach(accelerator) goes (off: not at all)")
    group.add_argument("--stop_after_steps", type=int, default=None,
                       help="SIGKILL this process once optimizer step N (and its checkpoint) is done")


class Harness:
    """One per process: the log file, the kill switch and the attach placement."""

    def __init__(self, output_dir: str, args: Any) -> None:
        self.output_dir = output_dir
        self.args = args
        os.makedirs(output_dir, exist_ok=True)
        self._log = open(os.path.join(output_dir, "harness_log.jsonl"), "a", encoding="utf-8")
        self._record({"event": "start", "argv": sys.argv[1:], "statekit": getattr(args, "statekit", "off"),
                      "pid": os.getpid()})
        self._record_warnings()

    def _record(self, record: dict[str, Any]) -> None:
        if self._log.closed:
            return
        self._log.write(json.dumps(record) + "\n")
        self._log.flush()

    def _record_warnings(self) -> None:
        """Every warning is recorded (once per call site and message: the ``default`` action for
        every category, so none is hidden by an ``ignore`` filter) and still shown."""
        shown = warnings.showwarning

        def showwarning(message, category, filename, lineno, file=None, line=None):
            self._record({"event": "warning", "category": f"{category.__module__}.{category.__qualname__}",
                          "bases": [f"{c.__module__}.{c.__qualname__}" for c in category.__mro__],
                          "message": str(message), "where": f"{filename}:{lineno}"})
            shown(message, category, filename, lineno, file, line)

        warnings.showwarning = showwarning
        warnings.simplefilter("default")

    def attach(self, accelerator: Any, where: str) -> None:
        """``statekit.attach(accelerator)`` when ``--statekit`` names this place."""
        if self.args.statekit == where:
            import statekit

            statekit.attach(accelerator)
            self._record({"event": "attached", "where": where})

    def resumed(self, path: str, global_step: int) -> None:
        self._record({"event": "resumed", "path": os.path.basename(os.path.normpath(path)), "global_step": global_step})

    def loss(self, step: int, loss: float, **extra: Any) -> None:
        self._record({"event": "loss", "step": int(step), "loss": float(loss), **extra})

    def step_done(self, global_step: int) -> None:
        """Call once per optimizer step, after its checkpoint and its log: the kill switch."""
        if self.args.stop_after_steps is not None and global_step == self.args.stop_after_steps:
            self._record({"event": "killed", "global_step": global_step})
            os.kill(os.getpid(), signal.SIGKILL)

    def final(self, tensors: dict[str, Any], counters: dict[str, Any]) -> None:
        """Write ``final_state.safetensors`` (every tensor, contiguous CPU copies) and its counters."""
        import torch
        from safetensors.torch import save_file

        table = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items() if isinstance(v, torch.Tensor)}
        save_file(table, os.path.join(self.output_dir, "final_state.safetensors"))
        with open(os.path.join(self.output_dir, "final_state.json"), "w", encoding="utf-8") as f:
            json.dump(counters, f, indent=1, sort_keys=True, default=str)
        self._record({"event": "final", "tensors": len(table)})
        self._log.close()


def optimizer_tensors(optimizer: Any, prefix: str = "optimizer") -> dict[str, Any]:
    """The optimizer's per-parameter state as named tensors (``optimizer.<i>.<name>``)."""
    import torch

    inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's AcceleratedOptimizer
    out = {}
    for i, state in inner.state_dict()["state"].items():
        for name, value in state.items():
            out[f"{prefix}.{i}.{name}"] = value if isinstance(value, torch.Tensor) else torch.tensor(value)
    return out


def module_tensors(module: Any, prefix: str) -> dict[str, Any]:
    return {f"{prefix}.{k}": v for k, v in module.state_dict().items()}
