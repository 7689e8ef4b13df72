"""Time of ``import statekit`` beyond ``import torch``, in fresh interpreters.

Usage::

    python bench/import_time.py [--runs 5]

Each run is a new interpreter that imports torch, then statekit (which imports every
installed plugin's module on first use, not here), and reports both times. Prints
min / median / max of each and the ratio of statekit's time to torch's. The budget is
0.3 s beyond torch on the benchmark VM (a plugin module must stay cheap to import:
heavy libraries load lazily; ``tests/unit/test_import.py`` checks that none is imported).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

CODE = """
import time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import statekit
t2 = time.perf_counter()
print(t1 - t0, t2 - t1)
"""


def main() -> None:
    """Run the measurement (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    torch_s, beyond_s = [], []
    for _ in range(args.runs):
        out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, check=True).stdout
        t, s = map(float, out.split())
        torch_s.append(t)
        beyond_s.append(s)

    def stats(values: list[float]) -> str:
        return f"{min(values):.3f} / {statistics.median(values):.3f} / {max(values):.3f} s"

    print(f"import torch                 {stats(torch_s)}")
    print(f"import statekit beyond torch {stats(beyond_s)} (budget 0.3 s)")
    print(f"ratio statekit / torch (medians) {statistics.median(beyond_s) / statistics.median(torch_s):.3f}")


if __name__ == "__main__":
    main()
