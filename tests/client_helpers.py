"""Running the client scripts of ``tests/scripts/clients/`` and reading what they leave.

A :class:`Zygote` (``scripts/clients/zygote.py``) imports the scripts' libraries once and forks
one process per run; :class:`Runs` caches the runs of a test module by name, so several tests
share one reference run; :class:`Run` reads a run's ``harness_log.jsonl`` (see
``scripts/clients/_harness.py``), its ``final_state.safetensors`` and its checkpoints.

The exactness verdicts the tests assert and docs/migrating.md records come from
:func:`compare`: every tensor of the final state with ``torch.equal``, every per-step loss with
``==`` on the logged float.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from repo_paths import SCRIPTS

CLIENTS = SCRIPTS / "clients"

OFFLINE = {
    "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
    "DISABLE_TELEMETRY": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
    "WANDB_DISABLED": "true", "DIFFUSERS_VERBOSITY": "error", "TRANSFORMERS_VERBOSITY": "error",
}


class Zygote:
    """One ``zygote.py`` process; :meth:`run` forks a script run from it and waits for it."""

    def __init__(self, home: Path) -> None:
        home.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **OFFLINE, "HF_HOME": str(home / "hf"), "PYTHONHASHSEED": "0"}
        env.pop("PYTEST_XDIST_WORKER", None)
        self.proc = subprocess.Popen(
            [sys.executable, str(CLIENTS / "zygote.py")], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=open(home / "zygote.err", "ab"), text=True, cwd=home, env=env,
        )
        ready = self.proc.stdout.readline()
        if not ready:
            raise RuntimeError(f"zygote.py did not start: {(home / 'zygote.err').read_text()[-3000:]}")

    def run(self, script: str, argv: list[str], log: Path) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps({"script": str(CLIENTS / script), "argv": argv, "log": str(log)}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("zygote.py died")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@dataclass
class Process:
    """One process of a run: its ``start`` record and what it logged after it."""

    statekit: str
    records: list[dict[str, Any]] = field(default_factory=list)

    @property
    def resumed(self) -> dict[str, Any] | None:
        return next((r for r in self.records if r["event"] == "resumed"), None)

    @property
    def losses(self) -> list[tuple[int, float]]:
        return [(r["step"], r["loss"]) for r in self.records if r["event"] == "loss" and "kind" not in r]

    @property
    def evals(self) -> dict[int, float]:
        """Evaluation losses by epoch (``kind: eval`` records)."""
        return {r["epoch"]: r["loss"] for r in self.records if r["event"] == "loss" and r.get("kind") == "eval"}

    @property
    def killed(self) -> bool:
        return any(r["event"] == "killed" for r in self.records)


@dataclass
class Run:
    """A run's output directory, as one or more processes left it."""

    name: str
    output_dir: Path
    results: list[dict[str, Any]]  # the zygote's answers, one per process
    log: Path

    @property
    def processes(self) -> list[Process]:
        processes: list[Process] = []
        path = self.output_dir / "harness_log.jsonl"
        for line in path.read_text(encoding="utf-8").splitlines() if path.exists() else []:
            record = json.loads(line)
            if record["event"] == "start":
                processes.append(Process(record["statekit"]))
            elif processes:
                processes[-1].records.append(record)
        return processes

    def output(self, tail: int = 6000) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")[-tail:] if self.log.exists() else ""

    def describe(self) -> str:
        return f"{self.name}: {self.results}\n--- output (tail) ---\n{self.output()}"

    @property
    def ok(self) -> bool:
        return self.results[-1].get("returncode") == 0

    def losses(self) -> dict[int, list[float]]:
        """Loss of every micro-batch by optimizer step, the run's processes chained as a resume
        chains them: a process that resumed from step ``s`` replaces what earlier processes
        logged for the steps after ``s``."""
        by_step: dict[int, list[float]] = {}
        for process in self.processes:
            resumed = process.resumed
            if resumed is not None:
                by_step = {s: v for s, v in by_step.items() if s <= resumed["global_step"]}
            fresh: dict[int, list[float]] = {}
            for step, loss in process.losses:
                fresh.setdefault(step, []).append(loss)
            by_step.update(fresh)
        return dict(sorted(by_step.items()))

    def evals(self) -> dict[int, float]:
        """Evaluation loss by epoch, a later process's replacing an earlier one's."""
        merged: dict[int, float] = {}
        for process in self.processes:
            merged.update(process.evals)
        return merged

    def warnings(self, of: str = "StatekitWarning") -> list[str]:
        """``category: message`` of each warning of a statekit class named ``of`` (or a subclass)
        any process issued (statekit's classes show as ``statekit.<Name>``)."""
        return [f"{r['category']}: {r['message']}" for p in self.processes for r in p.records
                if r["event"] == "warning"
                and any(b.startswith("statekit") and b.rsplit(".", 1)[-1] == of for b in r["bases"])]

    def final(self) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        return load_file(str(self.output_dir / "final_state.safetensors"))

    def counters(self) -> dict[str, Any]:
        return json.loads((self.output_dir / "final_state.json").read_text(encoding="utf-8"))

    def checkpoints(self, prefix: str = "checkpoint") -> list[str]:
        return sorted((d.name for d in self.output_dir.iterdir() if d.is_dir() and d.name.startswith(prefix)),
                      key=lambda d: int(d.replace("_", "-").split("-")[-1]))


@dataclass
class Verdict:
    """What a resumed run's result is against the uninterrupted one's."""

    differing_tensors: list[str]
    tensors: int
    differing_steps: list[int]
    missing_steps: list[int]
    extra_steps: list[int]

    @property
    def exact(self) -> bool:
        return not (self.differing_tensors or self.differing_steps or self.missing_steps or self.extra_steps)

    def summary(self) -> str:
        if self.exact:
            return f"exact: all {self.tensors} tensors and every per-step loss equal"
        parts = [f"{len(self.differing_tensors)} of {self.tensors} tensors differ"]
        if self.differing_steps:
            parts.append(f"losses differ from step {self.differing_steps[0]} on ({len(self.differing_steps)} steps)")
        if self.missing_steps:
            parts.append(f"steps {self.missing_steps} never trained")
        if self.extra_steps:
            parts.append(f"steps {self.extra_steps} not in the reference")
        return "; ".join(parts)


def compare(reference: Run, resumed: Run, from_step: int = 0) -> Verdict:
    ref_final, got_final = reference.final(), resumed.final() if (resumed.output_dir / "final_state.safetensors").exists() else {}
    differing = sorted(k for k in ref_final if k not in got_final or not (
        got_final[k].dtype == ref_final[k].dtype and got_final[k].shape == ref_final[k].shape
        and torch.equal(got_final[k], ref_final[k])))
    differing += sorted(k for k in got_final if k not in ref_final)
    ref_losses, got_losses = reference.losses(), resumed.losses()
    steps = [s for s in ref_losses if s > from_step]
    return Verdict(
        differing_tensors=differing, tensors=len(ref_final),
        differing_steps=[s for s in steps if s in got_losses and got_losses[s] != ref_losses[s]],
        missing_steps=[s for s in steps if s not in got_losses],
        extra_steps=[s for s in got_losses if s not in ref_losses],
    )


class Runs:
    """The runs of one test module, each made once on first use (by name)."""

    def __init__(self, root: Path, zygote: Zygote) -> None:
        self.root, self.zygote = root, zygote
        self.cache: dict[str, Run] = {}
        self.seconds: dict[str, float] = {}

    def run(self, name: str, script: str, argv: list[str], *, output_dir: Path | None = None) -> Run:
        """One process of ``script``; ``output_dir`` is passed as ``--output_dir`` (a fresh
        folder named after the run unless given)."""
        if name in self.cache:
            return self.cache[name]
        output_dir = output_dir or self.root / name
        log = self.root / f"{name}.log"
        result = self.zygote.run(script, ["--output_dir", str(output_dir), *argv], log)
        self.seconds[name] = result["seconds"]
        self.cache[name] = Run(name, output_dir, [result], log)
        return self.cache[name]

    def resume(self, name: str, interrupted: Run, script: str, argv: list[str]) -> Run:
        """One more process in the interrupted run's folder, as a user restarts a run."""
        if name in self.cache:
            return self.cache[name]
        log = self.root / f"{name}.log"
        result = self.zygote.run(script, ["--output_dir", str(interrupted.output_dir), *argv], log)
        self.seconds[name] = result["seconds"]
        self.cache[name] = Run(name, interrupted.output_dir, [*interrupted.results, result], log)
        return self.cache[name]


def killed(run: Run) -> bool:
    return run.results[-1].get("signal") == signal.SIGKILL


def timestamp() -> float:
    return time.perf_counter()


@dataclass(frozen=True)
class Case:
    """One client script in one configuration, and what the tests expect of it.

    ``argv(assets)`` gives the script's flags (without ``--output_dir``); a whole run trains
    ``steps`` steps (the harness's step: the optimizer step, or the micro-batch where the script
    counts those); the interrupted run is SIGKILLed once step ``stop_after`` is done and its
    resume must load the checkpoint of step ``resumed_from``, found with ``--resume_from_checkpoint
    latest`` (``latest=True``) or named by path (scripts without ``latest``). ``own_resume`` is the
    recorded outcome of the script's own resume without statekit (:meth:`Verdict.summary`).
    ``checkpoints`` is the folder prefix; ``placements`` the ``--statekit`` values that attach."""

    name: str
    script: str
    argv: Any
    steps: int
    stop_after: int
    resumed_from: int
    own_resume: str
    checkpoints: str = "checkpoint-"
    latest: bool = True
    placements: tuple[str, ...] = ("init", "prepare")

    def resume_arg(self, run: Run) -> str:
        if self.latest:
            return "latest"
        return str(run.output_dir / run.checkpoints(self.checkpoints)[-1])


class ClientRuns(Runs):
    """:class:`Runs` that know the cases: the reference, the attached and the interrupted runs."""

    def __init__(self, root: Path, zygote: Zygote, assets: Path) -> None:
        super().__init__(root, zygote)
        self.assets = assets

    def reference(self, case: Case) -> Run:
        return self.run(f"{case.name}-off", case.script, case.argv(self.assets))

    def attached(self, case: Case, placement: str) -> Run:
        return self.run(f"{case.name}-{placement}", case.script, [*case.argv(self.assets), "--statekit", placement])

    def resumed(self, case: Case, placement: str) -> tuple[Run, Run]:
        """The run killed after step ``stop_after``, and the same folder after its resume."""
        argv = [*case.argv(self.assets), "--statekit", placement]
        interrupted = self.run(f"{case.name}-{placement}-killed", case.script,
                               [*argv, "--stop_after_steps", str(case.stop_after)])
        if not killed(interrupted):
            return interrupted, interrupted
        return interrupted, self.resume(f"{case.name}-{placement}-resumed", interrupted, case.script,
                                        [*argv, "--resume_from_checkpoint", case.resume_arg(interrupted)])


def step_of(name: str) -> int:
    return int(name.replace("_", "-").split("-")[-1])


class ScriptChecks:
    """The checks every client script gets; a family's test class sets ``CASES`` (by name) and
    ``ASSETS`` (the ``make_assets.py --what`` list). ``case`` and ``placement`` are parametrized
    by ``tests/integration/clients/conftest.py``; ``runs`` is its class-scoped :class:`ClientRuns`."""

    CASES: dict[str, Case] = {}
    ASSETS = ""

    def test_runs_uninterrupted(self, runs, case):
        """The script as upstream wrote it trains every step and writes its final state."""
        run = runs.reference(case)
        assert run.ok, run.describe()
        assert list(run.losses()) == list(range(1, case.steps + 1)), run.describe()

    def test_attached_run_changes_nothing(self, runs, case):
        """With statekit attached (the first placement), an uninterrupted run is the
        reference bit for bit, warns nothing, and every checkpoint it left is committed and
        verifies, its manifest naming the step of its folder."""
        placement = case.placements[0]
        run, reference = runs.attached(case, placement), runs.reference(case)
        assert run.ok, run.describe()
        verdict = compare(reference, run)
        assert verdict.exact, f"{verdict.summary()}: {verdict.differing_tensors[:8]}"
        assert run.warnings() == []
        import statekit

        folders = run.checkpoints(case.checkpoints)
        assert folders, run.describe()
        for name in folders:
            manifest = statekit.verify(str(run.output_dir / name))
            assert manifest.step == step_of(name), (name, manifest.step)

    def test_resume_with_statekit_is_exact(self, runs, case, placement):
        """Killed (SIGKILL) after step ``stop_after``, resumed with the script's own
        ``--resume_from_checkpoint``: every per-step loss and every tensor of the final state
        equal the uninterrupted run's, and no statekit warning is issued."""
        interrupted, resumed = runs.resumed(case, placement)
        assert killed(interrupted), interrupted.describe()
        assert resumed.ok, resumed.describe()
        process = resumed.processes[-1]
        assert process.resumed is not None and process.resumed["global_step"] == case.resumed_from, resumed.describe()
        verdict = compare(runs.reference(case), resumed, case.resumed_from)
        assert verdict.exact, f"{verdict.summary()}: {verdict.differing_tensors[:8]}"
        assert resumed.evals() == runs.reference(case).evals()
        assert resumed.warnings() == []

    def test_own_resume_without_statekit(self, runs, case):
        """The script's own resume, without statekit: the recorded outcome (docs/migrating.md)."""
        interrupted, resumed = runs.resumed(case, "off")
        assert killed(interrupted), interrupted.describe()
        assert resumed.ok, resumed.describe()
        assert resumed.processes[-1].resumed["global_step"] == case.resumed_from
        verdict = compare(runs.reference(case), resumed, case.resumed_from)
        assert verdict.summary() == case.own_resume
