"""``statekit convert`` of an Accelerate directory resumes exactly as its source: the run
continued from the converted checkpoint and from the source folder match bit for bit
(plain Accelerate folders, StatefulDataLoader folders, folders saved with statekit
attached, with ``statekit.load_state`` and ``CheckpointManager.resume()``)."""

from __future__ import annotations

import contextlib
import shutil

import pytest
import torch
from click.testing import CliRunner

import statekit
import statekit.foreign.accelerate_convert
from statekit.cli import main as cli
from statekit.testing import assert_state_equal

from accelerate_helpers import build, train_micro_batches, train_steps

pytest.importorskip("accelerate")

SAVE_AT, AFTER = 3, 6  # the save is inside the loop after 3 steps; 6 steps follow it


def _run(seed: int, *, attached: bool, stateful: bool = False, accum: int = 1):
    run = build(seed=seed, stateful=stateful, accum=accum)
    if attached:
        statekit.attach(run[0])
    return run


def _source(tmp_path, *, attached: bool, stateful: bool = False) -> tuple[str, list[float]]:
    """An Accelerate folder saved by ``accelerator.save_state`` mid-epoch; returns it and the
    losses of the uninterrupted run after the save."""
    run = _run(1, attached=attached, stateful=stateful)
    folder = str(tmp_path / "accelerate")
    losses = train_steps(run, SAVE_AT + AFTER, on_step=lambda step: step == SAVE_AT and run[0].save_state(folder))
    return folder, losses[SAVE_AT:]


def _convert(folder: str, out: str) -> None:
    result = CliRunner().invoke(cli, ["convert", folder, out, "--allow-pickle"])
    assert result.exit_code == 0, result.output


def _continued(run) -> tuple[list[float], dict, dict]:
    losses = train_steps(run, AFTER, start=SAVE_AT)
    return losses, {k: v.clone() for k, v in run[1].state_dict().items()}, run[2].state_dict()


def _assert_same(a, b) -> None:
    assert a[0] == b[0]  # losses, bit for bit
    assert_state_equal(a[1], b[1])
    assert_state_equal(a[2], b[2])


@pytest.mark.parametrize("stateful", [False, True], ids=["DataLoader", "StatefulDataLoader"])
def test_plain_accelerate_folder_converts_and_resumes_as_the_source(tmp_path, stateful, installed_plugin_manager):
    folder, _ = _source(tmp_path, attached=False, stateful=stateful)
    out = str(tmp_path / "converted")
    _convert(folder, out)

    from_source = _run(7, attached=False, stateful=stateful)
    statekit.load_state(from_source[0], folder, allow_pickle=True)
    expected = _continued(from_source)

    from_converted = _run(8, attached=False, stateful=stateful)
    if stateful:
        statekit.load_state(from_converted[0], out)
    else:  # plain Accelerate kept no position for the loader: said, and left as the source load leaves it
        with pytest.warns(statekit.StatekitWarning, match=r"converted from an Accelerate directory that saved no state for dataloader_0"):
            statekit.load_state(from_converted[0], out)
    _assert_same(_continued(from_converted), expected)

    root = tmp_path / "root"
    shutil.copytree(out, root / "checkpoint-00000003")
    by_manager = _run(9, attached=False, stateful=stateful)
    said = pytest.warns(statekit.StatekitWarning, match="dataloader_0") if not stateful else contextlib.nullcontext()
    with said:
        assert statekit.CheckpointManager(by_manager[0], str(root)).resume() == SAVE_AT
    _assert_same(_continued(by_manager), expected)


def test_attach_mode_folder_keeps_loader_position_and_rng(tmp_path, installed_plugin_manager):
    folder, uninterrupted = _source(tmp_path, attached=True)
    out = str(tmp_path / "converted")
    _convert(folder, out)
    manifest = statekit.verify(out)
    assert {"dataloader_0", "model_0", "optimizer_0"} <= set(manifest.objects)
    assert any(rel.startswith("rng/") for rel in manifest.files)  # statekit-rng's generators came along

    from_source = _run(7, attached=True)
    from_source[0].load_state(folder)  # the attached Accelerator.load_state
    expected = _continued(from_source)
    assert expected[0] == uninterrupted  # the source resumes exactly...

    from_converted = _run(8, attached=True)
    statekit.load_state(from_converted[0], out)
    _assert_same(_continued(from_converted), expected)  # ...and so does the converted checkpoint

    root = tmp_path / "root"
    shutil.copytree(out, root / "checkpoint-00000003")
    by_manager = _run(9, attached=True)
    assert statekit.CheckpointManager(by_manager[0], str(root)).resume() == SAVE_AT
    _assert_same(_continued(by_manager), expected)


def test_attach_mode_folder_mid_accumulation_keeps_the_gradients(tmp_path, installed_plugin_manager):
    run = _run(1, attached=True, accum=2)
    folder = str(tmp_path / "accelerate")
    reference = train_micro_batches(run, 9, on_step=lambda done: done == 3 and run[0].save_state(folder))[3:]
    out = str(tmp_path / "converted")
    _convert(folder, out)
    assert "gradients" in statekit.verify(out).objects

    resumed = _run(8, attached=True, accum=2)
    statekit.load_state(resumed[0], out)
    assert train_micro_batches(resumed, 6, start=3) == reference


def test_damaged_attach_mode_file_is_named_and_nothing_committed(tmp_path, installed_plugin_manager):
    folder, _ = _source(tmp_path, attached=True)
    position = tmp_path / "accelerate" / "dataloader_0" / "rank-00000.json"
    data = bytearray(position.read_bytes())
    data[-3] ^= 1  # same size, other bytes
    position.write_bytes(bytes(data))
    out = tmp_path / "converted"
    with pytest.raises(statekit.CorruptCheckpointError, match=r"dataloader_0/rank-00000\.json: checksum .* nothing was converted"):
        statekit.foreign.accelerate_convert.convert(folder, str(out), allow_pickle=True)
    assert not (out / "statekit.json").exists()


def test_a_plain_accelerate_folder_converts_with_a_state_digest_of_its_files(tmp_path, installed_plugin_manager,
                                                                              monkeypatch):
    """Plain Accelerate records no state digest; the conversion digests what its files hold,
    so a load of the converted checkpoint is state-checked: a load path that loses the
    optimizer's moments is named."""
    folder, _ = _source(tmp_path, attached=False, stateful=True)
    out = str(tmp_path / "converted")
    _convert(folder, out)
    digest = statekit.verify(out).state_digest
    model = _run(7, attached=False, stateful=True)[1]
    assert set(digest.objects["model_0"]) == set(model.state_dict())
    assert {p for p in digest.objects["optimizer_0"] if p.endswith(("exp_avg", "exp_avg_sq"))}

    original = torch.optim.Optimizer.load_state_dict

    def drops_moments(self, state_dict):
        original(self, state_dict)
        for state in self.state.values():
            state["exp_avg"].zero_()

    monkeypatch.setattr(torch.optim.AdamW, "load_state_dict", drops_moments, raising=False)
    with pytest.warns(statekit.StateCheckWarning, match=r"optimizer 'optimizer_0': exp_avg of '[^']+' is all zeros"):
        statekit.load_state(_run(8, attached=False, stateful=True)[0], out)
