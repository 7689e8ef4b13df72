"""A Trainer run killed after a checkpoint and resumed with ``train(resume_from_checkpoint=...)``
continues exactly: every micro-batch's loss and the final weights equal the uninterrupted run's.

The run (tests/trainer_runs.py): GPT-2 with dropout, a shuffled dataset, gradient
accumulation 2, warm-up + cosine, and a masked-LM collator drawing random masks; 5 optimizer
steps per epoch, a checkpoint every 3 steps.
"""

from __future__ import annotations

import os

import pytest
import torch

import trainer_runs as tr


def assert_continues(reference, resumed, from_step):
    expected = [entry for entry in reference.losses if entry[0] >= from_step]
    assert resumed.losses == expected
    assert resumed.weights.keys() == reference.weights.keys()
    for name, value in reference.weights.items():
        assert torch.equal(resumed.weights[name], value), name


@pytest.mark.parametrize(
    "stop_at, resumed_from",
    [(8, 6), (4, 3), (12, 9)],
    ids=["mid-epoch", "first-epoch", "killed-before-its-save"],
)
def test_resume_true_continues_exactly(tmp_path, reference, stop_at, resumed_from):
    """Killed at ``stop_at``; ``resume_from_checkpoint=True`` takes the newest checkpoint."""
    tr.run(str(tmp_path), stop_at=stop_at)
    resumed = tr.run(str(tmp_path), resume=True)
    assert_continues(reference, resumed, resumed_from)


def test_resume_at_an_epoch_end(tmp_path):
    """A checkpoint at an epoch's last step (step 5 of 5) resumes at the next epoch's start."""
    reference = tr.run(str(tmp_path / "ref"), save_steps=5)
    tr.run(str(tmp_path / "run"), stop_at=7, save_steps=5)
    resumed = tr.run(str(tmp_path / "run"), resume=True, save_steps=5)
    assert_continues(reference, resumed, 5)


def test_resume_from_a_path(tmp_path, reference):
    """An older checkpoint named by path: the run continues from it, as the reference did."""
    tr.run(str(tmp_path), stop_at=10)
    resumed = tr.run(str(tmp_path), resume=str(tmp_path / "checkpoint-3"))
    assert_continues(reference, resumed, 3)


def test_resume_with_async_saves(tmp_path, reference):
    """``statekit_options={"async_save": True}``: checkpoints written in the background resume exactly."""
    tr.run(str(tmp_path), stop_at=8, statekit_options={"async_save": True})
    resumed = tr.run(str(tmp_path), resume=True, statekit_options={"async_save": True})
    assert_continues(reference, resumed, 6)


def test_resume_with_two_dataloader_workers(tmp_path):
    """Worker processes (``dataloader_num_workers=2``): the collator runs in the workers."""
    reference = tr.run(str(tmp_path / "ref"), dataloader_num_workers=2)
    tr.run(str(tmp_path / "run"), stop_at=8, dataloader_num_workers=2)
    resumed = tr.run(str(tmp_path / "run"), resume=True, dataloader_num_workers=2)
    assert_continues(reference, resumed, 6)


def test_attaching_changes_nothing(tmp_path, reference):
    """The same run with transformers' own Trainer: the same losses and weights, bit for bit."""
    plain = tr.run(str(tmp_path), plain=True)
    assert plain.losses == reference.losses
    for name, value in reference.weights.items():
        assert torch.equal(plain.weights[name], value), name


def test_a_frozen_tied_embedding(tmp_path):
    """GPT-2 with its (tied) embedding frozen: exact resume, the tie kept."""
    reference = tr.run(str(tmp_path / "ref"), model=tr.gpt2(frozen_embedding=True))
    tr.run(str(tmp_path / "run"), stop_at=8, model=tr.gpt2(frozen_embedding=True))
    resumed = tr.run(str(tmp_path / "run"), resume=True, model=tr.gpt2(frozen_embedding=True))
    assert_continues(reference, resumed, 6)
    model = resumed.trainer.model
    assert model.lm_head.weight is model.transformer.wte.weight


def test_lora_via_peft(tmp_path):
    """A peft LoRA model: only the adapter is in the checkpoint (as with Trainer), and the resume is exact."""
    peft = pytest.importorskip("peft")

    def lora():
        torch.manual_seed(3)
        return peft.get_peft_model(tr.gpt2(), peft.LoraConfig(r=4, target_modules=["c_attn"], lora_dropout=0.1))

    reference = tr.run(str(tmp_path / "ref"), model=lora())
    tr.run(str(tmp_path / "run"), stop_at=8, model=lora())
    resumed = tr.run(str(tmp_path / "run"), resume=True, model=lora())
    assert_continues(reference, resumed, 6)
    names = sorted(os.listdir(tmp_path / "run" / "checkpoint-6"))
    assert "adapter_model.safetensors" in names and "adapter_config.json" in names
    assert "model.safetensors" not in names
    loaded = peft.PeftModel.from_pretrained(tr.gpt2(), str(tmp_path / "run" / "checkpoint-15"))
    live = peft.get_peft_model_state_dict(resumed.trainer.model)
    for name, value in peft.get_peft_model_state_dict(loaded).items():
        assert torch.equal(value, live[name]), name


def test_save_on_a_preemption_signal(tmp_path, reference):
    """SIGTERM during step 8: that step is saved (every rank agreeing), the run exits 143,
    and the next start resumes from it exactly."""
    import signal

    from transformers import TrainerCallback

    class Preempt(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 7:  # the 8th step is running when the signal comes
                os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as exited:
        tr.run(str(tmp_path), statekit_options={"save_on_signal": True}, callbacks=[Preempt()])
    assert exited.value.code == 143
    assert signal.getsignal(signal.SIGTERM) is previous
    assert os.path.isfile(tmp_path / "checkpoint-8" / "statekit.json")
    resumed = tr.run(str(tmp_path), resume=True)
    assert_continues(reference, resumed, 8)


def test_two_tier_a_fresh_node_resumes_from_the_remote_tier(tmp_path, reference):
    """``replicate_to``: every checkpoint is copied to the remote root; a run on a fresh node
    (empty output_dir) resumes from the remote's newest, exactly."""
    import fsspec

    remote = f"memory://statekit-trainer-{os.getpid()}-{tmp_path.name}"
    options = {"replicate_to": remote}
    tr.run(str(tmp_path / "node-a"), stop_at=8, statekit_options=options)
    assert fsspec.filesystem("memory").exists(f"{remote}/checkpoint-6/statekit.json")
    resumed = tr.run(str(tmp_path / "node-b"), resume=True, statekit_options=options)
    assert_continues(reference, resumed, 6)
    assert os.path.isfile(tmp_path / "node-b" / "checkpoint-6" / "statekit.json")
