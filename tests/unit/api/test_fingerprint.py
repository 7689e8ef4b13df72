"""The resume fingerprint (issue 13 item 5): recorded in the manifest, compared with the
resuming run; each difference warns (or, with ``strict_resume``, raises) naming the
setting, the saved and the live value and what it does to the resume."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

import statekit
from statekit.testing import rewrite_manifest
from statekit.cli import main
from statekit.format.manifest import MANIFEST_NAME

from accelerate_helpers import TinyNet

pytest.importorskip("accelerate")


def make_run(n=100, batch_size=8, accum=1, shuffle=True, drop_last=False, num_workers=0, even_batches=True,
             mixed_precision="no"):
    """A prepared Accelerate run (fresh Accelerate state) with the settings under test."""
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import set_seed

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    set_seed(0)
    accelerator = Accelerator(
        cpu=True,
        gradient_accumulation_steps=accum,
        mixed_precision=mixed_precision,
        dataloader_config=DataLoaderConfiguration(even_batches=even_batches),
    )
    g = torch.Generator().manual_seed(99)
    dataset = torch.utils.data.TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=batch_size, shuffle=shuffle, drop_last=drop_last, num_workers=num_workers
    )
    model = TinyNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    return accelerator, model, optimizer, loader


def train(run, micro_batches):
    """``micro_batches`` micro-batches inside ``accelerator.accumulate`` (steps at sync points)."""
    accelerator, model, optimizer, loader = run
    for i, (x, y) in enumerate(loader):
        if i == micro_batches:
            break
        with accelerator.accumulate(model):
            accelerator.backward(F.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()


def saved_run(tmp_path, micro_batches=3, **settings):
    """A run trained a few batches and saved by a CheckpointManager; returns the root URL."""
    run = make_run(**settings)
    manager = statekit.CheckpointManager(run[0], str(tmp_path / "run"))
    train(run, micro_batches)
    manager.save(micro_batches)
    return str(tmp_path / "run")


def resume(root, strict_resume=False, **settings):
    """Resume a run of ``settings`` from ``root``; returns (run, fingerprint warnings)."""
    run = make_run(**settings)
    manager = statekit.CheckpointManager(run[0], root)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        manager.resume(strict_resume=strict_resume)
    return run, [str(w.message) for w in caught if issubclass(w.category, statekit.ResumeFingerprintWarning)]


def edited_copy(tmp_path, edit):
    """A root holding a copy of the checkpoint under ``tmp_path/run`` whose manifest
    ``edit(manifest)`` changed and re-sealed (a fingerprint written by another setup,
    simulated)."""
    source = next(p for p in (tmp_path / "run").iterdir() if p.name.startswith("checkpoint-"))
    copy_root = tmp_path / "edited"
    shutil.copytree(source, copy_root / source.name)
    rewrite_manifest(copy_root / source.name, edit)
    return str(copy_root)


def test_manifest_records_the_fingerprint(tmp_path):
    root = saved_run(tmp_path, accum=2, micro_batches=3)
    manifest = json.loads(next((tmp_path / "run").glob("checkpoint-*/statekit.json")).read_text())
    fp = manifest["fingerprint"]
    assert fp["world_size"] == 1 and fp["gradient_accumulation_steps"] == 2 and fp["accumulating"] is True
    assert fp["mixed_precision"] == "no"
    assert fp["dataloaders"] == {
        "dataloader_0": {"batch_size": 8, "dataset_length": 100, "drop_last": False, "even_batches": True,
                         "num_workers": 0, "sampler": "RandomSampler", "shuffle": True, "seed": None}
    }
    assert fp["versions"]["torch"] == torch.__version__ and fp["versions"]["statekit"] == statekit.__version__
    assert root


def test_identical_run_resumes_without_warning(tmp_path):
    root = saved_run(tmp_path)
    run = make_run()
    manager = statekit.CheckpointManager(run[0], root)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert manager.resume(strict_resume=True) == 3


@pytest.mark.parametrize(
    "settings, expected",
    [
        ({"batch_size": 4}, "per-device batch size 8 -> 4 (dataloader_0): the saved position counts batches of the old size"),
        ({"n": 90}, "dataset length 100 -> 90 (dataloader_0): the data position cannot be mapped; the epoch restarts"),
        ({"shuffle": False}, "shuffle True -> False (dataloader_0): the epoch's order differs"),
        ({"drop_last": True}, "drop_last False -> True (dataloader_0): the epoch's last, partial batch"),
        ({"num_workers": 2}, "num_workers 0 -> 2 (dataloader_0): batches are built in other processes"),
        ({"even_batches": False}, "even_batches True -> False (dataloader_0): the epoch's last batches are padded"),
        ({"mixed_precision": "bf16"}, "mixed precision no -> bf16: forward and backward run in another precision"),
    ],
    ids=["batch_size", "dataset_length", "shuffle", "drop_last", "num_workers", "even_batches", "precision"],
)
def test_each_difference_warns_with_saved_and_live_value(tmp_path, settings, expected):
    root = saved_run(tmp_path)
    _, messages = resume(root, **settings)
    assert any(expected in m for m in messages), messages
    assert all(m.startswith(root) for m in messages)


def test_sampler_change_names_both_classes(tmp_path):
    root = saved_run(tmp_path)
    _, messages = resume(root, shuffle=False)
    assert any("sampler RandomSampler -> SequentialSampler (dataloader_0)" in m for m in messages), messages


def test_strict_resume_raises_listing_every_difference_and_loads_nothing(tmp_path):
    root = saved_run(tmp_path)
    run = make_run(n=90, batch_size=4, shuffle=False)
    before = {k: v.clone() for k, v in run[1].state_dict().items()}
    manager = statekit.CheckpointManager(run[0], root)
    with pytest.raises(statekit.ResumeMismatchError, match=r"\(4 difference\(s\)\); nothing was loaded") as info:
        manager.resume(strict_resume=True)
    assert [d.split(" (")[0] for d in info.value.differences] == [
        "dataset length 100 -> 90", "per-device batch size 8 -> 4", "sampler RandomSampler -> SequentialSampler",
        "shuffle True -> False",
    ]
    assert all(torch.equal(before[k], v) for k, v in run[1].state_dict().items())


def test_strict_load_state_raises(tmp_path):
    run = make_run()
    train(run, 2)
    url = str(tmp_path / "ckpt")
    statekit.save_state(run[0], url)
    other = make_run(batch_size=5)
    with pytest.raises(statekit.ResumeMismatchError, match=r"per-device batch size 8 -> 5 \(dataloader_0\)"):
        statekit.load_state(other[0], url, strict_resume=True)
    with pytest.warns(statekit.ResumeFingerprintWarning, match=r"per-device batch size 8 -> 5"):
        statekit.load_state(other[0], url)


def test_accumulation_change_mid_accumulation_is_an_error_without_strict(tmp_path):
    root = saved_run(tmp_path, accum=4, micro_batches=2)  # 2 of 4 micro-batches: gradients saved mid-window
    run = make_run(accum=2)
    manager = statekit.CheckpointManager(run[0], root)
    with pytest.raises(statekit.ResumeMismatchError, match=r"gradient accumulation steps 4 -> 2: the checkpoint holds "
                       r"gradients saved mid-accumulation .* resume with gradient_accumulation_steps=4"):
        manager.resume()


def test_accumulation_change_at_an_optimizer_step_only_warns(tmp_path):
    root = saved_run(tmp_path, accum=4, micro_batches=4)  # saved at a sync point
    _, messages = resume(root, accum=2)
    assert any("gradient accumulation steps 4 -> 2: each optimizer step" in m for m in messages), messages


def test_dataset_length_change_restarts_the_epoch(tmp_path):
    root = saved_run(tmp_path, micro_batches=4)  # 4 of 13 batches consumed
    run, messages = resume(root, n=90)
    assert any("dataset length 100 -> 90" in m for m in messages)
    batches = [x for x, _ in run[3]]
    assert len(batches) == 12  # the whole epoch of the 90-sample dataset, not its last 8 batches
    seen = torch.cat(batches)
    assert seen.shape[0] == 90 and torch.unique(seen, dim=0).shape[0] == 90


def test_world_size_and_version_differences(tmp_path):
    saved_run(tmp_path)

    def edit(manifest):
        manifest["fingerprint"]["world_size"] = 2
        manifest["fingerprint"]["versions"]["torch"] = "2.12.0"

    root = edited_copy(tmp_path, edit)
    _, messages = resume(root)
    assert any("world size 2 -> 1: the data position is remapped to the new world size (elastic resume)" in m
               for m in messages), messages
    assert any(f"torch 2.12.0 -> {torch.__version__}: kernels may differ, losses may not match bit for bit" in m
               for m in messages), messages
    # strict: the world size is refused, the version only warned
    run = make_run()
    manager = statekit.CheckpointManager(run[0], root)
    with pytest.warns(statekit.ResumeFingerprintWarning, match="torch 2.12.0"):
        with pytest.raises(statekit.ResumeMismatchError, match=r"1 difference\(s\)") as info:
            manager.resume(strict_resume=True)
    assert info.value.differences == [
        "world size 2 -> 1: the data position is remapped to the new world size (elastic resume)"
    ]


def test_version_difference_alone_never_raises(tmp_path):
    saved_run(tmp_path)
    root = edited_copy(tmp_path, lambda manifest: manifest["fingerprint"]["versions"].update(accelerate="0.99.0"))
    run = make_run()
    with pytest.warns(statekit.ResumeFingerprintWarning, match=r"accelerate 0\.99\.0 -> "):
        assert statekit.CheckpointManager(run[0], root).resume(strict_resume=True) == 3


def test_checkpoint_without_fingerprint_resumes_silently(tmp_path):
    saved_run(tmp_path)
    root = edited_copy(tmp_path, lambda manifest: manifest.pop("fingerprint"))  # written before fingerprints existed
    run = make_run(batch_size=4)  # differs, but an old checkpoint has nothing to compare
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert statekit.CheckpointManager(run[0], root).resume(strict_resume=True) == 3


def test_a_loader_setting_a_newer_writer_adds_is_ignored_and_a_malformed_loader_is_named(tmp_path):
    """The fingerprint is compared field by field: a loader setting this version does not
    know (a newer minor writer's) is ignored, not compared (no effect is known for it); a loader entry
    that is not an object is a CorruptCheckpointError naming it, not a silent skip."""
    saved_run(tmp_path)
    root = edited_copy(tmp_path, lambda m: m["fingerprint"]["dataloaders"]["dataloader_0"].update(prefetch=4))
    manifest = statekit.verify(str(next(p for p in (tmp_path / "edited").iterdir())))
    loader = manifest.fingerprint.dataloaders["dataloader_0"]
    assert loader.batch_size == 8 and not hasattr(loader, "prefetch")
    assert "prefetch" not in manifest.fingerprint.to_json()["dataloaders"]["dataloader_0"]
    run, warned = resume(root)
    assert warned == []
    shutil.rmtree(tmp_path / "edited")
    root = edited_copy(tmp_path, lambda m: m["fingerprint"]["dataloaders"].update(dataloader_0=[8, 100]))
    with pytest.raises(statekit.CorruptCheckpointError, match=r"fingerprint.*data loader 'dataloader_0' that is not an object"):
        resume(root)


def test_mapping_api_compares_training_state_only(tmp_path):
    model = torch.nn.Linear(2, 2)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(20.0)), batch_size=4, shuffle=True)
    url = str(tmp_path / "ckpt")
    statekit.save(url, {"model": model, "optim": optim, "loader": loader})
    other = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(18.0)), batch_size=4, shuffle=True)
    with pytest.raises(statekit.ResumeMismatchError, match=r"dataset length 20 -> 18 \(loader\)"):
        statekit.load(url, {"model": model, "optim": optim, "loader": other}, strict_resume=True)
    with warnings.catch_warnings():  # weights alone: not a resume, not compared
        warnings.simplefilter("error")
        statekit.load(url, {"model": model})


def test_attach_mode_records_and_compares(tmp_path):
    run = make_run()
    statekit.attach(run[0])
    train(run, 2)
    url = tmp_path / "acc"
    run[0].save_state(str(url))
    fp = json.loads((url / MANIFEST_NAME).read_text())["fingerprint"]
    assert fp["dataloaders"]["dataloader_0"]["batch_size"] == 8 and "torch" in fp["rng"]
    other = make_run(batch_size=4)
    statekit.attach(other[0])
    with pytest.warns(statekit.ResumeFingerprintWarning, match=r"per-device batch size 8 -> 4 \(dataloader_0\)"):
        other[0].load_state(str(url))


def test_inspect_shows_the_fingerprint(tmp_path):
    saved_run(tmp_path)
    checkpoint = next((tmp_path / "run").glob("checkpoint-*"))
    text = CliRunner().invoke(main, ["inspect", str(checkpoint)], catch_exceptions=False).output
    assert "fingerprint world size 1, gradient accumulation steps 1, mixed precision no" in text
    assert "dataloader_0: dataset length 100, per-device batch size 8, sampler RandomSampler, shuffle True" in text
    assert f"torch {torch.__version__}" in text
    manifest = json.loads(CliRunner().invoke(main, ["inspect", str(checkpoint), "--json"]).output)
    assert manifest["fingerprint"]["dataloaders"]["dataloader_0"]["dataset_length"] == 100


def test_rng_kinds_saved_but_not_restored_here(tmp_path):
    from statekit.hooks.registry import build_plugin_manager, use_plugin_manager

    model = torch.nn.Linear(2, 2)
    state = {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)}
    url = str(tmp_path / "ckpt")
    with use_plugin_manager(build_plugin_manager(autoload=True)):  # statekit-rng saves the random states
        saved = statekit.save(url, state)
    assert saved.fingerprint.rng == ("numpy", "python", "torch")
    with use_plugin_manager(build_plugin_manager(autoload=False)):  # no plugin restores them
        with pytest.warns(statekit.ResumeFingerprintWarning, match=r"RNG state numpy, python, torch -> none: the saved "
                          r"numpy, python, torch random state is not restored here"):
            statekit.load(url, state)
