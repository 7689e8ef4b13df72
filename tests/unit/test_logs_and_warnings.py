"""statekit's log lines and where its warnings point, read the way a user reads them.

* Saves, loads, resumes and skipped checkpoints are one INFO line each on the ``statekit``
  logger (children ``statekit.<module>``), seen with ``caplog`` as with
  ``logging.basicConfig(level=logging.INFO)``; a program that configures no logging sees
  nothing (the library adds a ``NullHandler``, never a basicConfig).
* A warning raised deep inside ``save``/``load``/``resume``/``accelerator.save_state`` points
  at the user's line: its ``filename`` is this test file.
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import statekit


def statekit_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "statekit" or r.name.startswith("statekit.")]


def test_save_and_load_log_one_info_line_each(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="statekit")
    model = torch.nn.Linear(4, 3)
    url = str(tmp_path / "step-3")

    statekit.save(url, {"model": model}, step=3)
    statekit.load(url, {"model": torch.nn.Linear(4, 3)})

    lines = statekit_lines(caplog)
    assert len(lines) == 2, lines
    assert re.fullmatch(rf"saved step 3 to {re.escape(url)} \(\d+(\.\d)? (B|KiB), \d+\.\d\d s\)", lines[0]), lines[0]
    assert re.fullmatch(rf"loaded {re.escape(url)} \(step 3, \d+(\.\d)? (B|KiB), \d+\.\d\d s\)", lines[1]), lines[1]
    assert all(r.levelno == logging.INFO for r in caplog.records if r.name.startswith("statekit"))


def test_manager_logs_resume_and_skipped_checkpoint(tmp_path, caplog):
    root = str(tmp_path / "run")
    model = torch.nn.Linear(4, 3)
    manager = statekit.CheckpointManager({"model": model}, root)
    manager.save(10)
    with torch.no_grad():
        model.weight.add_(1.0)  # trained between the saves: step 20 shares no file with step 10 (incremental saves)
    manager.save(20)
    newest = Path(manager.url_for(20))
    tensors = next(newest.glob("*.safetensors"))
    tensors.write_bytes(tensors.read_bytes()[:-8])  # truncated: resume falls back to step 10

    caplog.set_level(logging.INFO, logger="statekit")
    with pytest.warns(statekit.StatekitWarning, match="cannot resume from") as record:
        step = statekit.CheckpointManager({"model": torch.nn.Linear(4, 3)}, root).resume()

    assert step == 10
    lines = statekit_lines(caplog)
    skipped = [line for line in lines if line.startswith("skipped")]
    assert len(skipped) == 1 and skipped[0].startswith(f"skipped checkpoint-00000020 ({newest.as_posix()}): "), lines
    assert str(tensors.name) in skipped[0]  # the reason names the damaged file
    assert lines[-1].startswith(f"resumed from step 10 ({manager.url_for(10)}): continuing run ")
    # the fallback warning points at the resume() line above, not inside statekit
    assert [w.filename for w in record if "cannot resume" in str(w.message)] == [__file__]


def test_resume_of_empty_root_logs_a_fresh_start(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="statekit")
    root = str(tmp_path / "fresh")
    assert statekit.CheckpointManager({"model": torch.nn.Linear(2, 2)}, root).resume() is None
    assert statekit_lines(caplog)[-1] == f"no committed checkpoint under {root}: starting from the beginning"


def test_library_prints_nothing_unless_logging_is_configured(tmp_path):
    script = textwrap.dedent(
        f"""
        import logging, sys, warnings, torch, statekit
        warnings.simplefilter("ignore")
        statekit.save({str(tmp_path / "a")!r}, {{"model": torch.nn.Linear(2, 2)}}, step=1)
        print("---", file=sys.stderr, flush=True)
        logging.basicConfig(level=logging.INFO)
        statekit.save({str(tmp_path / "b")!r}, {{"model": torch.nn.Linear(2, 2)}}, step=2)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    before, after = result.stderr.split("---\n")
    assert before == ""
    assert re.match(rf"INFO:statekit\.[\w.]+:saved step 2 to {re.escape(str(tmp_path / 'b'))} \(", after), after


# --------------------------------------------------------------------------- warnings


def test_option_typo_warning_points_at_the_users_save_line(tmp_path):
    with pytest.warns(statekit.StatekitWarning, match="keep_lats") as record:
        statekit.save(str(tmp_path / "c"), {"model": torch.nn.Linear(2, 2)}, keep_lats=2)
    assert [w.filename for w in record if "keep_lats" in str(w.message)] == [__file__]


def test_retention_warning_points_at_the_users_manager_save_line(tmp_path):
    from statekit.plugin_api import mark_in_use, release_in_use

    manager = statekit.CheckpointManager({"model": torch.nn.Linear(2, 2)}, str(tmp_path / "run"), keep_last=1)
    manager.save(1)
    marker = mark_in_use(manager.url_for(1), by="a-reader")  # a live process reads checkpoint 1 in place
    try:
        with pytest.warns(statekit.StatekitWarning, match="retention kept") as record:
            manager.save(2)
    finally:
        release_in_use(marker)
    assert [w.filename for w in record if "retention kept" in str(w.message)] == [__file__]


def test_attach_mode_warning_points_at_the_users_load_state_line(tmp_path):
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    def run(batch_size):
        accelerator = Accelerator(cpu=True)
        statekit.attach(accelerator)
        data = torch.utils.data.TensorDataset(torch.arange(32, dtype=torch.float32).reshape(16, 2))
        loader = torch.utils.data.DataLoader(data, batch_size=batch_size)
        model = torch.nn.Linear(2, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        return accelerator, accelerator.prepare(model, optimizer, loader)

    accelerator, _ = run(batch_size=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        accelerator.save_state(str(tmp_path / "ckpt"))
    accelerator, _ = run(batch_size=8)  # another batch size: the resume fingerprint differs
    with pytest.warns(statekit.ResumeFingerprintWarning, match="batch size 4 -> 8") as record:
        accelerator.load_state(str(tmp_path / "ckpt"))
    assert {w.filename for w in record if isinstance(w.message, statekit.ResumeFingerprintWarning)} == {__file__}


def test_attach_mode_save_and_load_are_logged(tmp_path, caplog):
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    statekit.attach(accelerator)
    model = torch.nn.Linear(2, 2)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    url = str(tmp_path / "ckpt")
    caplog.set_level(logging.INFO, logger="statekit")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        accelerator.save_state(url)
        accelerator.load_state(url)
    lines = statekit_lines(caplog)
    assert len(lines) == 2, lines
    assert re.fullmatch(rf"saved step 0 to {re.escape(url)} \(\d+(\.\d)? (B|KiB), \d+\.\d\d s, attached\)", lines[0]), lines
    assert re.fullmatch(rf"loaded {re.escape(url)} \(step 0, \d+(\.\d)? (B|KiB), \d+\.\d\d s, attached\)", lines[1]), lines
