"""One run of a data stack (tests/data_stacks.py) in its own process, as a restarted
training script runs: ``python data_stack_run.py STACK_JSON ROOT OUT [SAVE_AT DIE_AT | resume]``.

STACK_JSON: the :class:`data_stacks.Stack` fields as JSON. With SAVE_AT and DIE_AT the run
saves at SAVE_AT and stops after DIE_AT (the process then ends, as a killed one); with
``resume`` it resumes from ROOT; with neither it is the reference run. Writes OUT (JSON):
per step (step, sample indices, loss as hex), the final weights, the statekit warnings.
"""

import json
import logging
import os
import sys

sys.path.insert(0, __file__.rsplit("/scripts/", 1)[0])
from data_stacks import TOTAL, Stack, run  # noqa: E402

logging.getLogger("datasets").setLevel(logging.ERROR)
stack = Stack(**json.loads(sys.argv[1]))
root, out, rest = sys.argv[2], sys.argv[3], sys.argv[4:]
if rest == ["resume"]:
    result = run(stack, root, TOTAL, resume=True)
elif rest:
    result = run(stack, root, TOTAL, save_at=int(rest[0]), die_at=int(rest[1]))
else:
    result = run(stack, root, TOTAL)
with open(out, "w") as f:
    json.dump({"steps": [[s, idx, loss.hex()] for s, idx, loss in result.steps],
               "weights": {k: v.tolist() for k, v in result.weights.items()}, "warnings": result.warnings}, f)
sys.stdout.flush()
os._exit(0)  # as a killed process: no clean-up at exit
