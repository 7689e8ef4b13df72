"""diffusers' own training scripts keep their hooks, with ``statekit.attach(accelerator)`` added.

Follows examples/text_to_image/train_text_to_image.py of huggingface/diffusers at 58eb52c0803e
(2026-08-23): the ``save_model_hook`` that calls ``EMAModel.save_pretrained`` (which builds a
throw-away ``UNet2DConditionModel`` and so draws from the global RNG) and
``model.save_pretrained`` for each model, popping its ``weights`` entry; the
``load_model_hook`` that pops each model and loads it with ``from_pretrained``; both
registered before ``prepare()``. The whole scripts run in tests/integration/clients.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from conftest import assert_same_weights, hand_written_hooks, tiny_cond_unet

import statekit

accelerate = pytest.importorskip("accelerate")


def script_run(seed: int, where: str):
    from accelerate.state import AcceleratorState, GradientState
    from diffusers import UNet2DConditionModel
    from diffusers.training_utils import EMAModel

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = accelerate.Accelerator(cpu=True)
    if where == "init":
        statekit.attach(accelerator)
    unet = tiny_cond_unet(seed)
    ema_unet = EMAModel(unet.parameters(), decay=0.9, model_cls=UNet2DConditionModel, model_config=unet.config)
    hand_written_hooks(accelerator, ema_unet)
    opt = torch.optim.AdamW(unet.parameters(), lr=1e-2)
    unet, opt = accelerator.prepare(unet, opt)
    if where == "prepare":
        statekit.attach(accelerator)
    return accelerator, unet, opt, ema_unet


def step(accelerator, unet, opt, ema_unet) -> float:
    """One training step as the script draws it: noise and timesteps from the global RNG."""
    latents = torch.ones(2, 4, 8, 8)
    noise = torch.randn_like(latents)
    timesteps = torch.randint(0, 25, (2,))
    out = unet(latents + noise, timesteps, encoder_hidden_states=torch.randn(2, 3, 8)).sample
    loss = torch.nn.functional.mse_loss(out, noise)
    accelerator.backward(loss)
    opt.step()
    opt.zero_grad()
    ema_unet.step(unet.parameters())
    return loss.item()


@pytest.mark.parametrize("where", ["init", "prepare"])
@pytest.mark.parametrize("plugin", [True, False], ids=["diffusers-plugin", "no-diffusers-plugin"])
def test_train_text_to_image_hooks_save_and_resume_exactly(pm, tmp_path, where, plugin):
    if not plugin:
        pm.set_blocked("diffusers")
    accelerator, unet, opt, ema = script_run(0, where)
    step(accelerator, unet, opt, ema)
    accelerator.save_state(str(tmp_path / "checkpoint-1"))  # was: IndexError: pop from empty list
    reference = [step(accelerator, unet, opt, ema) for _ in range(2)]  # the run continues after the save

    names = sorted(os.listdir(tmp_path / "checkpoint-1"))
    assert "unet" in names and "unet_ema" in names and "model.safetensors" not in names  # the script's layout
    manifest = statekit.verify(str(tmp_path / "checkpoint-1"))
    assert manifest.objects["model_0"].owner == "accelerate-hooks"
    assert "unet_ema/diffusion_pytorch_model.safetensors" in manifest.files and manifest.step == 1

    accelerator2, unet2, opt2, ema2 = script_run(1, where)
    with warnings.catch_warnings():
        warnings.simplefilter("error", statekit.StatekitWarning)  # an exact resume warns about nothing
        accelerator2.load_state(str(tmp_path / "checkpoint-1"))
    resumed = [step(accelerator2, unet2, opt2, ema2) for _ in range(2)]
    assert resumed == reference  # the EMA's throw-away model drew during the save: the random state still follows
    assert_same_weights(unet, unet2)
    assert all(torch.equal(a, b) for a, b in zip(ema.shadow_params, ema2.shadow_params))
