"""diffusers' training scripts, as users run them, with statekit attached as the docs say
(issue 44, item 1): ``train_unconditional.py`` (with and without ``--use_ema``),
``train_text_to_image.py`` (with and without ``--use_ema``), ``train_text_to_image_lora.py``,
``train_dreambooth_lora.py`` and ``train_controlnet.py``, reproduced under
``tests/scripts/clients/`` (each file names the upstream commit it follows and what differs).

Every case: 12 images, batch 2, 2 micro-batches per optimizer step (3 steps per epoch), 9
steps, a checkpoint every 2 steps with ``--checkpoints_total_limit 2`` (the older ones are
deleted as the run goes, the one resumed from included), SIGKILL after step 5 and
``--resume_from_checkpoint latest``, which loads ``checkpoint-4``: one step into the second
epoch, 2 of its 6 micro-batches consumed. The checks (``client_helpers.ScriptChecks``): the
script alone runs; attached (right after ``Accelerator(...)``, or after ``prepare()``) it
changes nothing and every checkpoint commits; the resume with statekit is exact; the script's
own resume without statekit has the outcome recorded here and in docs/migrating.md.
"""

from __future__ import annotations

from client_helpers import Case, ScriptChecks

STEPS = ["--train_batch_size", "2", "--gradient_accumulation_steps", "2", "--learning_rate", "1e-3",
         "--checkpointing_steps", "2", "--checkpoints_total_limit", "2"]
UNCONDITIONAL = ["--train_data_dir", "{A}/images", "--model_config_name_or_path", "{A}/unet_config.json",
                 "--resolution", "8", "--random_flip", "--eval_batch_size", "2", "--num_epochs", "3",
                 "--lr_warmup_steps", "1", "--ddpm_num_inference_steps", "2", *STEPS]
SD = ["--pretrained_model_name_or_path", "{A}/sd", "--resolution", "32", "--max_train_steps", "9", "--seed", "7", *STEPS]
CAPTIONED = [*SD, "--train_data_dir", "{A}/captioned", "--random_flip"]
INSTANCE = [*SD, "--instance_data_dir", "{A}/instance", "--instance_prompt", "a photo of sks dog"]
CONDITIONED = [*SD, "--train_data_dir", "{A}/conditioned", "--proportion_empty_prompts", "0.3"]


def flags(*template):
    """``argv(assets)`` for a :class:`Case`: the template with ``{A}`` as the assets folder."""
    return lambda assets: [t.format(A=assets) for t in template]


def case(name, script, argv, own_resume):
    return Case(name, script, argv, steps=9, stop_after=5, resumed_from=4, own_resume=own_resume)


class TestDiffusersScripts(ScriptChecks):
    ASSETS = "unconditional,sd"
    CASES = {c.name: c for c in [
        case("unconditional", "train_unconditional.py", flags(*UNCONDITIONAL),
             "432 of 576 tensors differ; losses differ from step 5 on (5 steps)"),
        case("unconditional_ema", "train_unconditional.py", flags(*UNCONDITIONAL, "--use_ema"),
             "576 of 720 tensors differ; losses differ from step 5 on (5 steps)"),
        case("text_to_image", "train_text_to_image.py", flags(*CAPTIONED),
             "624 of 832 tensors differ; losses differ from step 5 on (5 steps)"),
        case("text_to_image_ema", "train_text_to_image.py", flags(*CAPTIONED, "--use_ema"),
             "832 of 1040 tensors differ; losses differ from step 5 on (5 steps)"),
        case("text_to_image_lora", "train_text_to_image_lora.py", flags(*CAPTIONED),
             "192 of 464 tensors differ; losses differ from step 5 on (5 steps)"),
        case("dreambooth_lora", "train_dreambooth_lora.py", flags(*INSTANCE),
             "192 of 464 tensors differ; losses differ from step 5 on (5 steps)"),
        case("controlnet", "train_controlnet.py", flags(*CONDITIONED),
             "384 of 512 tensors differ; losses differ from step 5 on (5 steps)"),
    ]}
