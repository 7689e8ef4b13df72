"""The documentation's code runs: every Python block and every ``statekit`` command of
README.md, docs/, docs/plugins/ and the plugins' READMEs (mktestdocs finds the blocks).

The convention (also in docs/index.md, "Code blocks in these pages"):

* A fence whose info string is exactly ``python`` runs. The blocks of one page run in
  order in one namespace (a later block uses what an earlier one defined), in a fresh
  temporary directory (relative paths such as ``ckpt/step-100`` land there), with a moto S3
  server and an empty bucket ``bucket`` for the pages in :data:`S3_PAGES`
  (``s3://bucket/...`` then works as written).
* What a block needs but does not show (a model, a data loader) comes from a setup
  comment just above it: ``<!-- docs-test setup: <why>`` + Python lines + ``-->``. It is
  visible in the page's source, hidden on the rendered page, and runs in place. ``REPO``
  holds the repository root.
* A fence with ``title="illustration"`` (``python title="illustration"``,
  ``bash title="illustration"``) only illustrates (it needs a GPU, several processes, a real
  bucket, or has ``...`` placeholders) and is skipped; the rendered page shows the title.
* Shell: each line of a ``bash`` fence that starts with ``statekit`` and each
  ``$ statekit ...`` line of a transcript runs (click's CliRunner, in the same directory,
  after the page's Python blocks), against the checkpoints :data:`WORKSPACES` creates for
  that page. A transcript whose next line starts with ``error:`` must exit non-zero, any
  other command zero. Other shell lines (``pip``, ``make``, ``python script.py``) are not run
  here: ``make package``, ``make demo`` and the examples' own tests cover them.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

mktestdocs = pytest.importorskip("mktestdocs", reason='mktestdocs is not installed (pip install -e ".[test]")')

from repo_paths import ROOT  # noqa: E402
PAGES = sorted(
    [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "docs" / "plugins").glob("*.md"),
     *(ROOT / "plugins").glob("*/README.md")]
)
ILLUSTRATION = 'title="illustration"'
SETUP = re.compile(r"^<!-- docs-test setup[^\n]*\n(?P<code>.*?)^-->$", re.S | re.M)
FENCE = re.compile(r"^\s*```+\s*(?P<info>[^`\n]*)$", re.M)

S3_PAGES = {"README.md", "docs/getting-started.md", "docs/hook-trainers.md", "docs/migrating.md"}
"""Pages whose blocks use ``s3://bucket/...``: they run against a local moto server."""


def rel(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def python_blocks(text: str) -> list[str]:
    """The page's runnable Python, setup comments included, in page order."""
    text = SETUP.sub(lambda m: "```python\n" + m.group("code") + "```", text)
    return mktestdocs.grab_code_blocks(text, lang="python")


def commands(text: str) -> list[tuple[list[str], bool, int | None]]:
    """``(argv, expect_error, exit_code)`` of every statekit command the page shows;
    ``exit_code`` is the number a transcript prints after it with ``$ echo $?`` (else None)."""
    found: list[tuple[list[str], bool, int | None]] = []
    for block in mktestdocs.grab_code_blocks(text, lang="bash"):
        for line in block.replace("\\\n", " ").splitlines():
            if line.startswith("statekit "):
                found.append((shlex.split(line, comments=True)[1:], False, None))
    for lang in ("text", "console"):
        for block in mktestdocs.grab_code_blocks(text, lang=lang):
            lines = block.splitlines()
            for i, line in enumerate(lines):
                if line.startswith("$ statekit"):
                    after = lines[i + 1] if i + 1 < len(lines) else ""
                    found.append((shlex.split(line[2:], comments=True)[1:], after.startswith("error:"), _echoed_code(lines, i)))
    return found


def _echoed_code(lines: list[str], i: int) -> int | None:
    """The exit code a transcript shows for its command on line ``i``: the line after the
    next ``$ echo $?``, when that is the next command."""
    following = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("$ ")), None)
    if following is None or lines[following].strip() != "$ echo $?" or following + 1 >= len(lines):
        return None
    code = lines[following + 1].strip()
    return int(code) if code.isdigit() else None


# --------------------------------------------------------------------------- the checkpoints the CLI pages read


def _fresh_accelerator():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return Accelerator(cpu=True)


class _Counter:
    """A custom object Accelerate pickles (``custom_checkpoint_0.pkl``)."""

    def __init__(self) -> None:
        self.count = 3

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = state["count"]


def accelerate_folder(path: str) -> None:
    """A folder of plain ``Accelerator.save_state`` with a pickled custom object."""
    accelerator = _fresh_accelerator()
    model = torch.nn.Linear(4, 2)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    accelerator.register_for_checkpointing(_Counter())
    accelerator.save_state(path)


def trainer_checkpoint(path: str) -> None:
    """What ``transformers.Trainer`` writes into ``checkpoint-<step>/``, by hand."""
    import json

    import safetensors.torch

    os.makedirs(path)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    safetensors.torch.save_file(model.state_dict(), f"{path}/model.safetensors", metadata={"format": "pt"})
    Path(f"{path}/config.json").write_text(json.dumps({"model_type": "tiny"}))
    Path(f"{path}/trainer_state.json").write_text(json.dumps({"global_step": 500, "epoch": 2.0, "max_steps": 1000}))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    torch.save(optimizer.state_dict(), f"{path}/optimizer.pt")
    torch.save({"last_epoch": 500}, f"{path}/scheduler.pt")
    torch.save({"cpu": torch.get_rng_state()}, f"{path}/rng_state.pth")
    torch.save({"output_dir": "trainer-out"}, f"{path}/training_args.bin")


def cli_workspace() -> None:
    import safetensors.torch
    import torch.distributed.checkpoint as dcp

    import statekit

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters())
    for root in ("runs/demo", "runs/demo-reference"):
        manager = statekit.CheckpointManager({"model": model, "optimizer": optimizer}, root)
        for step in (10, 20, 30):
            model(torch.randn(2, 8)).sum().backward()
            optimizer.step()
            manager.save(step)
    os.makedirs("runs/demo/checkpoint-00000040")  # a save killed before it committed (its stale lock): gc removes it
    Path("runs/demo/checkpoint-00000040/.statekit-lock").write_text('{"host": "gone", "pid": 1, "created": 0}')
    Path("runs/demo/checkpoint-00000040/model_0.safetensors").write_bytes(b"partial")
    trainer_checkpoint("trainer-out/checkpoint-500")
    dcp.save({"model": model.state_dict()}, checkpoint_id="trainer-out/checkpoint-1000")
    accelerate_folder("acc-step3")
    dcp.save({"model": model.state_dict()}, checkpoint_id="dcp-step100")
    tensors = {"weight": torch.ones(4, 8), "bias": torch.zeros(4)}
    safetensors.torch.save_file(tensors, "model.safetensors")
    torch.save(tensors, "model.pt")
    statekit.save("broken", {"model": model}, step=30)
    damaged = next(Path("broken").glob("*.safetensors"))
    damaged.write_bytes(damaged.read_bytes()[:-4])


WORKSPACES: dict[str, Callable[[], None]] = {
    "docs/cli.md": cli_workspace,
    "docs/migrating.md": lambda: accelerate_folder("old/checkpoint_5"),
}
"""Per page, what its ``statekit`` commands read (built in the page's directory first)."""


# --------------------------------------------------------------------------- the tests


def run_python(name: str, text: str) -> None:
    """Run the page's Python blocks in order in one namespace; fail naming the block."""
    namespace = {"__name__": "__main__", "REPO": str(ROOT)}
    for i, block in enumerate(python_blocks(text), start=1):
        try:
            exec(compile(block, f"{name} (python block {i})", "exec"), namespace)
        except Exception:
            pytest.fail(f"{name}: python block {i} failed:\n{block}\n{traceback.format_exc()}", pytrace=False)


def test_a_snippet_with_an_undefined_name_fails(tmp_path, monkeypatch):
    """What the README's "Without Accelerate" block was: ``state`` defined nowhere."""
    monkeypatch.chdir(tmp_path)
    page = (
        "<!-- docs-test setup: a model\nimport torch, statekit\nmodel = torch.nn.Linear(2, 2)\n-->\n\n"
        "```python\nstatekit.save('ckpt', {'model': model, 'epoch': {'n': 3}})\n"
        "statekit.load('ckpt', {'model': model, 'epoch': state})\n```\n\n"
        '```python title="illustration"\nthis is not run\n```\n'
    )
    with pytest.raises(pytest.fail.Exception, match=r"page\.md: python block 2 failed:(.|\n)*NameError: name 'state'"):
        run_python("page.md", page)
    assert len(python_blocks(page)) == 2  # the setup and the block; not the illustration


def test_fences_follow_the_convention():
    """A Python or shell fence is runnable as written or marked as an illustration: no
    ``py``/``python3``/``sh`` spelling that the runner would skip without a word."""
    wrong = []
    for page in PAGES:
        for m in FENCE.finditer(page.read_text()):
            info = m.group("info").strip()
            lang = info.split()[0] if info else ""
            if lang in ("py", "python3", "pycon", "sh", "shell", "zsh") or (
                lang in ("python", "bash", "console") and info != lang and ILLUSTRATION not in info
            ):
                wrong.append(f"{rel(page)}: ```{info}")
    assert not wrong, "fences the docs test would skip silently:\n" + "\n".join(wrong)


RUNNABLE = [p for p in PAGES if python_blocks(p.read_text()) or commands(p.read_text())]


@pytest.mark.parametrize("page", RUNNABLE, ids=rel)
def test_page_runs(page, tmp_path, monkeypatch, request):
    name = rel(page)
    text = page.read_text()
    monkeypatch.chdir(tmp_path)
    if name in S3_PAGES:
        server = request.getfixturevalue("s3_server")
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()
        fs = server.filesystem()
        if fs.exists("bucket"):
            fs.rm("bucket", recursive=True)  # each page starts with an empty bucket
        fs.mkdir("bucket")
        fs.invalidate_cache()
    if name in WORKSPACES:
        WORKSPACES[name]()
    if "Accelerator(" in text:
        _fresh_accelerator()  # Accelerate's state is per process: each page starts clean
    monkeypatch.setattr(sys, "path", list(sys.path))  # a setup that extends the path does so for its page only
    run_python(name, text)
    from statekit.cli import main

    for argv, expect_error, code in commands(text):
        result = CliRunner().invoke(main, argv)
        shown = f"{name}: `statekit {shlex.join(argv)}` exited {result.exit_code}:\n{result.output}"
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            shown += "".join(traceback.format_exception(result.exception))
        if code is not None:  # the page shows the exit code: exactly that one
            assert result.exit_code == code, shown
            continue
        assert (result.exit_code != 0) == expect_error, shown
        if expect_error:
            assert "error:" in result.output, shown
