"""Runs client scripts in children forked from one process that imported their libraries once.

A client script's imports (torch, accelerate, datasets, diffusers, transformers, peft) take
about 5 s on the 2-core machine, more than a tiny training; the tests run some sixty scripts.
This process imports them once (statekit is not among them: a ``--statekit off`` run never
imports it, as upstream's script would not), never runs a torch operation itself (no OpenMP pool exists
when it forks: see ``tests/scripts/kill_zygote.py``), and forks one child per run. The child
is the script's process: ``sys.argv`` is set, ``runpy.run_path(script, run_name="__main__")``
runs it, stdout and stderr go to a log file, one torch thread; a SIGKILL it sends itself is a
killed process, as it would be under ``python script.py``.

Protocol, one JSON line each way: ``{"script", "argv", "log"}`` on stdin ->
``{"returncode", "signal", "seconds"}`` on stdout (``signal``: the signal that ended it).
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
import traceback

PRELOAD = [
    "numpy", "PIL.Image", "safetensors.torch", "torch", "datasets", "accelerate", "peft", "transformers",
    "diffusers", "diffusers.training_utils", "diffusers.optimization",
]
PRELOAD_NAMES = {
    "diffusers": ["UNet2DModel", "UNet2DConditionModel", "AutoencoderKL", "ControlNetModel", "DDPMScheduler",
                  "DDPMPipeline", "StableDiffusionPipeline", "DiffusionPipeline"],
    "transformers": ["CLIPTextModel", "CLIPTokenizer", "AutoTokenizer", "AutoModelForCausalLM", "GPT2LMHeadModel",
                     "AutoModelForSequenceClassification", "BertForSequenceClassification", "Trainer",
                     "TrainingArguments", "HfArgumentParser", "get_scheduler", "default_data_collator"],
    "peft": ["LoraConfig"],
}


def preload() -> None:
    import importlib

    for name in PRELOAD:
        module = importlib.import_module(name)
        for attr in PRELOAD_NAMES.get(name, []):
            getattr(module, attr)


def child(request: dict) -> int:
    fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    script = request["script"]
    sys.argv = [script, *request["argv"]]
    sys.path.insert(0, os.path.dirname(script))
    import torch

    torch.set_num_threads(1)
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def main() -> None:
    preload()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        started = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = child(request)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        result = {"returncode": None, "signal": None, "seconds": round(time.perf_counter() - started, 3)}
        if os.WIFSIGNALED(status):
            result["signal"] = os.WTERMSIG(status)
        else:
            result["returncode"] = os.WEXITSTATUS(status)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
