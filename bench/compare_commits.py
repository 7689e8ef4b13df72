"""statekit's save and load at two commits, alternating, in fresh processes.

Usage::

    python bench/compare_commits.py OLD_REV [NEW_REV] [--size 256MiB] [--runs 5]

Checks each revision out into a temporary ``git worktree`` (NEW_REV defaults to the
working tree itself) and runs, ``--runs`` times and alternating old/new, the
``statekit save`` and ``statekit load`` measurements of ``bench/_workers.py`` *of that
revision* with that revision first on ``PYTHONPATH``. Plugin autoloading is off for both
(``STATEKIT_DISABLE_PLUGIN_AUTOLOAD=1``): installed plugins follow one revision's plugin
API, and the measurement is the core's save/load path. Prints min/median/max per
revision and op and the ratio new/old of the medians (a refactor must stay within 1.05).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from _units import parse_size  # noqa: E402


def measure(tree: str, op: str, directory: str, size: int) -> float:
    """Seconds of one ``statekit`` ``op`` (save or load) by ``tree``'s own worker."""
    env = {**os.environ, "PYTHONPATH": tree, "STATEKIT_DISABLE_PLUGIN_AUTOLOAD": "1"}
    cmd = [sys.executable, os.path.join(tree, "bench", "_workers.py"), "statekit", op, directory, str(size), "fp32"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tree, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return float(json.loads(line[7:])["seconds"])
    raise RuntimeError(f"{tree}: statekit {op} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old")
    parser.add_argument("new", nargs="?", default=None, help="default: the working tree")
    parser.add_argument("--size", default="256MiB")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args(argv)
    size = parse_size(args.size)
    scratch = tempfile.mkdtemp(prefix="statekit-compare-", dir=os.path.dirname(REPO))  # the repo's disk, outside its tree
    trees = {}
    try:
        for label, rev in (("old", args.old), ("new", args.new)):
            if rev is None:
                trees[label] = REPO
                continue
            trees[label] = os.path.join(scratch, label)
            subprocess.run(["git", "worktree", "add", "--detach", trees[label], rev], cwd=REPO, check=True, capture_output=True)
        times: dict[tuple[str, str], list[float]] = {}
        for run in range(args.runs):
            for label in ("old", "new") if run % 2 == 0 else ("new", "old"):
                d = os.path.join(scratch, f"ckpt-{label}")
                shutil.rmtree(d, ignore_errors=True)
                os.makedirs(d)
                for op in ("save", "load"):
                    seconds = measure(trees[label], op, d, size)
                    times.setdefault((label, op), []).append(seconds)
                    print(f"run {run} {label} {op} {seconds:.3f} s", flush=True)
        print(f"\nstatekit save/load, {args.size}, {args.runs} alternating fresh-process runs (min / median / max, s)")
        for op in ("save", "load"):
            old, new = times[("old", op)], times[("new", op)]
            print(
                f"  {op}: old {min(old):.3f} / {statistics.median(old):.3f} / {max(old):.3f}  "
                f"new {min(new):.3f} / {statistics.median(new):.3f} / {max(new):.3f}  "
                f"new/old {statistics.median(new) / statistics.median(old):.3f}"
            )
    finally:
        for label, tree in trees.items():
            if tree != REPO:
                subprocess.run(["git", "worktree", "remove", "--force", tree], cwd=REPO, capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
