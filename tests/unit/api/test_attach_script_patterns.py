"""Attach mode under the code of the training scripts users run, as those scripts write it.

Each test follows a named upstream script (huggingface/diffusers 58eb52c0803e, 2026-08-23;
huggingface/transformers and huggingface/accelerate examples) in the behaviour that matters
to a checkpoint: the save/load pre-hook bodies (``weights.pop()`` after ``save_pretrained``,
``models.pop()`` before ``from_pretrained``, ``is_main_process`` guards), the resume
arithmetic and the loop's own skip of consumed batches, random draws in the loop. The model
is a small ``torch.nn.Linear`` stack; the hooks save it with ``torch.save``/``safetensors``
where the scripts call ``save_pretrained`` (the diffusers plugin's own tests run the real
diffusers models: plugins/statekit-diffusers/tests/unit/test_script_hooks.py).
"""

from __future__ import annotations

import logging
import os
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

import statekit
from statekit.testing import assert_state_equal

from accelerate_helpers import fresh_accelerator

pytest.importorskip("accelerate")

STEPS_PER_EPOCH = 6  # 12 samples, batch size 2


def _run(seed: int = 0, attach: str | None = "init", accum: int = 1, before_prepare=None):
    """A run as the scripts build it: Accelerator, hooks (``before_prepare(accelerator)``),
    model, optimizer, a shuffled loader, ``prepare``; statekit attached after ``Accelerator()``
    (``"init"``) or after ``prepare()`` (``"prepare"``)."""
    accelerator = fresh_accelerator(accum=accum)
    if attach == "init":
        statekit.attach(accelerator)
    if before_prepare is not None:
        before_prepare(accelerator)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.25), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1234)  # the same dataset in every run
    data = torch.utils.data.TensorDataset(torch.randn(12, 4, generator=g), torch.randn(12, 1, generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=2, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if attach == "prepare":
        statekit.attach(accelerator)
    return accelerator, model, optimizer, loader


def _unet_style_hooks(accelerator, model_cls_folder: str = "unet", pop_guard: bool = False, main_only: bool = True):
    """diffusers' train_unconditional.py / train_text_to_image.py hooks: the model saved in its
    own folder, its ``weights`` entry popped; loaded back after ``models.pop()``.
    ``pop_guard``: the ``if weights: weights.pop()`` of newer scripts (train_controlnet.py)."""
    saved_by_hook: list[str] = []

    def save_model_hook(models, weights, output_dir):
        if accelerator.is_main_process or not main_only:
            for i, model in enumerate(models):
                folder = os.path.join(output_dir, model_cls_folder if i == 0 else f"{model_cls_folder}_{i}")
                os.makedirs(folder, exist_ok=True)
                save_file(accelerator.unwrap_model(model).state_dict(), os.path.join(folder, "model.safetensors"))
                saved_by_hook.append(folder)
                if pop_guard:
                    if weights:
                        weights.pop()
                else:
                    weights.pop()  # make sure to pop weight so that corresponding model is not saved again

    def load_model_hook(models, input_dir):
        for i in range(len(models)):
            model = models.pop()  # pop models so that they are not loaded again
            state = load_file(os.path.join(input_dir, model_cls_folder, "model.safetensors"))
            accelerator.unwrap_model(model).load_state_dict(state)

    accelerator.register_save_state_pre_hook(save_model_hook)
    accelerator.register_load_state_pre_hook(load_model_hook)
    return saved_by_hook


def _step(accelerator, model, optimizer, batch):
    x, y = batch
    noise = torch.randn_like(x)  # the scripts draw noise and timesteps from the global RNG
    with accelerator.accumulate(model):
        loss = torch.nn.functional.mse_loss(model(x + 0.1 * noise), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return loss.detach().item()


# --------------------------------------------------------------------------- item 2: the hook contract


@pytest.mark.parametrize("where", ["init", "prepare"])
@pytest.mark.parametrize("guard", [False, True], ids=["pop", "if-weights-pop"])
def test_user_hooks_get_accelerates_lists_and_their_layout_is_the_checkpoints(tmp_path, where, guard, installed_plugin_manager):
    """The IndexError of issue 44: statekit's hook ran first and left ``weights`` shorter than
    ``models``; the script's ``for model in models: ...; weights.pop()`` popped an empty list.
    The scripts register their hooks before ``prepare()``; attach comes before or after them."""
    seen: list[tuple[int, int]] = []
    saved: list[str] = []

    def hooks(accelerator):
        accelerator.register_save_state_pre_hook(lambda models, weights, out: seen.append((len(models), len(weights))))
        saved.append(_unet_style_hooks(accelerator, pop_guard=guard))

    accelerator, model, optimizer, loader = _run(attach=where, before_prepare=hooks)
    _step(accelerator, model, optimizer, next(iter(loader)))
    accelerator.save_state(str(tmp_path / "checkpoint-1"))
    assert seen == [(1, 1)]  # what Accelerate hands every hook: one model, its weights
    assert saved[0] == [str(tmp_path / "checkpoint-1" / "unet")]
    files = os.listdir(tmp_path / "checkpoint-1")
    assert "model.safetensors" not in files  # Accelerate did not write it a second time
    manifest = statekit.verify(str(tmp_path / "checkpoint-1"))
    assert manifest.objects["model_0"].owner == "accelerate-hooks"
    assert "unet/model.safetensors" in manifest.files  # the hook's file is checksummed too
    assert manifest.step == 1

    expected = {k: v.clone() for k, v in model.state_dict().items()}
    accelerator2, model2, optimizer2, loader2 = _run(seed=1, attach=where, before_prepare=lambda a: _unet_style_hooks(a, pop_guard=guard))
    accelerator2.load_state(str(tmp_path / "checkpoint-1"))
    assert_state_equal(model2.state_dict(), expected)
    assert_state_equal(optimizer2.state_dict()["state"], optimizer.state_dict()["state"])


def test_hooks_registered_after_attach_still_run_before_statekits(tmp_path, installed_plugin_manager):
    accelerator, model, optimizer, loader = _run()  # attached right after Accelerator()
    _unet_style_hooks(accelerator)  # registered afterwards
    accelerator.save_state(str(tmp_path / "checkpoint-0"))
    assert statekit.verify(str(tmp_path / "checkpoint-0")).objects["model_0"].owner == "accelerate-hooks"


def test_a_user_saved_model_without_a_load_hook_is_named_before_anything_loads(tmp_path, installed_plugin_manager):
    accelerator, model, optimizer, loader = _run()
    _unet_style_hooks(accelerator)
    accelerator.save_state(str(tmp_path / "checkpoint-0"))
    accelerator2, model2, optimizer2, loader2 = _run(seed=1)
    before = {k: v.clone() for k, v in model2.state_dict().items()}
    with pytest.raises(statekit.PluginError, match=r"model_0 was saved by a function registered with .*register_load_state_pre_hook"):
        accelerator2.load_state(str(tmp_path / "checkpoint-0"))
    assert_state_equal(model2.state_dict(), before)


# --------------------------------------------------------------------------- item 3: random state at Accelerate's moment


def _drawing_save_hook(accelerator):
    """Like ``EMAModel.save_pretrained`` in train_text_to_image.py --use_ema: the hook builds
    a throw-away model (``model_cls.from_config``), whose initialisation draws from the global RNG."""

    def save_model_hook(models, weights, output_dir):
        if accelerator.is_main_process:
            torch.nn.Linear(64, 64)  # kaiming init: draws
            torch.rand(3)

    accelerator.register_save_state_pre_hook(save_model_hook)


@pytest.mark.parametrize("rng_plugin", [True, False], ids=["statekit-rng", "accelerate-rng"])
def test_a_save_hook_that_draws_random_numbers_changes_nothing_of_the_resume(tmp_path, rng_plugin, installed_plugin_manager, monkeypatch):
    if not rng_plugin:
        installed_plugin_manager.set_blocked("rng")
    accelerator, model, optimizer, loader = _run()
    _drawing_save_hook(accelerator)
    batches = iter(loader)
    _step(accelerator, model, optimizer, next(batches))
    accelerator.save_state(str(tmp_path / "checkpoint-1"))
    reference = [_step(accelerator, model, optimizer, b) for b in batches]  # the uninterrupted run goes on

    accelerator2, model2, optimizer2, loader2 = _run(seed=1)
    _drawing_save_hook(accelerator2)
    accelerator2.load_state(str(tmp_path / "checkpoint-1"))  # pytest errors on any StateCheckWarning
    resumed = [_step(accelerator2, model2, optimizer2, b) for b in loader2]
    assert resumed == reference
    assert_state_equal(model2.state_dict(), model.state_dict())


def test_a_restored_random_state_other_than_the_saved_runs_is_named(tmp_path, installed_plugin_manager, monkeypatch):
    """The live-state check compares the generators after the load with the state the saved
    run continued with: a plugin (here statekit-rng made faulty) restoring another is named."""
    import statekit_rng.plugin

    accelerator, model, optimizer, loader = _run()
    accelerator.save_state(str(tmp_path / "checkpoint-0"))
    restore = statekit_rng.plugin.restore

    def restore_then_draw(*args, **kwargs):
        out = restore(*args, **kwargs)
        torch.rand(1)  # a draw after the restore: the state is no longer the saved run's
        return out

    monkeypatch.setattr(statekit_rng.plugin, "restore", restore_then_draw)
    accelerator2, model2, optimizer2, loader2 = _run(seed=1)
    with pytest.warns(statekit.StateCheckWarning, match=r"random state after the load differs .*\(torch generator\)"):
        accelerator2.load_state(str(tmp_path / "checkpoint-0"))


# --------------------------------------------------------------------------- item 4: no double skip


def _unconditional_loop(accelerator, model, optimizer, loader, first_epoch, resume_step, resumed, losses, epochs=2,
                        wrap=lambda it: it):
    """train_unconditional.py's loop: ``for step, batch in enumerate(train_dataloader)``, the
    consumed batches of the resumed epoch skipped with ``continue``."""
    for epoch in range(first_epoch, epochs):
        for step, batch in enumerate(wrap(loader)):
            # Skip steps until we reach the resumed step
            if resumed and epoch == first_epoch and step < resume_step:
                continue
            losses.append((epoch, step, _step(accelerator, model, optimizer, batch)))


def _tqdm_like(iterable):
    for item in iterable:  # a progress bar's generator between the loader and the loop
        yield item


@pytest.mark.parametrize("wrap", [lambda it: it, _tqdm_like], ids=["plain", "progress-bar"])
def test_a_loop_that_skips_consumed_batches_itself_resumes_exactly(tmp_path, wrap, installed_plugin_manager, caplog):
    """The zero-step resume of issue 44: the loader already continued after the consumed
    batches, and train_unconditional.py skipped ``resume_step`` more."""
    global_step_at_save = 4
    accelerator, model, optimizer, loader = _run()
    reference: list = []
    for epoch in range(2):
        for step, batch in enumerate(loader):
            reference.append((epoch, step, _step(accelerator, model, optimizer, batch)))
            if epoch == 0 and step + 1 == global_step_at_save:
                accelerator.save_state(str(tmp_path / f"checkpoint-{global_step_at_save}"))
    final = {k: v.clone() for k, v in model.state_dict().items()}

    accelerator2, model2, optimizer2, loader2 = _run(seed=1)
    path = sorted(os.listdir(tmp_path), key=lambda x: int(x.split("-")[1]))[-1]  # --resume_from_checkpoint latest
    accelerator2.load_state(str(tmp_path / path))
    global_step = int(path.split("-")[1])
    first_epoch, resume_step = global_step // STEPS_PER_EPOCH, global_step % STEPS_PER_EPOCH
    losses: list = []
    with warnings.catch_warnings(), caplog.at_level(logging.INFO, logger="statekit"):
        warnings.simplefilter("error", statekit.StatekitWarning)
        _unconditional_loop(accelerator2, model2, optimizer2, loader2, first_epoch, resume_step, True, losses, wrap=wrap)
    assert losses == reference[global_step_at_save:]  # same batches, same enumerate index, same numbers
    assert_state_equal(model2.state_dict(), final)
    assert "skipped the 4 batches consumed before the checkpoint itself" in caplog.text


def test_a_loop_without_its_own_skip_and_a_collecting_loop_are_not_held(tmp_path, installed_plugin_manager):
    accelerator, model, optimizer, loader = _run()
    batches = iter(loader)
    for _ in range(3):
        _step(accelerator, model, optimizer, next(batches))
    accelerator.save_state(str(tmp_path / "checkpoint-3"))
    rest = [b[0].clone() for b in batches]

    for collect in (True, False):
        accelerator2, model2, optimizer2, loader2 = _run(seed=1)
        accelerator2.load_state(str(tmp_path / "checkpoint-3"))
        with warnings.catch_warnings():
            warnings.simplefilter("error", statekit.StatekitWarning)
            if collect:
                got = [b[0] for b in list(loader2)]
            else:
                got = []
                for batch in loader2:
                    got.append(batch[0])
                    _step(accelerator2, model2, optimizer2, batch)
        assert len(got) == len(rest) and all(torch.equal(a, b) for a, b in zip(got, rest)), collect


def test_a_loop_skipping_more_than_the_checkpoint_consumed_is_warned(tmp_path, installed_plugin_manager):
    """A script whose resume arithmetic overshoots (here: it thinks 5 batches were consumed,
    the checkpoint consumed 2): never a silent short run."""
    accelerator, model, optimizer, loader = _run()
    batches = iter(loader)
    for _ in range(2):
        _step(accelerator, model, optimizer, next(batches))
    accelerator.save_state(str(tmp_path / "checkpoint-2"))
    accelerator2, model2, optimizer2, loader2 = _run(seed=1)
    accelerator2.load_state(str(tmp_path / "checkpoint-2"))
    losses: list = []
    with pytest.warns(statekit.StatekitWarning, match=r"skipped 3 batches of epoch 0 without training .* had consumed 2"):
        _unconditional_loop(accelerator2, model2, optimizer2, loader2, 0, 5, True, losses, epochs=1)
    assert [step for _, step, _ in losses] == [5]  # the loop's own choice, named: batches 2..4 were not trained


def test_skip_first_batches_of_zero_after_a_resume_at_an_epoch_start_is_exact(tmp_path, installed_plugin_manager):
    """Accelerate's examples/complete_nlp_example.py: ``resume_step`` is 0 for a checkpoint saved
    after an epoch's last batch, and ``skip_first_batches(train_dataloader, 0)`` is still called;
    Accelerate's copy of the loader never applied the restored position (another order, and
    the resume audit never ran)."""
    accelerator, model, optimizer, loader = _run()
    for batch in loader:
        _step(accelerator, model, optimizer, batch)
    accelerator.save_state(str(tmp_path / "epoch_0"))
    reference = [_step(accelerator, model, optimizer, b) for b in loader]

    accelerator2, model2, optimizer2, loader2 = _run(seed=1)
    accelerator2.load_state(str(tmp_path / "epoch_0"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", statekit.StatekitWarning)
        active = accelerator2.skip_first_batches(loader2, 0)
        assert active is loader2
        assert [_step(accelerator2, model2, optimizer2, b) for b in active] == reference


# --------------------------------------------------------------------------- item 5: checksums on every attached load


@pytest.mark.parametrize("victim", ["model.safetensors", "unet/model.safetensors", "rng", "dataloader_0"])
def test_a_flipped_byte_in_any_listed_file_is_refused_before_anything_changes(tmp_path, victim, installed_plugin_manager):
    accelerator, model, optimizer, loader = _run()
    if victim.startswith("unet/"):
        _unet_style_hooks(accelerator)
    _step(accelerator, model, optimizer, next(iter(loader)))
    folder = tmp_path / "checkpoint-1"
    accelerator.save_state(str(folder))
    if victim in ("rng", "dataloader_0"):
        path = next(p for p in sorted((folder / victim).iterdir()) if p.suffix == ".json")
    else:
        path = folder / victim
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # same size: only the checksum tells
    path.write_bytes(bytes(raw))

    accelerator2, model2, optimizer2, loader2 = _run(seed=1)
    if victim.startswith("unet/"):
        _unet_style_hooks(accelerator2)
    before = {k: v.clone() for k, v in model2.state_dict().items()}
    with pytest.raises(statekit.CorruptCheckpointError, match="checksum") as info:
        accelerator2.load_state(str(folder))
    assert os.path.basename(str(path)) in str(info.value)
    assert_state_equal(model2.state_dict(), before)  # nothing was loaded


# --------------------------------------------------------------------------- item 6: an evaluation loader


def test_an_evaluation_loader_iterated_at_epoch_end_raises_no_audit_warning(tmp_path, installed_plugin_manager):
    """transformers' run_clm_no_trainer.py: ``eval_dataloader`` is prepared with the training
    loader and iterated only after each epoch; a resume mid-epoch, then the next save before
    that epoch's end, is exact and must not warn that its position was never consumed."""

    def run(seed):
        accelerator, model, optimizer, loader = _run(seed)
        eval_loader = accelerator.prepare(torch.utils.data.DataLoader(torch.randn(4, 4), batch_size=2))
        return accelerator, model, optimizer, loader, eval_loader

    accelerator, model, optimizer, loader, eval_loader = run(0)
    for _ in eval_loader:  # epoch 0 done before: the eval pass ran
        pass
    batches = iter(loader)
    _step(accelerator, model, optimizer, next(batches))
    accelerator.save_state(str(tmp_path / "step_1"))

    accelerator2, model2, optimizer2, loader2, eval2 = run(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", statekit.StatekitWarning)
        accelerator2.load_state(str(tmp_path / "step_1"))
        it = iter(loader2)
        _step(accelerator2, model2, optimizer2, next(it))
        accelerator2.save_state(str(tmp_path / "step_2"))
    audit = statekit.verify(str(tmp_path / "step_2")).resume_audit
    assert audit.loaders["dataloader_0"]["verdict"] == "verified"
    assert audit.loaders["dataloader_1"]["verdict"] != "diverged"


# --------------------------------------------------------------------------- the step an attached manifest records


def test_attached_manifests_record_the_checkpoints_step(tmp_path, installed_plugin_manager):
    """train_unconditional.py saves checkpoint-<global_step>; Accelerator.step counts micro-steps
    within an epoch (it recorded 0, 3, 0 for checkpoints 6, 9, 12)."""
    accelerator, model, optimizer, loader = _run(accum=2)
    global_step, saved = 0, {}
    for epoch in range(2):
        for batch in loader:
            _step(accelerator, model, optimizer, batch)
            if accelerator.sync_gradients:
                global_step += 1
                if global_step % 2 == 0:
                    accelerator.save_state(str(tmp_path / f"checkpoint-{global_step}"))
                    accelerator.save_state(str(tmp_path / f"epoch_{epoch}_{global_step}"))
                    saved[global_step] = epoch
    assert sorted(saved) == [2, 4, 6]
    for step, epoch in saved.items():
        assert statekit.verify(str(tmp_path / f"checkpoint-{step}")).step == step
        assert statekit.verify(str(tmp_path / f"epoch_{epoch}_{step}")).step == step  # optimizer steps counted


def test_saving_again_into_a_checkpoint_folder_does_not_list_its_old_next_batch_record(tmp_path):
    """textual_inversion.py resumed from an older checkpoint (and complete_nlp_example.py's step
    names after a resume) save into a folder that holds a committed checkpoint: the previous
    save's next-batch record (written after its commit, beside it) must not be listed in the
    new manifest, or the record rewritten after the new commit fails every later load."""
    accelerator, model, optimizer, loader = _run()
    folder = str(tmp_path / "checkpoint-6")
    for epoch in range(2):
        for step, (x, y) in enumerate(loader):
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            if step == STEPS_PER_EPOCH - 1:  # an epoch's last batch: the record is written at the next batch
                accelerator.save_state(folder)
    assert os.path.isdir(os.path.join(folder, "next-batch")), "the first save's record was written after its commit"
    manifest = statekit.verify(folder)
    assert not any(rel.startswith("next-batch/") for rel in manifest.files), sorted(manifest.files)
    resumed, *_ = _run(seed=1)
    resumed.load_state(folder)  # loads, every listed file verified


def test_attaching_to_resume_a_checkpoint_written_without_statekit_says_so(tmp_path):
    """The migration case (complete_nlp_example.py's step_8, saved before statekit was added):
    attach, then the script's own load_state of a mid-epoch Accelerate folder. Its loader
    position was never saved, so the resume is Accelerate's, not exact: a named warning, and
    no file of statekit's is read from a folder no manifest verifies."""
    accelerator, model, optimizer, loader = _run(attach=None)
    for step, (x, y) in enumerate(loader):
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        if step == 2:
            accelerator.save_state(str(tmp_path / "step_3"))
            break
    assert not (tmp_path / "step_3" / "statekit.json").exists()
    resumed, *_ = _run(seed=1, attach="prepare")
    with pytest.warns(statekit.StatekitWarning, match=r"step_3 holds no statekit\.json: it was written without statekit"):
        resumed.load_state(str(tmp_path / "step_3"))
