"""EMAModel saved as ``<folder>_ema/`` in the diffusers layout and restored in place; noise schedulers."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import assert_same_weights, tiny_unet, tiny_vae, train_step

import statekit
from statekit import PluginError, StatekitWarning

import statekit_diffusers


def make_ema(model, **kwargs):
    from diffusers.training_utils import EMAModel

    return EMAModel(model.parameters(), **kwargs)


def trained(seed=0, steps=3, **ema_kwargs):
    model = tiny_unet(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ema = make_ema(model, decay=0.99, use_ema_warmup=True, power=0.75, update_after_step=1, **ema_kwargs)
    for _ in range(steps):
        train_step(model, opt, ema)
    return model, opt, ema


def assert_same_ema(a, b):
    assert len(a.shadow_params) == len(b.shadow_params)
    for x, y in zip(a.shadow_params, b.shadow_params):
        assert torch.equal(x, y)
    for name in ("decay", "min_decay", "optimization_step", "update_after_step", "use_ema_warmup", "inv_gamma", "power", "cur_decay_value"):
        assert getattr(a, name) == getattr(b, name), name
        assert type(getattr(a, name)) is type(getattr(b, name)), name


def test_ema_round_trip_in_place(pm, storage_url):
    model, opt, ema = trained()
    manifest = statekit.save(storage_url, {"unet": model, "optim": opt, "ema": ema})
    rec = manifest.records["diffusers"]["ema"]
    assert manifest.objects["ema"].owner == "diffusers"
    assert rec["folder"] == "unet_ema" and rec["model_key"] == "unet" and rec["kind"] == "ema"
    assert rec["counters"]["optimization_step"] == 3
    assert {"unet_ema/config.json", "unet_ema/diffusion_pytorch_model.safetensors"} <= set(manifest.files)

    fresh = tiny_unet(seed=1)
    fresh_ema = make_ema(fresh)  # default counters, other weights
    shadow_ids = [id(t) for t in fresh_ema.shadow_params]
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    statekit.load(storage_url, {"unet": fresh, "optim": fresh_opt, "ema": fresh_ema})
    assert_same_weights(model, fresh)
    assert_same_ema(ema, fresh_ema)
    assert [id(t) for t in fresh_ema.shadow_params] == shadow_ids  # in place

    # training continues identically
    torch.manual_seed(11)
    train_step(model, opt, ema)
    torch.manual_seed(11)
    train_step(fresh, fresh_opt, fresh_ema)
    assert_same_weights(model, fresh)
    assert_same_ema(ema, fresh_ema)


def test_ema_folder_reads_with_diffusers(pm, tmp_path):
    from diffusers import UNet2DModel
    from diffusers.training_utils import EMAModel

    model, _, ema = trained()
    url = str(tmp_path / "ckpt")
    statekit.save(url, {"unet": model, "ema": ema})
    loaded = EMAModel.from_pretrained(str(tmp_path / "ckpt" / "unet_ema"), model_cls=UNet2DModel)
    assert loaded.optimization_step == ema.optimization_step and loaded.decay == ema.decay
    assert loaded.power == ema.power and loaded.use_ema_warmup is True
    for a, b in zip(ema.shadow_params, loaded.shadow_params):
        assert torch.equal(a, b)


def test_ema_paired_through_model_cls_without_the_model(pm, tmp_path):
    from diffusers import UNet2DModel

    model, _, ema = trained(model_cls=UNet2DModel, model_config=tiny_unet().config)
    url = str(tmp_path / "ckpt")
    manifest = statekit.save(url, {"ema": ema, "vae": tiny_vae()})  # the EMA's model is not part of this save
    rec = manifest.records["diffusers"]["ema"]
    assert rec["folder"] == "unet_ema" and rec["model_key"] is None and rec["model_class"] == "UNet2DModel"
    fresh = make_ema(tiny_unet(seed=3))
    statekit.load(url, {"ema": fresh, "vae": tiny_vae(seed=3)})
    assert_same_ema(ema, fresh)


def test_ema_that_matches_several_models_needs_a_pairing(pm, tmp_path):
    first, second = tiny_unet(), tiny_unet(seed=1)
    ema = make_ema(second, decay=0.9)
    with pytest.raises(PluginError, match="matches several models"):
        statekit.save(str(tmp_path / "a"), {"a": first, "b": second, "ema": ema})
    manifest = statekit.save(str(tmp_path / "b"), {"a": first, "b": second, "ema": ema}, diffusers_ema={"ema": "b"})
    rec = manifest.records["diffusers"]["ema"]
    assert rec["model_key"] == "b" and rec["folder"] == "unet_1_ema"
    statekit_diffusers.configure(ema={ema: second}, names={ema: "student_ema"})
    manifest = statekit.save(str(tmp_path / "c"), {"a": first, "b": second, "ema": ema})
    assert manifest.records["diffusers"]["ema"]["folder"] == "student_ema"


def test_ema_of_a_plain_module_stays_with_the_core(pm, tmp_path):
    net = torch.nn.Linear(4, 4)
    ema = make_ema(net)
    manifest = statekit.save(str(tmp_path / "ckpt"), {"net": net, "ema": ema})
    assert manifest.objects["ema"].owner == "statekit"
    fresh = make_ema(torch.nn.Linear(4, 4))
    statekit.load(str(tmp_path / "ckpt"), {"net": torch.nn.Linear(4, 4), "ema": fresh})
    for a, b in zip(ema.shadow_params, fresh.shadow_params):
        assert torch.equal(a, b)


def test_ema_shape_mismatch_touches_nothing(pm, tmp_path):
    model, _, ema = trained()
    url = str(tmp_path / "ckpt")
    statekit.save(url, {"unet": model, "ema": ema})
    fresh = tiny_unet(seed=4)
    wrong = make_ema(torch.nn.Linear(2, 2))
    before = [t.clone() for t in wrong.shadow_params]
    model_before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(statekit.StatekitError, match="shadow parameters"):
        statekit.load(url, {"unet": fresh, "ema": wrong})
    assert all(torch.equal(a, b) for a, b in zip(before, wrong.shadow_params))
    assert all(torch.equal(v, model_before[k]) for k, v in fresh.state_dict().items())


def test_noise_scheduler_saved_in_diffusers_layout(pm, storage_url):
    from diffusers import DDIMScheduler, DDPMScheduler

    sched = statekit_diffusers.NoiseScheduler(DDPMScheduler(num_train_timesteps=40, beta_schedule="squaredcos_cap_v2"))
    manifest = statekit.save(storage_url, {"unet": tiny_unet(), "noise": sched})
    assert manifest.objects["noise"].owner == "diffusers"
    assert manifest.records["diffusers"]["noise"] == {
        "kind": "scheduler", "folder": "scheduler", "class": "DDPMScheduler", "library": "diffusers",
    }
    assert "scheduler/scheduler_config.json" in manifest.files
    with warnings.catch_warnings():
        warnings.simplefilter("error", StatekitWarning)
        statekit.load(storage_url, {"unet": tiny_unet(), "noise": statekit_diffusers.NoiseScheduler(DDPMScheduler(
            num_train_timesteps=40, beta_schedule="squaredcos_cap_v2"))})
    with pytest.warns(StatekitWarning, match="num_train_timesteps saved 40 vs live 1000"):
        statekit.load(storage_url, {"unet": tiny_unet(), "noise": statekit_diffusers.NoiseScheduler(DDIMScheduler())})


def test_noise_scheduler_without_the_plugin_goes_through_the_core(plugin_manager, tmp_path):
    from diffusers import DDPMScheduler

    sched = statekit_diffusers.NoiseScheduler(DDPMScheduler(num_train_timesteps=40))
    manifest = statekit.save(str(tmp_path / "ckpt"), {"noise": sched})
    assert manifest.objects["noise"].owner == "statekit"
    with pytest.warns(StatekitWarning, match="num_train_timesteps"):
        statekit.load(str(tmp_path / "ckpt"), {"noise": statekit_diffusers.NoiseScheduler(DDPMScheduler())})
    with pytest.raises(statekit.StatekitError, match="config mapping"):
        statekit_diffusers.NoiseScheduler(object())
