"""Hugging Face ``datasets`` and stateful loaders resume exactly, written as users write the loop (issue 35).

Each case trains a reference run straight through (40 steps, 12 batches an epoch), a run
that saves mid-epoch at step 17 and dies at step 20, and a run built afresh (as a restarted
process builds it) that resumes with ``manager.resume()``: the samples of every batch, every
loss and the final weights equal the reference's over the two and a half epochs after the
resume. The loops are in tests/data_stacks.py.
"""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("datasets")
pytest.importorskip("accelerate")
pytest.importorskip("torchdata.stateful_dataloader")

from data_stacks import Stack, interrupted, run  # noqa: E402
from repo_paths import SCRIPTS  # noqa: E402

SAVE_AT, DIE_AT, TOTAL = 17, 20, 40


@pytest.fixture(autouse=True)
def _quiet_datasets():
    logging.getLogger("datasets").setLevel(logging.ERROR)


def _assert_exact(stack: Stack, tmp_path, save_at: int = SAVE_AT) -> list[str]:
    """Asserts the resumed run equals the reference at every step; returns the resumed run's statekit warnings."""
    die_at = save_at + DIE_AT - SAVE_AT
    reference, first, resumed = interrupted(stack, tmp_path, total=TOTAL, save_at=save_at, die_at=die_at)
    assert [s[1] for s in first.steps] == [s[1] for s in reference.steps[:die_at]]
    got = first.steps[:save_at] + resumed.steps
    assert [s[:2] for s in got] == [s[:2] for s in reference.steps], "batches"
    assert [s[2] for s in got] == [s[2] for s in reference.steps], "losses"
    for key, value in reference.weights.items():
        assert torch.equal(resumed.weights[key], value), key
    return resumed.warnings


KINDS = ["map", "augment", "iterable", "shuffled", "chain", "by_node", "interleave"]
ITERABLE = ["iterable", "shuffled", "chain", "by_node", "interleave"]

FAST = (
    [Stack(kind) for kind in KINDS]
    + [Stack(kind, set_epoch=True) for kind in ITERABLE]
    + [Stack(kind, accelerate=True) for kind in ("map", "iterable", "shuffled")]
    + [Stack("iterable", loader="stateful"), Stack("shuffled", loader="stateful")]
)
SLOW = (
    [Stack(kind, workers=2) for kind in KINDS]
    + [Stack(kind, workers=2, set_epoch=True) for kind in ("iterable", "shuffled")]
    + [Stack(kind, accelerate=True, set_epoch=True) for kind in ITERABLE]
    + [Stack(kind, loader="stateful", workers=2, accelerate=accelerate) for kind in ("augment", "shuffled", "by_node") for accelerate in (False, True)]
    + [Stack(kind, accelerate=True) for kind in ("augment", "chain", "interleave")]
)


@pytest.mark.parametrize("stack", FAST, ids=[s.id for s in FAST])
def test_resumes_exactly(tmp_path, stack):
    _assert_exact(stack, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("stack", SLOW, ids=[s.id for s in SLOW])
def test_resumes_exactly_with_workers_and_accelerate(tmp_path, stack):
    _assert_exact(stack, tmp_path)


def test_a_stream_without_set_epoch_resumes_from_its_own_state_once(tmp_path):
    """The datasets IterableDataset in a plain loop: its saved state positions the resumed
    epoch (nothing is re-read), and the later epochs start from their beginning (datasets
    would re-apply a loaded state to every later epoch: 58 % of the samples lost)."""
    messages = _assert_exact(Stack("iterable"), tmp_path)
    assert not [m for m in messages if "re-reading" in m], messages


def test_a_shuffle_buffer_is_re_read_and_said(tmp_path):
    """A shuffle buffer is not in the dataset's state: the interrupted epoch is re-read from its start, and a warning says so and why."""
    messages = _assert_exact(Stack("shuffled"), tmp_path)
    assert any(
        "loader (DataLoader over IterableDataset): resumed epoch 1 at batch 5 by re-reading and discarding 5 batches" in m
        and "its shuffle buffer (IterableDataset.shuffle(buffer_size=16)) is not part of its state_dict()" in m
        for m in messages
    ), messages


# Attaching changes nothing: the run with a manager that never saves yields the same batches
# and losses as the same run without statekit. Accelerate's use_stateful_dataloader=True builds
# the first epoch's iterator inside prepare() (DataLoaderAdapter calls
# StatefulDataLoader.state_dict()); the epoch runs on that iterator, with or without statekit.
ATTACHED = [
    Stack("map", loader="stateful"),
    Stack("map", loader="stateful", workers=2),
    Stack("augment", loader="stateful", workers=2),
    Stack("iterable", loader="stateful", workers=2),
    Stack("map", workers=2),
    Stack("map", accelerate=True),
    Stack("shuffled", accelerate=True),
    Stack("map", accelerate=True, stateful_accelerate=True),
    Stack("map", accelerate=True, stateful_accelerate=True, workers=2),
    Stack("augment", accelerate=True, stateful_accelerate=True),
    Stack("iterable", accelerate=True, stateful_accelerate=True, workers=2),
]


@pytest.mark.parametrize("stack", ATTACHED, ids=[s.id for s in ATTACHED])
def test_attaching_changes_nothing(tmp_path, stack):
    plain = run(stack, str(tmp_path / "plain"), 30, manager=False)
    attached = run(stack, str(tmp_path / "attached"), 30)
    assert attached.steps == plain.steps
    for key, value in plain.weights.items():
        assert torch.equal(attached.weights[key], value), key


# A save in the first epoch of Accelerate's stateful loader: that epoch ran on the iterator
# prepare() built, and the resumed process's prepare() builds it again with the same draws.
PREBUILT = [Stack(kind, accelerate=True, stateful_accelerate=True, workers=workers)
            for kind in ("map", "augment", "iterable") for workers in (0, 2)]


@pytest.mark.parametrize("stack", PREBUILT, ids=[s.id for s in PREBUILT])
@pytest.mark.parametrize("save_at", [5, SAVE_AT], ids=["epoch0", "epoch1"])
def test_accelerates_stateful_loader_resumes_exactly_from_its_first_epoch(tmp_path, stack, save_at):
    _assert_exact(stack, tmp_path, save_at=save_at)


# The same, each run in its own process (a restarted training script: nothing carries over
# in memory; the process that saved ends without clean-up).
IN_PROCESSES = [Stack("iterable"), Stack("shuffled", accelerate=True), Stack("map", accelerate=True, stateful_accelerate=True, workers=2)]


@pytest.mark.slow
@pytest.mark.parametrize("stack", IN_PROCESSES, ids=[s.id for s in IN_PROCESSES])
def test_resumes_exactly_in_a_fresh_process(tmp_path, stack):
    import dataclasses
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = SCRIPTS / "data_stack_run.py"
    spec = json.dumps(dataclasses.asdict(stack))

    def process(root: str, name: str, *rest: str) -> dict:
        out = tmp_path / f"{name}.json"
        done = subprocess.run([sys.executable, str(script), spec, root, str(out), *rest], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(out.read_text())

    reference = process(str(tmp_path / "reference"), "reference")
    first = process(str(tmp_path / "root"), "first", str(SAVE_AT), str(DIE_AT))
    resumed = process(str(tmp_path / "root"), "resumed", "resume")
    assert first["steps"][:SAVE_AT] + resumed["steps"] == reference["steps"]
    assert resumed["weights"] == reference["weights"]
    assert not [w for w in resumed["warnings"] if "ResumeAuditWarning" in w], resumed["warnings"]
