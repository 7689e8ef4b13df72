"""What the kill-and-resume demos check and print: the final states compared tensor by
tensor, the per-step losses of both runs compared, and the report (shared by
``resume_demo.py`` and ``ddpm_demo.py``; :mod:`_demo_harness` runs the three runs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import statekit
from statekit.format.manifest import read_manifest
from statekit.storage import Storage


# --------------------------------------------------------------------------- comparison


def open_final(url: str) -> tuple[statekit.Checkpoint, statekit.plugin_api.Manifest]:
    """A final state written by a demo's ``train``, opened for reading, and its manifest."""
    storage = Storage(url)
    manifest = read_manifest(storage)
    return statekit.Checkpoint(storage, mode="load", manifest=manifest), manifest


def tensor_differences(ref: dict[str, torch.Tensor], res: dict[str, torch.Tensor], what: str = "weight") -> list[str]:
    """One line per tensor of ``ref`` that is not bit-identical in ``res``."""
    return [f"{what} {key} differs (max abs diff {(t - res[key]).abs().max().item():.3g})"
            for key, t in ref.items() if not torch.equal(t, res[key])]


def optimizer_differences(ref: dict, res: dict) -> list[str]:
    """The differences between two optimizer state dicts (per-parameter state, param_groups)."""
    problems = []
    for index, state in ref["state"].items():
        for name, value in state.items():
            if not torch.equal(torch.as_tensor(value), torch.as_tensor(res["state"][index][name])):
                problems.append(f"optimizer state {index}.{name} differs")
    if ref["param_groups"] != res["param_groups"]:
        problems.append("optimizer param_groups differ")
    return problems


# --------------------------------------------------------------------------- the report


@dataclass
class Analysis:
    """What the two runs' logs say (:func:`analyse`); ``problems`` lists the loss differences."""

    ref_losses: dict[int, float]
    resumed_step: int
    killed_after: int
    load_seconds: float
    saves: list[dict]
    done: dict
    problems: list[str]

    @property
    def resumed(self) -> str:
        return f"{self.resumed_step} (killed after step {self.killed_after})"

    @property
    def written(self) -> str:
        return f"{len(self.saves)}, {self.saves[-1]['bytes'] if self.saves else 0:,} bytes each"

    @property
    def save_seconds(self) -> str | None:
        if not self.saves:
            return None
        return f"median {sorted(r['seconds'] for r in self.saves)[len(self.saves) // 2]:.4f}"


def analyse(ref_events: list[dict], run_events: list[dict]) -> Analysis:
    """Compare every step's loss of the killed-and-resumed run with the reference, and the
    steps the resumed run replayed (after the checkpoint, before the kill) with the killed run."""
    ref_losses = {r["step"]: r["loss"] for r in ref_events if r["event"] == "step"}
    resume_event = [r for r in run_events if r["event"] == "resume"][-1]
    resumed_step = resume_event["step"]
    first_run = run_events[: run_events.index(resume_event)]
    second_run = run_events[run_events.index(resume_event) :]
    history = {r["step"]: r["loss"] for r in first_run if r["event"] == "step" and r["step"] <= resumed_step}
    history.update({r["step"]: r["loss"] for r in second_run if r["event"] == "step"})
    replayed = {r["step"]: r["loss"] for r in first_run if r["event"] == "step" and r["step"] > resumed_step}
    problems = [f"loss at step {s} differs: {history.get(s)!r} vs reference {l!r}"
                for s, l in ref_losses.items() if history.get(s) != l]
    problems += [f"replayed step {s} differs from the killed run" for s, l in replayed.items() if history.get(s) != l]
    return Analysis(
        ref_losses=ref_losses,
        resumed_step=resumed_step,
        killed_after=max(replayed) if replayed else resumed_step,
        load_seconds=resume_event["seconds"],
        saves=[r for r in run_events if r["event"] == "save"],
        done=[r for r in run_events if r["event"] == "done"][-1],
        problems=problems,
    )


def print_report(title: str, rows: list[tuple[str, str | None]], problems: list[str], exact: list[str]) -> int:
    """Print the report: a title, one ``label  value`` line per row (an empty line for a
    None value), then the first 20 problems, or ``resume exact  yes: <exact>``.
    Returns the exit code: 1 with problems, else 0."""
    print()
    print(title)
    for label, value in rows:
        print("" if value is None else _row(label, value))
    if problems:
        print(f"  RESUME NOT EXACT: {len(problems)} differences")
        for p in problems[:20]:
            print(f"    - {p}")
        return 1
    print(_row("resume exact", f"yes: {exact[0]}"))
    for line in exact[1:]:
        print(_row("", line))
    return 0


def _row(label: str, value: str) -> str:
    return f"  {label:<21}{value}"
