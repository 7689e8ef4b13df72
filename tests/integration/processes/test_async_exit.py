"""An async save still in flight when the interpreter exits (a real Python process): the
process waits for it; the checkpoint is committed, or the failure is printed with its
traceback and the exit status is 1. The in-process cases are in ``unit/api/test_async_save.py``."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from statekit.manager.manager import checkpoint_name


EXIT_SCRIPT = textwrap.dedent(
    """
    import sys, torch, statekit
    root = sys.argv[1]
    manager = statekit.CheckpointManager({"t": torch.zeros(3)}, root, async_save=True)
    if sys.argv[2] == "fail":
        statekit.Checkpoint.flush = lambda self: (_ for _ in ()).throw(OSError(5, "disk on fire"))
    manager.save(1)
    print("leaving main", flush=True)
    """
)


@pytest.mark.parametrize("outcome", ["ok", "fail"])
def test_pending_save_at_interpreter_exit(tmp_path, outcome):
    script = tmp_path / "exit.py"
    script.write_text(EXIT_SCRIPT)
    root = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(script), str(root), outcome], capture_output=True, text=True, timeout=120)
    assert "leaving main" in proc.stdout
    if outcome == "ok":
        assert proc.returncode == 0, proc.stderr
        assert (root / checkpoint_name(1) / "statekit.json").exists()
    else:
        assert proc.returncode == 1
        assert f"background save to {root / checkpoint_name(1)} failed" in proc.stderr
        assert "disk on fire" in proc.stderr and "Traceback" in proc.stderr
        assert not (root / checkpoint_name(1) / "statekit.json").exists()
