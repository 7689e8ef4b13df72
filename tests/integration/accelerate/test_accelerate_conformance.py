"""Accelerate conformance: Accelerate's *own* checkpoint tests, run against statekit.

At test time the sdist of the *installed* Accelerate version is fetched with pip
(``pip download --no-deps --no-binary :all: accelerate==<version>``) and cached under
``$STATEKIT_CONFORMANCE_CACHE`` (default ``$XDG_CACHE_HOME/statekit-conformance`` or
``~/.cache/statekit-conformance``); no Accelerate code is kept in this repository. From it
``tests/test_state_checkpointing.py`` and ``tests/test_accelerator.py`` (plus any helper
module of the sdist's ``tests/`` they import) are extracted into a temporary directory,
and these tests are selected:

* every test of ``test_state_checkpointing.py``;
* from ``test_accelerator.py``: ``test_save_load_model*`` (``*_with_hooks*`` included),
  ``test_save_model_with_stateful_dataloader*`` (16 cases), and any test whose name
  mentions ``save_state``, ``load_state``, ``hook`` or ``checkpoint``.

They run four times, each a ``pytest`` subprocess (``--junitxml`` for the outcomes,
``-p no:cacheprovider``, plugin autoloading off, so neither the ``statekit.testing``
plugin nor this project's ``conftest.py`` is loaded; its own empty working directory and
``TMPDIR``, so stray files show):

* ``untouched`` (a): Accelerate alone, the baseline;
* ``attach_init`` (b): ``statekit.attach(accelerator)`` after every ``Accelerator.__init__``
  (``-p conformance.attach_init``);
* ``attach_prepare`` (c): ``statekit.attach(accelerator)`` after the first ``prepare()``
  (``-p conformance.attach_prepare``);
* ``dropin`` (d): ``save_state``/``load_state`` routed through statekit
  (``-p conformance.dropin``, see ``tests/conformance/dropin.py``).

Asserted: (a) passes (else this environment cannot judge statekit); (b) and (c) run the
same tests as (a), skip no more, and pass every test (a) passes, with statekit in the
path of every save and load; (d) likewise, except for :data:`DROPIN_ALLOWED_FAILURES`
(tests asserting Accelerate's own file names), each of which must fail with its listed
assertion; no mode leaves anything in its working directory. Failure messages list the
test IDs with the tail of their failure text.

Run it::

    .venv/bin/python -m pytest -m conformance -p no:cacheprovider -rA tests/integration/accelerate/test_accelerate_conformance.py

Environment: ``CI=true`` turns every reason to skip (no network for the download, no
``accelerate``/``parameterized``/``torchdata``) into a failure.
``STATEKIT_CONFORMANCE_OUT=<dir>`` keeps each mode's JUnit XML, log and a ``report.md``
there (default: pytest's temporary directory). ``STATEKIT_CONFORMANCE_TIMEOUT`` bounds
each subprocess (seconds, default 900). ``PYTHONPATH`` reaches the subprocesses, so a
statekit checkout placed first on it is the one tested.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.conformance]

from repo_paths import ROOT  # noqa: E402

TESTS_DIR = ROOT / "tests"

CI = os.environ.get("CI", "").strip().lower() in {"1", "true", "yes", "on"}
RUN_TIMEOUT_S = float(os.environ.get("STATEKIT_CONFORMANCE_TIMEOUT", "900"))
PARALLEL_RUNS = 2
"""The four modes run two at a time (each in its own directories): two cores busy instead of one."""
DOWNLOAD_TIMEOUT_S = 600.0

STATE_CHECKPOINTING = "tests/test_state_checkpointing.py"
ACCELERATOR = "tests/test_accelerator.py"
EXTRACTED = (STATE_CHECKPOINTING, ACCELERATOR)
ALWAYS_EXTRACTED_IF_PRESENT = ("tests/__init__.py", "tests/conftest.py")

ACCELERATOR_SELECTION = re.compile(
    r"^test_save_load_model|^test_save_model_with_stateful_dataloader|save_state|load_state|hook|checkpoint",
    re.IGNORECASE,
)
"""Which tests of ``test_accelerator.py`` run (matched on the test function's name)."""

REQUIRED_SELECTION = {
    ACCELERATOR + "::AcceleratorTester::test_save_load_model_use": 3,
    ACCELERATOR + "::AcceleratorTester::test_save_load_model_with_hooks_": 2,
    ACCELERATOR + "::AcceleratorTester::test_save_model_with_stateful_dataloader_": 16,
    STATE_CHECKPOINTING + "::CheckpointTest_": 16,
}
"""ID prefix -> how many selected tests must start with it (a renamed test in a new
Accelerate release must not silently drop out of the suite)."""


@dataclasses.dataclass(frozen=True)
class Mode:
    label: str
    description: str
    plugins: tuple[str, ...]


MODES: dict[str, Mode] = {
    "untouched": Mode("(a)", "Accelerate alone", ()),
    "attach_init": Mode("(b)", "statekit.attach() after every Accelerator.__init__", ("-p", "conformance.attach_init")),
    "attach_prepare": Mode("(c)", "statekit.attach() after the first prepare()", ("-p", "conformance.attach_prepare")),
    "dropin": Mode("(d)", "save_state/load_state routed through statekit", ("-p", "conformance.dropin")),
}


def _both_variants(test: str, expected: str) -> dict[str, str]:
    return {f"{STATE_CHECKPOINTING}::CheckpointTest_{v}::{test}": expected for v in ("use_safetensors", "use_pytorch")}


DROPIN_ALLOWED_FAILURES: dict[str, str] = {
    # In drop-in mode, automatic checkpoint naming goes through statekit.CheckpointManager
    # (docs/migrating.md), which names checkpoints <project_dir>/checkpoints/checkpoint-<step:08d>,
    # not Accelerate's checkpoint_<i>: tests that open or look for checkpoint_<i> by name fail.
    # test id -> a line the failure text must contain (the assertion or call that fails).
    **_both_variants("test_can_resume_training", 'accelerator.load_state(os.path.join(tmpdir, "checkpoints", "checkpoint_0"))'),
    **_both_variants("test_with_scheduler", 'accelerator.load_state(os.path.join(tmpdir, "checkpoints", "checkpoint_0"))'),
    **_both_variants(
        "test_can_resume_training_checkpoints_relative_path",
        'accelerator.load_state(os.path.join(tmpdir, "checkpoints", "checkpoint_1"))',
    ),
    **_both_variants("test_checkpoint_deletion", 'assert os.path.exists(os.path.join(tmpdir, "checkpoints", "checkpoint_9"))'),
}
"""Tests of mode (d) that may fail, each with the line its failure must show."""

ENGAGEMENT = {
    # mode -> (calls that must reach statekit, post-hook counter) per passed test
    "attach_init": (("accelerate_save_impl",), "statekit_save_post", ("accelerate_load_impl",), "statekit_load_post"),
    "attach_prepare": (("accelerate_save_impl",), "statekit_save_post", ("accelerate_load_impl",), "statekit_load_post"),
    "dropin": (
        ("dropin_save", "dropin_manager_save"),
        "statekit_save_post",
        ("dropin_load", "dropin_manager_resume"),
        "statekit_load_post",
    ),
}
"""Per mode: which counters (``tests/conformance/common.py``) count the saves and loads
that must each have gone through statekit, and the post-hook counter that proves it."""

TAIL_LINES = 12
SUMMARY_EXCEPTION_LINES = 6
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>.+)$')
_CARETS = re.compile(r"^\s*[\^~]+\s*$")
_STATEKIT_FILE = re.compile(r"/statekit/|/plugins/statekit-[^/]+/|/statekit_[a-z]+/")
_PLUGIN_FILE = re.compile(r"/plugins/statekit-[^/]+/|/statekit_[a-z]+/")


def _short_path(path: str) -> str:
    for marker in ("/accelerate-tests/", str(ROOT) + "/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


# --------------------------------------------------------------------------- results


@dataclasses.dataclass
class Outcome:
    """One test case of a JUnit XML file."""

    status: str  # passed, failed, error, skipped
    message: str = ""
    text: str = ""
    props: dict[str, int] = dataclasses.field(default_factory=dict)

    def tail(self, lines: int = TAIL_LINES) -> str:
        body = [line for line in (self.text or self.message).rstrip().splitlines() if not _CARETS.match(line)]
        return "\n".join("        " + line for line in body[-lines:])

    def summary(self) -> str:
        """The failing line of the Accelerate test, the outermost and innermost statekit
        frames, and the exception (from the ``--tb=native`` traceback); else :meth:`tail`."""
        lines = [line for line in (self.text or self.message).rstrip().splitlines() if not _CARETS.match(line)]
        frames = [(i, m) for i, line in enumerate(lines) if (m := _FRAME.match(line))]
        if not frames:
            return self.tail()

        def code(i: int) -> str:
            return lines[i + 1].strip() if i + 1 < len(lines) and not _FRAME.match(lines[i + 1]) else ""

        picked = [f for f in frames if "/accelerate-tests/" in f[1]["file"]][-1:]
        ours = [f for f in frames if _STATEKIT_FILE.search(f[1]["file"])]
        plugins = [f for f in ours if _PLUGIN_FILE.search(f[1]["file"])]
        for frame in ours[:1] + plugins[-2:] + ours[-1:]:  # outermost, plugins, innermost
            if frame not in picked:
                picked.append(frame)
        out = [f"{_short_path(m['file'])}:{m['line']} in {m['func']}: {code(i)}" for i, m in picked]
        last = frames[-1][0]
        start = last + (2 if code(last) else 1)
        out += [line.strip() for line in lines[start:]][:SUMMARY_EXCEPTION_LINES]
        return "\n".join("        " + (line if len(line) <= 300 else line[:300] + "...") for line in out)


@dataclasses.dataclass
class ModeResult:
    """What one pytest subprocess did."""

    mode: str
    returncode: int
    duration_s: float
    outcomes: dict[str, Outcome]
    strays: list[str]
    tmp_leftovers: list[str]
    cwd: Path
    log: Path
    junit: Path

    def ids(self, *statuses: str) -> list[str]:
        return sorted(i for i, o in self.outcomes.items() if not statuses or o.status in statuses)

    def counts(self) -> dict[str, int]:
        result = {s: 0 for s in ("passed", "failed", "error", "skipped")}
        for o in self.outcomes.values():
            result[o.status] += 1
        return result

    def describe(self, ids: list[str]) -> str:
        return "\n".join(
            f"  {i} [{self.outcomes[i].status}]\n{self.outcomes[i].summary()}" if i in self.outcomes else f"  {i} [not run]"
            for i in ids
        )

    def log_tail(self, chars: int = 4000) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else "(no log)"
        return text[-chars:]


def _mangle(nodeid: str) -> tuple[str, str]:
    """(classname, name) of a node ID as pytest's junitxml writes them."""
    parts = nodeid.split("::")
    parts[0] = parts[0].replace("/", ".").removesuffix(".py")
    return ".".join(parts[:-1]), parts[-1]


def parse_junit(path: Path, selected: list[str]) -> dict[str, Outcome]:
    by_address = {_mangle(n): n for n in selected}
    outcomes: dict[str, Outcome] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        address = (case.get("classname", ""), case.get("name", ""))
        nodeid = by_address.get(address, "::".join(a for a in address if a))
        props = {}
        for prop in case.iter("property"):
            name = prop.get("name", "")
            if name.startswith("statekit."):
                props[name.removeprefix("statekit.")] = int(prop.get("value", "0"))
        status, message, text = "passed", "", ""
        for tag in ("failure", "error", "skipped"):  # a failed call with a teardown error: "failed"
            node = case.find(tag)
            if node is not None:
                status = {"failure": "failed"}.get(tag, tag)
                message, text = node.get("message", ""), node.text or ""
                break
        outcomes[nodeid] = Outcome(status, message, text, props)
    return outcomes


# --------------------------------------------------------------------------- fetching


def _unavailable(reason: str) -> None:
    if CI:
        pytest.fail(f"{reason}\n(CI=true: the Accelerate conformance suite must run, not skip)", pytrace=False)
    pytest.skip(reason)


def cache_dir() -> Path:
    configured = os.environ.get("STATEKIT_CONFORMANCE_CACHE")
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "statekit-conformance"


def _sdist_ok(path: Path) -> bool:
    try:
        with tarfile.open(path) as tf:
            names = tf.getnames()
    except (OSError, tarfile.TarError, EOFError):
        return False
    return all(any(n.endswith("/" + wanted) for n in names) for wanted in EXTRACTED)


def fetch_sdist(version: str) -> Path:
    """The cached sdist of ``accelerate==version``, downloaded with pip if not cached."""
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / f"accelerate-{version}.tar.gz"
    if _sdist_ok(target):
        return target
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
            f"accelerate=={version}", "-d", tmp, "--disable-pip-version-check", "--no-input",
        ]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
            output, rc = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as exc:
            output, rc = f"timed out after {DOWNLOAD_TIMEOUT_S:.0f} s: {exc}", -1
        found = sorted(Path(tmp).glob("accelerate-*.tar.gz"))
        if rc != 0 or len(found) != 1 or not _sdist_ok(found[0]):
            _unavailable(
                f"cannot download the sdist of accelerate=={version} (pip exit status {rc}, "
                f"files {[p.name for p in found]}): {' '.join(cmd)}\n{output[-3000:]}"
            )
        os.replace(found[0], target)
    return target


def _local_imports(source: bytes, members: set[str]) -> set[str]:
    """Files of the sdist's ``tests/`` that a test module imports (helper modules)."""
    needed: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            names = [base] + [f"{base}.{a.name}" if base else a.name for a in node.names]
        for name in names:
            path = name.replace(".", "/")
            for candidate in (f"tests/{path}.py", f"{path}.py", f"tests/{path}/__init__.py", f"{path}/__init__.py"):
                if candidate in members and candidate.startswith("tests/"):
                    if candidate.endswith("/__init__.py"):  # a package: all of it
                        prefix = candidate[: -len("__init__.py")]
                        needed |= {m for m in members if m.startswith(prefix)}
                    else:
                        needed.add(candidate)
    return needed


def extract_tests(sdist: Path, dest: Path) -> list[str]:
    """Write the selected test files (and what they import from ``tests/``) under ``dest``;
    returns the sdist-relative paths written."""
    with tarfile.open(sdist) as tf:
        files = {}
        for member in tf.getmembers():
            if member.isfile() and "/" in member.name:
                files[member.name.split("/", 1)[1]] = member
        members = set(files)
        queue = [*EXTRACTED, *(p for p in ALWAYS_EXTRACTED_IF_PRESENT if p in members)]
        written: list[str] = []
        while queue:
            rel = queue.pop()
            if rel in written:
                continue
            data = tf.extractfile(files[rel]).read()  # type: ignore[union-attr]
            out = dest / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(data)  # written by us: no path from the archive is trusted
            written.append(rel)
            if rel.endswith(".py"):
                queue += sorted(_local_imports(data, members) - set(written))
    (dest / "pytest.ini").write_text("[pytest]\n# written by tests/integration/accelerate/test_accelerate_conformance.py\n")
    return sorted(written)


# --------------------------------------------------------------------------- running


def _env(tmpdir: Path) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        # Accelerate's settings would change the baseline; the outer pytest's must not leak
        if not k.startswith(("ACCELERATE_", "PYTEST_"))
    }
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # no statekit.testing, no stray third-party plugins
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS_DIR), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["TMPDIR"] = str(tmpdir)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def _pytest_command(root: Path, extra: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "pytest",
        "-p", "no:cacheprovider", "-p", "no:statekit.testing",
        "-c", str(root / "pytest.ini"), "--rootdir", str(root), "--confcutdir", str(root),
        "-q", "-rfEs", "--tb=native", "-W", "ignore::pytest.PytestUnknownMarkWarning",
        *extra,
    ]


def _run(cmd: list[str], cwd: Path, env: dict[str, str], log: Path, timeout: float) -> int:
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the run and its data loader workers
            proc.wait()
            out.write(f"\n[conformance harness: killed after {timeout:.0f} s]\n".encode())
            return -signal.SIGKILL


def _listing(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) + ("/" if p.is_dir() else "") for p in directory.rglob("*"))


class Conformance:
    """The fetched tests, the selection, and the four runs (each run once: all four when the
    fixture is built, two at a time)."""

    def __init__(
        self, root: Path, work: Path, short_tmp: Path, out: Path, accelerate_version: str, extracted: list[str]
    ) -> None:
        self.root, self.work, self.short_tmp, self.out = root, work, short_tmp, out
        self.accelerate_version = accelerate_version
        self.extracted = extracted
        self.results: dict[str, ModeResult] = {}
        self.selected = self._select()

    def _select(self) -> list[str]:
        work = self.work / "collect"
        (work / "cwd").mkdir(parents=True)
        tmp = self.short_tmp / "collect"
        tmp.mkdir()
        log = work / "collect.log"
        rc = _run(
            _pytest_command(self.root, ["--collect-only", *(str(self.root / f) for f in EXTRACTED)]),
            work / "cwd", _env(tmp), log, RUN_TIMEOUT_S,
        )
        text = log.read_text(errors="replace")
        if rc != 0:
            pytest.fail(f"collecting Accelerate's tests failed (exit status {rc}):\n{text[-4000:]}", pytrace=False)
        ids = [line.strip() for line in text.splitlines() if "::" in line and line.startswith("tests/")]
        selected = [
            i for i in ids
            if i.startswith(STATE_CHECKPOINTING + "::")
            or (i.startswith(ACCELERATOR + "::") and ACCELERATOR_SELECTION.search(i.rsplit("::", 1)[1]))
        ]
        short = {p: n for p, n in REQUIRED_SELECTION.items() if sum(i.startswith(p) for i in selected) < n}
        if short:
            pytest.fail(
                f"accelerate {self.accelerate_version}: the selection lacks tests (prefix: needed count): {short}\n"
                "selected:\n  " + "\n  ".join(selected),
                pytrace=False,
            )
        (self.out / "selected.txt").write_text("\n".join(selected) + "\n")
        return selected

    def _execute(self, mode: str) -> ModeResult:
        """One run of the selected tests in ``mode``, in its own working directory and TMPDIR
        (so runs of different modes can go on at the same time)."""
        work = self.work / mode
        cwd, tmp = work / "cwd", self.short_tmp / mode
        cwd.mkdir(parents=True)
        tmp.mkdir()
        junit, log = self.out / f"{mode}.junit.xml", self.out / f"{mode}.log"
        cmd = _pytest_command(
            self.root, [*MODES[mode].plugins, "--junitxml", str(junit), *(str(self.root / i) for i in self.selected)]
        )
        start = time.monotonic()
        rc = _run(cmd, cwd, _env(tmp), log, RUN_TIMEOUT_S)
        duration = time.monotonic() - start
        outcomes = parse_junit(junit, self.selected) if junit.exists() else {}
        return ModeResult(mode, rc, duration, outcomes, _listing(cwd), _listing(tmp), cwd, log, junit)

    def run_all(self, parallel: int) -> None:
        """Run every mode, ``parallel`` at a time (each run is a process of its own, mostly
        one core busy), before the tests read the results."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=parallel) as pool:
            for result in pool.map(self._execute, [m for m in MODES if m not in self.results]):
                self.results[result.mode] = result
        self._write_report()

    def run(self, mode: str) -> ModeResult:
        """The run of ``mode`` (made now unless :meth:`run_all` made it); a run that did not
        end with test results fails the test asking for it."""
        if mode not in self.results:
            self.results[mode] = self._execute(mode)
            self._write_report()
        result = self.results[mode]
        if result.returncode not in (0, 1) or not result.outcomes:
            pytest.fail(
                f"mode {MODES[mode].label} {mode}: pytest exited with status {result.returncode} and "
                f"{len(result.outcomes)} test results; its output ends with:\n{result.log_tail()}",
                pytrace=False,
            )
        return result

    def _write_report(self) -> None:
        lines = [f"# Accelerate {self.accelerate_version} conformance of statekit", ""]
        lines += [f"Selected {len(self.selected)} tests (selected.txt); extracted: {', '.join(self.extracted)}", ""]
        for mode, r in self.results.items():
            c = r.counts()
            lines += [
                f"## {MODES[mode].label} {mode}: {MODES[mode].description}",
                "",
                f"exit status {r.returncode}, {r.duration_s:.1f} s: {c['passed']} passed, {c['failed']} failed, "
                f"{c['skipped']} skipped, {c['error']} errors",
                f"stray files in the working directory: {r.strays or 'none'}",
                f"left in TMPDIR: {r.tmp_leftovers or 'none'}",
                "",
            ]
            for i in r.ids("failed", "error"):
                o = r.outcomes[i]
                lines += [f"* `{i}` [{o.status}]", "", "```", o.summary(), "", "(traceback tail)", o.tail(40), "```", ""]
        (self.out / "report.md").write_text("\n".join(lines))
        summary = {
            mode: {"returncode": r.returncode, "duration_s": round(r.duration_s, 1), "counts": r.counts(),
                   "outcomes": {i: o.status for i, o in sorted(r.outcomes.items())}, "strays": r.strays,
                   "tmp_leftovers": r.tmp_leftovers}
            for mode, r in self.results.items()
        }
        (self.out / "summary.json").write_text(json.dumps(summary, indent=1))


@pytest.fixture(scope="module")
def conformance(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Conformance]:
    for module, why in (
        ("accelerate", 'pip install "statekit[accelerate]"'),
        ("torchdata", "the 16 stateful data loader cases need it (statekit[accelerate])"),
        ("parameterized", "Accelerate's tests import it (statekit[test])"),
    ):
        if importlib.util.find_spec(module) is None:
            _unavailable(f"{module} is not installed: {why}")
    version = importlib.metadata.version("accelerate")
    sdist = fetch_sdist(version)
    work = tmp_path_factory.mktemp("accelerate-conformance")
    root = work / "accelerate-tests"
    extracted = extract_tests(sdist, root)
    out = Path(os.environ.get("STATEKIT_CONFORMANCE_OUT") or work / "out")
    out.mkdir(parents=True, exist_ok=True)
    # Each run's TMPDIR is short: the DataLoader workers (num_workers=4) pass tensors through a
    # Unix socket made in TMPDIR, whose path may not pass 107 bytes (sun_path). Under pytest's
    # tmp_path (longer still on an xdist worker: .../popen-gw0/...) the bind fails inside a
    # worker's queue feeder thread, the batch is dropped, and the run waits for it forever.
    with tempfile.TemporaryDirectory(prefix="skc-") as short_tmp:
        conformance = Conformance(root, work, Path(short_tmp), out, version, extracted)
        conformance.run_all(parallel=PARALLEL_RUNS)
        yield conformance


# --------------------------------------------------------------------------- checks


def _print_mode(r: ModeResult) -> None:
    c = r.counts()
    print(f"mode {MODES[r.mode].label} {r.mode}: {c} in {r.duration_s:.1f} s (JUnit XML: {r.junit})")
    for i in r.ids():
        print(f"  {r.outcomes[i].status:7} {i}")


def _engagement_problems(r: ModeResult, ids: list[str]) -> list[str]:
    """Passed tests in which a save or load did not go through statekit."""
    saves, save_post, loads, load_post = ENGAGEMENT[r.mode]
    problems = []
    for i in ids:
        props = r.outcomes[i].props
        if r.mode == "attach_prepare" and not props.get("attach_calls", 0):
            # the test never calls prepare() (accelerate 1.16's test_rng_state_restored): mode (c)
            # attaches after the first prepare, so nothing attaches; mode (b) covers the test
            continue
        n_save, n_load = sum(props.get(k, 0) for k in saves), sum(props.get(k, 0) for k in loads)
        if n_save != props.get(save_post, 0) or n_load != props.get(load_post, 0):
            problems.append(f"  {i}: {props}")
    return problems


def _compare_with_untouched(c: Conformance, mode: str, allowed: dict[str, str]) -> list[str]:
    base, r = c.run("untouched"), c.run(mode)
    label = f"mode {MODES[mode].label} {mode}"
    problems: list[str] = []
    if set(r.outcomes) != set(base.outcomes):
        problems.append(
            f"{label} ran other tests than (a): only in {mode}: {sorted(set(r.outcomes) - set(base.outcomes))}, "
            f"missing: {sorted(set(base.outcomes) - set(r.outcomes))}"
        )
    more_skips = sorted(set(r.ids("skipped")) - set(base.ids("skipped")))
    if more_skips:
        problems.append(f"{label} skips tests that (a) does not skip:\n" + r.describe(more_skips))
    regressions = sorted(i for i in base.ids("passed") if r.outcomes.get(i, Outcome("missing")).status != "passed")
    unexpected = [i for i in regressions if i not in allowed]
    if unexpected:
        problems.append(f"{label}: {len(unexpected)} test(s) that pass in (a) do not pass:\n" + r.describe(unexpected))
    for i, expected in sorted(allowed.items()):
        outcome = r.outcomes.get(i)
        if outcome is None or outcome.status != "failed":
            problems.append(
                f"{label}: allow-listed {i} did not fail ({outcome.status if outcome else 'not run'}): "
                "remove it from DROPIN_ALLOWED_FAILURES"
            )
        elif expected not in outcome.text:
            problems.append(f"{label}: allow-listed {i} failed, but not at {expected!r}:\n" + r.describe([i]))
    passed = r.ids("passed")
    engagement = _engagement_problems(r, passed)
    if engagement:
        problems.append(
            f"{label}: passed tests in which a save or load did not reach statekit (no post-hook call):\n"
            + "\n".join(engagement)
        )
    if not any(r.outcomes[i].props.get("statekit_attach_hook", 0) or r.outcomes[i].props.get(ENGAGEMENT[mode][1], 0)
               for i in r.outcomes):
        problems.append(f"{label}: statekit was never called: the mode plugin did not take effect\n{r.log_tail()}")
    return problems


def test_untouched_baseline(conformance: Conformance) -> None:
    """Mode (a): the selected tests all pass or skip with Accelerate alone."""
    r = conformance.run("untouched")
    _print_mode(r)
    problems = []
    if set(r.outcomes) != set(conformance.selected):
        problems.append(
            f"mode (a) ran {len(r.outcomes)} tests, {len(conformance.selected)} were selected; not run: "
            f"{sorted(set(conformance.selected) - set(r.outcomes))}; unexpected: "
            f"{sorted(set(r.outcomes) - set(conformance.selected))}"
        )
    bad = r.ids("failed", "error")
    if bad:
        problems.append(
            "mode (a) untouched: Accelerate's own tests fail without statekit, so this environment cannot judge "
            "statekit:\n" + r.describe(bad)
        )
    if problems:
        pytest.fail("\n\n".join(problems), pytrace=False)


@pytest.mark.parametrize("mode", ["attach_init", "attach_prepare"])
def test_attach_mode_matches_untouched(conformance: Conformance, mode: str) -> None:
    """Modes (b) and (c): same tests as (a), no more skips, every test (a) passes passes,
    and statekit's post-hooks ran for every save and load."""
    _print_mode(conformance.run(mode))
    problems = _compare_with_untouched(conformance, mode, {})
    if problems:
        pytest.fail("\n\n".join(problems), pytrace=False)


def test_dropin_only_allowed_failures(conformance: Conformance) -> None:
    """Mode (d): as (b)/(c), except the tests of :data:`DROPIN_ALLOWED_FAILURES`, which must
    fail at their listed line; Accelerate's own save_state/load_state is never called."""
    r = conformance.run("dropin")
    _print_mode(r)
    problems = _compare_with_untouched(conformance, "dropin", DROPIN_ALLOWED_FAILURES)
    fallback = [f"  {i}: {o.props}" for i, o in sorted(r.outcomes.items())
                if o.props.get("accelerate_save_impl", 0) or o.props.get("accelerate_load_impl", 0)]
    if fallback:
        problems.append("mode (d) dropin: Accelerate's own save_state/load_state was called:\n" + "\n".join(fallback))
    if problems:
        pytest.fail("\n\n".join(problems), pytrace=False)


@pytest.mark.parametrize("mode", list(MODES))
def test_no_stray_files(conformance: Conformance, mode: str) -> None:
    """Nothing is left in the run's working directory (for example ``./None``), and the
    run leaves no more in ``TMPDIR`` than Accelerate alone does."""
    r = conformance.run(mode)
    problems = []
    if r.strays:
        problems.append(f"mode {MODES[mode].label} {mode} left files in its working directory {r.cwd}: {r.strays[:50]}")
    if mode != "untouched":
        base = conformance.run("untouched")
        extra = sorted(set(r.tmp_leftovers) - set(base.tmp_leftovers))
        if extra:
            problems.append(f"mode {MODES[mode].label} {mode} left files in TMPDIR that (a) does not: {extra[:50]}")
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)
