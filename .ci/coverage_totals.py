"""Line and branch coverage totals of a ``coverage json`` report (``make coverage``):
``python .ci/coverage_totals.py coverage.json``."""

import json
import sys

totals = json.load(open(sys.argv[1]))["totals"]
lines, statements = totals["covered_lines"], totals["num_statements"]
branches, all_branches = totals["covered_branches"], totals["num_branches"]
print(f"lines    {lines}/{statements} = {100 * lines / statements:.2f}%")
print(f"branches {branches}/{all_branches} = {100 * branches / all_branches:.2f}%")
print(f"together (coverage.py's total) {totals['percent_covered']:.2f}%")
