"""Accelerate's ``examples/by_feature/checkpointing.py``, as users run it, with
``statekit.attach(accelerator)`` (issue 44, item 1), reproduced under ``tests/scripts/clients/``
(the file names the upstream commit it follows, and what differs).

The case: a 2-layer BERT classifier with dropout on 24 sentence pairs, batch 2 (12 steps per
epoch, one micro-batch each), 2 epochs, a checkpoint every 4 steps (``step_<n>`` folders), SIGKILL
after step 18, resumed from ``step_16`` (4 steps into the second epoch) named by path, as the
example takes it. After that resume the example counts ``overall_step`` from the epoch's start
(its own arithmetic), so its next checkpoints are named ``step_8`` and ``step_12`` again: the
folders are rewritten, which changes nothing of the training. The checks:
``client_helpers.ScriptChecks``.
"""

from __future__ import annotations

from client_helpers import Case, ScriptChecks

FLAGS = ["--model_name_or_path", "{A}/bert", "--data_dir", "{A}/mrpc", "--cpu", "--checkpointing_steps", "4",
         "--num_epochs", "2", "--batch_size", "2", "--lr", "1e-3", "--seed", "42"]


class TestAccelerateScripts(ScriptChecks):
    ASSETS = "mrpc"
    CASES = {c.name: c for c in [
        Case("checkpointing", "checkpointing.py", lambda a: [t.format(A=a) for t in FLAGS], steps=24, stop_after=18,
             resumed_from=16, own_resume="123 of 164 tensors differ; losses differ from step 17 on (8 steps)", checkpoints="step_", latest=False),
        # the example's accumulation by hand: --batch_size 4 over --max_gpu_batch_size 2 gives
        # gradient_accumulation_steps=2 of its own (Accelerate counts none; the example builds its
        # loaders before it halves the batch, so 6 batches of 4 per epoch) and optimizer.step() at
        # `step % 2 == 0`: step_8 (the second epoch's batch 1) holds a backward no step consumed
        Case("checkpointing_by_hand", "checkpointing.py",
             lambda a: [t.format(A=a) for t in FLAGS] + ["--batch_size", "4", "--max_gpu_batch_size", "2"],
             steps=12, stop_after=10, resumed_from=8, own_resume="123 of 164 tensors differ; losses differ from step 9 on (4 steps)", checkpoints="step_", latest=False),
    ]}
