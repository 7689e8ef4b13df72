"""Draw ``bench/run.py --json`` results as a PNG.

Usage::

    python bench/plot.py RESULTS.json OUT.png

Left: median seconds of save and load per system on local disk (error bars: min-max),
with the disk write/read limits as dashed lines. Right: median peak RSS above the
baseline, MiB. Needs matplotlib (``pip install matplotlib``; a benchmark-only dependency).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run import summarize  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(__doc__)
        return 2
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(argv[0]) as f:
        records = json.load(f)
    if isinstance(records, dict):  # {"records": [...], "targets": [...]}; older files: a list
        records = records["records"]
    s = summarize(records)
    systems = ["statekit", "accelerate", "torch", "safetensors", "dcp"]
    systems = [x for x in systems if ("local", x, "save") in s]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.38
    xs = range(len(systems))
    for i, (op, color) in enumerate((("save", "tab:blue"), ("load", "tab:orange"))):
        vals = [s[("local", x, op)]["seconds"] for x in systems]
        lo = [v - s[("local", x, op)]["min"] for v, x in zip(vals, systems)]
        hi = [s[("local", x, op)]["max"] - v for v, x in zip(vals, systems)]
        ax.bar([x + (i - 0.5) * width for x in xs], vals, width, yerr=[lo, hi], label=op, color=color, capsize=3)
    for key, label, color in ((("local", "limit", "write"), "disk write limit", "tab:blue"), (("local", "limit", "read"), "disk read limit", "tab:orange")):
        if key in s:
            ax.axhline(s[key]["seconds"], ls="--", color=color, lw=1, label=label)
    if ("local", "statekit", "async_block") in s:
        ax.bar(len(systems), s[("local", "statekit", "async_block")]["seconds"], width, color="tab:green", label="statekit async: blocking")
    ax.set_xticks(list(xs) + ([len(systems)] if ("local", "statekit", "async_block") in s else []))
    ax.set_xticklabels(systems + (["statekit\nasync"] if ("local", "statekit", "async_block") in s else []))
    state = next(iter(s.values()))["state_bytes"]
    ax.set_ylabel("seconds (median, min-max)")
    ax.set_title(f"model + AdamW state, {state / 2**30:.2f} GiB, local disk, fsync")
    ax.legend(fontsize=8)
    for i, (op, color) in enumerate((("save", "tab:blue"), ("load", "tab:orange"))):
        vals = [s[("local", x, op)]["peak"] / 2**20 for x in systems]
        ax2.bar([x + (i - 0.5) * width for x in xs], vals, width, label=op, color=color)
    ax2.set_xticks(list(xs))
    ax2.set_xticklabels(systems)
    ax2.set_ylabel("peak RSS above baseline, MiB")
    ax2.set_title("memory (load fills a fresh model + optimizer)")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(argv[1], dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
