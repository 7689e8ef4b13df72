"""Fixtures for the statekit-diffusers tests: tiny diffusers models built from configs
(no hub download), a fresh plugin manager with the installed entry points, and the S3
fixtures of ``statekit.testing`` (``s3_server``, ``s3_bucket``, ``storage_url``)."""

from __future__ import annotations

import os
import warnings
from importlib import metadata

import pytest
import torch

# statekit.testing may already be loaded through its pytest11 entry point.
_registered = any(ep.value.split(":")[0] == "statekit.testing" for ep in metadata.entry_points(group="pytest11"))
pytest_plugins = [] if _registered else ["statekit.testing"]


def tiny_unet(seed: int = 0):
    """A ``UNet2DModel`` of 41,609 parameters (1 channel, 8x8)."""
    from diffusers import UNet2DModel

    torch.manual_seed(seed)
    return UNet2DModel(
        sample_size=8,
        in_channels=1,
        out_channels=1,
        layers_per_block=1,
        block_out_channels=(8, 16),
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
        norm_num_groups=4,
    )


def tiny_cond_unet(seed: int = 0):
    """A ``UNet2DConditionModel`` of 51,364 parameters (4 channels, 8x8, cross-attention dim 8)."""
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    return UNet2DConditionModel(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(8, 16),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=8,
        attention_head_dim=2,
        norm_num_groups=4,
    )


def tiny_vae(seed: int = 0):
    """An ``AutoencoderKL`` of 9,663 parameters."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(
        in_channels=1,
        out_channels=1,
        block_out_channels=(8,),
        down_block_types=("DownEncoderBlock2D",),
        up_block_types=("UpDecoderBlock2D",),
        latent_channels=2,
        norm_num_groups=4,
        layers_per_block=1,
    )


def train_step(model, optimizer, ema=None) -> None:
    """One optimizer step on random data, so weights and optimizer state are not initial."""
    if model.config.in_channels == 4 and hasattr(model.config, "cross_attention_dim"):
        out = model(torch.randn(2, 4, 8, 8), 5, encoder_hidden_states=torch.randn(2, 3, 8)).sample
    elif hasattr(model, "encode"):
        out = model(torch.randn(2, 1, 8, 8)).sample
    else:
        out = model(torch.randn(2, 1, 8, 8), 5).sample
    out.square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    if ema is not None:
        ema.step(model.parameters())


def assert_same_weights(a, b) -> None:
    """Every state-dict entry of two modules is bit-identical."""
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


@pytest.fixture
def pm(installed_plugin_manager):
    """A fresh plugin manager with the installed plugins (statekit-diffusers from its entry point)."""
    assert installed_plugin_manager.get_plugin("diffusers") is not None, "pip install --no-deps -e plugins/statekit-diffusers"
    return installed_plugin_manager


@pytest.fixture(autouse=True)
def _reset_configure():
    import statekit_diffusers

    statekit_diffusers.configure()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="no installed plugin saves random")
        yield
    statekit_diffusers.configure()


def hand_written_hooks(accelerator, ema_unet):
    """The hooks of diffusers' examples/text_to_image/train_text_to_image.py --use_ema (v0.30+;
    huggingface/diffusers 58eb52c0803e), as written there: ``EMAModel.save_pretrained`` and
    ``save_pretrained`` of each model with ``weights.pop()``; ``models.pop()`` and
    ``from_pretrained`` on load; registered with the accelerator."""
    from diffusers import UNet2DConditionModel
    from diffusers.training_utils import EMAModel

    def save_model_hook(models, weights, output_dir):
        if accelerator.is_main_process:
            ema_unet.save_pretrained(os.path.join(output_dir, "unet_ema"))
            for i, model in enumerate(models):
                model.save_pretrained(os.path.join(output_dir, "unet"))
                # make sure to pop weight so that corresponding model is not saved again
                weights.pop()

    def load_model_hook(models, input_dir):
        load_model = EMAModel.from_pretrained(os.path.join(input_dir, "unet_ema"), UNet2DConditionModel)
        ema_unet.load_state_dict(load_model.state_dict())
        del load_model
        for _ in range(len(models)):
            model = models.pop()
            load_model = UNet2DConditionModel.from_pretrained(input_dir, subfolder="unet")
            model.register_to_config(**load_model.config)
            model.load_state_dict(load_model.state_dict())
            del load_model

    accelerator.register_save_state_pre_hook(save_model_hook)
    accelerator.register_load_state_pre_hook(load_model_hook)
