"""transformers' language-modelling scripts, as users run them, with statekit as the docs say
(issue 44, item 1): ``run_clm_no_trainer.py`` (an Accelerate loop that resumes with
``accelerator.skip_first_batches`` and iterates its evaluation loader only at each epoch's end),
with ``statekit.attach(accelerator)``; ``run_clm.py`` (``Trainer``), with ``Trainer`` replaced by
``statekit_transformers.StatekitTrainer``. Both are reproduced under ``tests/scripts/clients/``
(each names the upstream file and commit it follows, and what differs).

Both cases: a 2-layer GPT-2 with dropout, 16 blocks of 8 tokens, batch 2, 2 micro-batches per
optimizer step (4 steps per epoch), 3 epochs (12 steps), a checkpoint every 2 steps, SIGKILL
after step 7, resumed from step 6 (the middle of the second epoch), named by path: neither
script has a ``latest``. The checks: ``client_helpers.ScriptChecks``.
"""

from __future__ import annotations

from client_helpers import Case, ScriptChecks

DATA = ["--train_file", "{A}/train.txt", "--validation_file", "{A}/validation.txt", "--model_name_or_path", "{A}/gpt2",
        "--block_size", "8", "--learning_rate", "1e-3", "--num_train_epochs", "3", "--gradient_accumulation_steps", "2",
        "--seed", "7"]
NO_TRAINER = [*DATA, "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "2",
              "--checkpointing_steps", "2", "--num_warmup_steps", "1"]
TRAINER = [*DATA, "--do_train", "--per_device_train_batch_size", "2", "--save_strategy", "steps", "--save_steps", "2",
           "--logging_steps", "1", "--report_to", "none", "--use_cpu", "--disable_tqdm", "true", "--warmup_steps", "1"]


def flags(*template):
    return lambda assets: [t.format(A=assets) for t in template]


class TestTransformersScripts(ScriptChecks):
    ASSETS = "clm"
    CASES = {c.name: c for c in [
        Case("run_clm_no_trainer", "run_clm_no_trainer.py", flags(*NO_TRAINER), steps=12, stop_after=7, resumed_from=6,
             own_resume="85 of 113 tensors differ; losses differ from step 7 on (6 steps)", checkpoints="step_", latest=False),
        Case("run_clm", "run_clm.py", flags(*TRAINER), steps=12, stop_after=7, resumed_from=6,
             own_resume="exact: all 113 tensors and every per-step loss equal", latest=False,
             placements=("trainer",)),
    ]}
