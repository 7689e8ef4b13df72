"""Saves and retention killed (SIGKILL) at each write, rename and deletion, in real processes:
the next start resumes from the newest whole checkpoint, and what a kept checkpoint needs
survives. The fault catalogue with forked children is ``test_faults.py``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import statekit
from statekit.manager.manager import checkpoint_name

from lora_helpers import lora_run
from repo_paths import TESTS


KILLED_SAVE = textwrap.dedent(
    """
    import os, signal, sys, torch, statekit
    root, kill_on = sys.argv[1], int(sys.argv[2])
    model = torch.nn.Linear(64, 64)
    manager = statekit.CheckpointManager({"model": model, "t": torch.arange(10.0)}, root)
    manager.save(1)
    writes = 0
    def hook(event, args):
        global writes
        opened = event == "open" and isinstance(args[0], str) and args[0].startswith(root) and (
            (args[1] and "w" in str(args[1])) or (isinstance(args[2], int) and args[2] & (os.O_WRONLY | os.O_RDWR))
        )
        reused = event == "os.link" and str(args[1]).endswith(".safetensors")  # an unchanged file, linked (incremental)
        if opened or reused:
            writes += 1
            if writes == kill_on:
                os.kill(os.getpid(), signal.SIGKILL)
        if event in ("os.rename", "os.link") and str(args[1]).endswith("statekit.json") and kill_on == 0:
            os.kill(os.getpid(), signal.SIGKILL)  # the manifest commit (os.replace or os.link)
    with torch.no_grad():
        model.weight.add_(1)
    sys.addaudithook(hook)
    manager.save(2)
    print("survived")
    """
)


@pytest.mark.parametrize("kill_on", [0, 1, 2, 3, 4, 5, 6])
def test_resume_after_a_killed_save(tmp_path, kill_on):
    root = str(tmp_path / "run")
    script = tmp_path / "save.py"
    script.write_text(KILLED_SAVE)
    env = {**os.environ, "STATEKIT_DISABLE_PLUGIN_AUTOLOAD": "1"}  # a fixed write sequence
    proc = subprocess.run([sys.executable, str(script), root, str(kill_on)], capture_output=True, text=True, env=env)
    model = torch.nn.Linear(64, 64)
    t = torch.zeros(10)
    manager = statekit.CheckpointManager({"model": model, "t": t}, root)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", statekit.StatekitWarning)
        step = manager.resume()
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    committed = (tmp_path / "run" / checkpoint_name(2) / "statekit.json").exists()
    assert step == (2 if committed else 1)  # an interrupted step 2 never becomes latest
    assert manager.latest().endswith(checkpoint_name(step))
    if kill_on == 0:
        assert step == 1  # killed at the commit itself
    assert torch.equal(t, torch.arange(10.0))
    statekit.verify(manager.latest())


KILLED_RETENTION = """
import os, signal, sys, warnings
import torch
import statekit
sys.path.insert(0, {tests!r})
from lora_helpers import lora_run, train_step

warnings.simplefilter("ignore")
root, kill_on = sys.argv[1], int(sys.argv[2])
model, optim = lora_run()
manager = statekit.CheckpointManager({{"model": model, "optim": optim}}, root, keep_last=1)
train_step(model, optim)
manager.save(1)
train_step(model, optim)
torch.save(model.state_dict(), os.path.join(root, "..", "expected.pt"))
deleting = 0
def hook(event, args):
    global deleting
    if event in ("os.remove", "os.rmdir", "shutil.rmtree") and (deleting or "checkpoint-00000001" in str(args[0])):
        deleting += 1  # the deletion of checkpoint 1 (manifest first), which shares its frozen file with 2
        if deleting == kill_on:
            os.kill(os.getpid(), signal.SIGKILL)
sys.addaudithook(hook)
manager.save(2)
print("survived")
"""


@pytest.mark.parametrize("kill_on", [1, 2, 3, 4, 5, 6])
def test_retention_killed_at_any_point_keeps_what_the_kept_checkpoint_needs(tmp_path, kill_on):
    import signal
    import subprocess
    import sys

    from click.testing import CliRunner

    from statekit.cli import main

    script = tmp_path / "run.py"
    script.write_text(KILLED_RETENTION.format(tests=str(TESTS)))
    root = tmp_path / "run"
    root.mkdir()
    env = {**os.environ, "STATEKIT_DISABLE_PLUGIN_AUTOLOAD": "1"}  # a fixed deletion sequence
    proc = subprocess.run([sys.executable, str(script), str(root), str(kill_on)], capture_output=True, text=True, env=env)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    if kill_on == 1:  # killed before the deletion began: checkpoint 1 is whole
        statekit.verify(str(root / "checkpoint-00000001"))
    else:  # the manifest goes first: what is left of checkpoint 1 is never loaded
        assert not (root / "checkpoint-00000001" / "statekit.json").exists()
    result = CliRunner().invoke(main, ["gc", str(root)])  # clears what the killed deletion left
    assert result.exit_code == 0, result.output
    statekit.verify(str(root / "checkpoint-00000002"))  # the frozen bytes survive through the link
    fresh, fresh_optim = lora_run(seed=2)
    with pytest.warns(statekit.StatekitWarning):  # no random states were saved (plugins off in the script)
        assert statekit.CheckpointManager({"model": fresh, "optim": fresh_optim}, str(root)).resume() == 2
    expected = torch.load(tmp_path / "expected.pt")
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in expected.items())
