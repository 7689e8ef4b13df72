"""statekit-fsdp end to end: real torchrun processes (gloo, CPU), FSDP2/FSDP1/DDP, resharding, S3, resume.

Every multi-rank case runs ``fsdp_worker.py`` under ``python -m torch.distributed.run``.
World size 1 cases run in the test process on a plain (unsharded) model, which is how a
sharded checkpoint is inspected or fine-tuned on one machine. Full states are compared
with ``torch.equal`` after gathering (``get_state_dict(full_state_dict=True)``).

Tolerance after resharding: the per-step global loss of a resumed run at another world
size matches the uninterrupted run within ``RESHARD_RTOL`` (float32 reductions of the
same global batch in a different order); at the same world size the losses are equal
bit for bit.
"""

from __future__ import annotations

import json
import logging
import math
import re
import shutil
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch
from fsdp_testlib import (
    assert_full_equal,
    capturing_verdicts,
    fault_after_load,
    load_full,
    read_verdicts,
    torchrun,
)
from fsdp_worker import build, full_state, scheduler, train_step

import statekit
from statekit import CorruptCheckpointError, PluginError, StateCheckWarning, StatekitError, StateMismatchError

pytestmark = pytest.mark.usefixtures("fsdp_only")  # conftest: this plugin alone in this process

RESHARD_RTOL = 1e-5
"""Relative tolerance of losses after resuming at a different world size."""

TRAIN_STEPS, SAVE_AT = 8, 4


def manifest_of(url: str) -> statekit.Manifest:
    from statekit.format.manifest import read_manifest
    from statekit.storage import Storage

    return read_manifest(Storage(url))


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def fsdp2_ckpt(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """FSDP2 model + AdamW (wrapped by Accelerate) saved by 2 ranks after 3 steps, and
    reloaded into a fresh FSDP2 model in the same run."""
    d = tmp_path_factory.mktemp("fsdp2")
    paths = {"url": d / "ckpt", "full": d / "full.safetensors", "reloaded": d / "reloaded.safetensors"}
    torchrun(
        2, "save", "--flavor", "fsdp2", "--url", str(paths["url"]), "--full", str(paths["full"]),
        "--then-load", str(paths["reloaded"]), "--accelerate",
    )  # fmt: skip
    return paths


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """An uninterrupted 2-rank FSDP2 training of TRAIN_STEPS steps that saved at SAVE_AT
    (``CheckpointManager``, async: training goes on while the shards are written)."""
    d = tmp_path_factory.mktemp("train")
    paths = {"url": d / "ckpt", "losses": d / "losses.json"}
    torchrun(
        2, "train", "--flavor", "fsdp2", "--url", str(paths["url"]), "--steps", str(TRAIN_STEPS),
        "--save-at", str(SAVE_AT), "--losses", str(paths["losses"]),
    )  # fmt: skip
    return paths


def plugin_failure(exc: BaseException) -> BaseException:
    """The error a plugin raised: statekit passes its own errors through (attributed to the
    plugin) or wraps others in a ``PluginError`` whose ``__cause__`` is the original."""
    if isinstance(exc, PluginError) and exc.__cause__ is not None:
        return exc.__cause__
    return exc


def read_losses(path: Path) -> dict[int, float]:
    return {int(k): v for k, v in json.loads(path.read_text()).items()}


# --------------------------------------------------------------------------- packaging


def test_entry_point_names_the_plugin_module() -> None:
    eps = {ep.name: ep.value for ep in entry_points(group="statekit")}
    assert eps.get("fsdp") == "statekit_fsdp.plugin"


def test_plugin_module_import_is_cheap() -> None:
    code = (
        "import sys, statekit_fsdp.plugin as p\n"
        "heavy = [m for m in ('torch.distributed.checkpoint', 'torch.distributed.fsdp', 'torch.distributed.tensor') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "assert callable(p.STATEKIT_CONVERTERS['safetensors'])\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# --------------------------------------------------------------------------- FSDP2


def test_fsdp2_round_trip_at_same_world_size(fsdp2_ckpt: dict[str, Path]) -> None:
    assert_full_equal(fsdp2_ckpt["full"], fsdp2_ckpt["reloaded"])
    assert load_full(fsdp2_ckpt["full"])[1] == load_full(fsdp2_ckpt["reloaded"])[1]  # param_groups


def test_fsdp2_layout_in_manifest(fsdp2_ckpt: dict[str, Path]) -> None:
    manifest = manifest_of(str(fsdp2_ckpt["url"]))
    assert manifest.objects["model"].owner == "fsdp"
    assert manifest.objects["optim"].owner == "fsdp"  # unwrapped from AcceleratedOptimizer
    assert manifest.objects["sched"].owner == "statekit"  # schedulers stay with the core
    assert "sched.json" in manifest.files
    files = manifest.files
    assert files["model/rank-00000.safetensors"].rank == 0
    assert files["model/rank-00001.safetensors"].rank == 1
    for rel in ("model/rank-00000.safetensors", "model/rank-00001.safetensors", "model/metadata.json", "model/state.json"):
        assert files[rel].writer == "fsdp"
        assert files[rel].size_bytes == (fsdp2_ckpt["url"] / rel).stat().st_size
    assert not any(p.startswith(("model.", "optim")) for p in files), "the core must not write the taken objects"
    assert all(p.endswith((".json", ".safetensors")) for p in files), "no pickle files"
    record = manifest.records["fsdp"]["model"]
    assert record["world_size"] == 2 and record["optimizers"] == ["optim"] and record["sharding"] == "fsdp2"
    meta = json.loads((fsdp2_ckpt["url"] / "model/metadata.json").read_text())
    assert meta["format"] == "statekit-fsdp/1"
    chunks = meta["state_dict_metadata"]["model.out.weight"]["chunks"]
    assert [c["offsets"][0] for c in chunks] == [0, 3] and [c["sizes"][0] for c in chunks] == [3, 2]  # uneven shards


def test_reshard_2_to_1_into_plain_model(fsdp2_ckpt: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    model, optim = build("plain", seed=1)
    with caplog.at_level(logging.INFO, logger="statekit_fsdp"):
        statekit.load(str(fsdp2_ckpt["url"]), {"model": model, "optim": optim})
    assert "resharding 'model' from 2 to 1 processes" in caplog.text
    assert_full_equal(fsdp2_ckpt["full"], full_state(model, optim)[0])


STATE_TENSORS = 7 + 6 * 3
"""Tensors the state check compares after loading the worker's model and AdamW: 6
parameters and a buffer, ``exp_avg``, ``exp_avg_sq`` and ``step`` of each parameter."""


def test_fsdp2_state_digest_is_every_ranks_shards_summed(fsdp2_ckpt: dict[str, Path]) -> None:
    """The save digested the sharded model and optimizer the plugin took: each DTensor's
    digest (the 2 ranks' shares, summed) equals the digest of the gathered tensor."""
    from statekit.checks.digest import Sampling, tensor_digest

    digest = manifest_of(str(fsdp2_ckpt["url"])).state_digest
    assert digest is not None and digest.uncompared is None
    sampling = Sampling.from_json(digest.sampling)
    full, _ = load_full(fsdp2_ckpt["full"])

    def recorded(t: torch.Tensor) -> str:
        return f"{str(t.dtype).removeprefix('torch.')}:{tensor_digest(t, sampling)}"

    assert dict(digest.objects["model"]) == {k.removeprefix("model."): recorded(t) for k, t in full.items() if k.startswith("model.")}
    names = [name for name, _ in build("plain", seed=0)[0].named_parameters()]  # optimizer state: by parameter index
    assert dict(digest.objects["optim"]) == {
        f"state.{i}.{moment}": recorded(full[f"optim.state.{name}.{moment}"])
        for i, name in enumerate(names) for moment in ("exp_avg", "exp_avg_sq", "step")
    }


def test_reshard_2_to_1_is_state_checked(fsdp2_ckpt: dict[str, Path]) -> None:
    model, optim = build("plain", seed=1)
    verdicts, undo = capturing_verdicts()
    try:
        statekit.load(str(fsdp2_ckpt["url"]), {"model": model, "optim": optim})
    finally:
        undo()
    assert [(v.verdict, v.compared, v.deliberate) for v in verdicts] == [("verified", STATE_TENSORS, [])]


def test_reshard_2_to_1_with_a_faulty_load_path_names_each_tensor(fsdp2_ckpt: dict[str, Path]) -> None:
    """A row of what rank 1 saved of ``hidden.weight`` zeroed, an optimizer moment zeroed,
    after the plugin's load: each named by tensor."""
    model, optim = build("plain", seed=1)
    undo = fault_after_load(model, optim)
    try:
        with pytest.warns(StateCheckWarning) as caught:
            statekit.load(str(fsdp2_ckpt["url"]), {"model": model, "optim": optim})
    finally:
        undo()
    [message] = [str(w.message) for w in caught if issubclass(w.category, StateCheckWarning)]
    assert_names_the_faults(message)


def assert_names_the_faults(message: str) -> None:
    """The warning of :func:`fsdp_testlib.fault_after_load`: exactly its two tensors, named."""
    assert re.search(r": state check after the load: 2 tensor\(s\)( on rank \d+ of \d+)? differ from the state saved: ",
                     message), message
    differences = message.split("differ from the state saved: ", 1)[1].split("; ")
    assert [d.split(" (saved digest ")[0] for d in differences] == [
        "model 'model': hidden.weight differs from the saved state",
        "optimizer 'optim': exp_avg of 'out.weight' is all zeros, differs from the saved state",
    ]


@pytest.mark.slow
def test_reshard_2_to_3_with_a_faulty_load_path_names_each_tensor_on_every_rank(
    fsdp2_ckpt: dict[str, Path], tmp_path: Path
) -> None:
    """3 ranks load what 2 saved; the last rank zeroes a row of its shard of ``hidden.weight``,
    every rank its shard of a moment: every rank names both (the shards' sums are shared)."""
    verdicts = tmp_path / "verdicts"
    torchrun(3, "load", "--flavor", "fsdp2", "--url", str(fsdp2_ckpt["url"]), "--verdicts", str(verdicts), "--fault")
    ranks = read_verdicts(verdicts, 3)
    for rank in ranks:
        [verdict] = rank["verdicts"]
        assert verdict["verdict"] == "mismatch" and verdict["compared"] == STATE_TENSORS
        [message] = rank["warnings"]
        assert_names_the_faults(message)
    # the same digests on every rank, each naming its own rank
    assert len({re.sub(r" on rank \d of 3 ", " ", rank["warnings"][0]) for rank in ranks}) == 1
    assert [f" on rank {r} of 3 " in rank["warnings"][0] for r, rank in enumerate(ranks)] == [True] * 3


def test_model_alone_loads_without_its_optimizer(fsdp2_ckpt: dict[str, Path]) -> None:
    model, _ = build("plain", seed=1)
    statekit.load(str(fsdp2_ckpt["url"]), {"model": model})
    expected, _ = load_full(fsdp2_ckpt["full"])
    for name, t in model.state_dict().items():
        assert torch.equal(t, expected[f"model.{name}"]), name


def test_optimizer_alone_is_refused(fsdp2_ckpt: dict[str, Path]) -> None:
    model, optim = build("plain", seed=1)
    with pytest.raises(StatekitError, match="load it together with that model") as info:
        statekit.load(str(fsdp2_ckpt["url"]), {"optim": optim})
    assert info.value.plugin_name == "fsdp"  # type: ignore[attr-defined]


def test_shape_mismatch_names_keys_and_leaves_model_untouched(fsdp2_ckpt: dict[str, Path]) -> None:
    model, optim = build("plain", seed=1)
    model.out = torch.nn.Linear(7, 4)
    model.scale = torch.ones(4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(StatekitError) as info:
        statekit.load(str(fsdp2_ckpt["url"]), {"model": model, "optim": torch.optim.AdamW(model.parameters())})
    cause = plugin_failure(info.value)
    assert isinstance(cause, StateMismatchError)
    assert "model.out.weight" in cause.mismatched
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_corrupt_shard_is_named(fsdp2_ckpt: dict[str, Path], tmp_path: Path) -> None:
    url = tmp_path / "ckpt"
    shutil.copytree(fsdp2_ckpt["url"], url)
    shard = url / "model" / "rank-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    model, optim = build("plain", seed=1)
    with pytest.raises(StatekitError) as info:
        statekit.load(str(url), {"model": model, "optim": optim})
    cause = plugin_failure(info.value)
    assert isinstance(cause, CorruptCheckpointError)
    assert "model/rank-00001.safetensors" in str(cause) and "checksum" in str(cause)


def test_consolidate_to_one_safetensors_file(fsdp2_ckpt: dict[str, Path], tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    import statekit_fsdp.plugin

    statekit_fsdp.plugin.STATEKIT_CONVERTERS["safetensors"](str(fsdp2_ckpt["url"]), str(tmp_path / "out"))
    consolidated = load_file(str(tmp_path / "out" / "model.safetensors"))
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}  # a plain safetensors file: the core's header writer adds nothing
    expected, _ = load_full(fsdp2_ckpt["full"])
    assert_full_equal({k: v for k, v in expected.items() if k.startswith("model.")}, {f"model.{k}": v for k, v in consolidated.items()})
    model, _ = build("plain", seed=1)
    model.load_state_dict(consolidated)  # the FQNs of the plain model


def test_statekit_convert_cli_finds_the_converter(fsdp2_ckpt: dict[str, Path], tmp_path: Path) -> None:
    from click.testing import CliRunner
    from safetensors.torch import load_file

    from statekit.cli import main

    result = CliRunner().invoke(main, ["convert", str(fsdp2_ckpt["url"]), str(tmp_path / "out"), "--to", "safetensors"])
    assert result.exit_code == 0, result.output
    expected, _ = load_full(fsdp2_ckpt["full"])
    consolidated = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(consolidated) == sorted(k.removeprefix("model.") for k in expected if k.startswith("model."))


def test_consolidate_refuses_a_corrupt_shard(fsdp2_ckpt: dict[str, Path], tmp_path: Path) -> None:
    from statekit_fsdp import consolidate

    url = tmp_path / "ckpt"
    shutil.copytree(fsdp2_ckpt["url"], url)
    shard = url / "model" / "rank-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="rank-00000.safetensors"):
        consolidate(str(url), str(tmp_path / "out"))


@pytest.mark.slow
def test_reshard_2_to_3(fsdp2_ckpt: dict[str, Path], tmp_path: Path) -> None:
    """Uneven shards (2 saved, 3 loading); 2 to 4 (even) is test_s3_reshard_2_to_4. Every rank's
    state check verifies every tensor (the shards of each DTensor summed across the 3 ranks)."""
    out, verdicts = tmp_path / "loaded.safetensors", tmp_path / "verdicts"
    torchrun(3, "load", "--flavor", "fsdp2", "--url", str(fsdp2_ckpt["url"]), "--full", str(out), "--verdicts", str(verdicts))
    assert_full_equal(fsdp2_ckpt["full"], out)
    for rank in read_verdicts(verdicts, 3):
        assert [(v["verdict"], v["compared"], v["deliberate"]) for v in rank["verdicts"]] == [("verified", STATE_TENSORS, [])]
        assert rank["warnings"] == []


@pytest.mark.slow
def test_reshard_4_to_2(tmp_path: Path) -> None:
    """More saving ranks than loading ones (on local disk; the S3 tests save with 2 ranks and
    load with 1 and 4: the plugin's reshard is the same on every storage)."""
    url, full, loaded = tmp_path / "ckpt", tmp_path / "full.safetensors", tmp_path / "loaded.safetensors"
    torchrun(4, "save", "--flavor", "fsdp2", "--url", str(url), "--full", str(full))
    assert manifest_of(str(url)).files["model/rank-00003.safetensors"].rank == 3
    torchrun(2, "load", "--flavor", "fsdp2", "--url", str(url), "--full", str(loaded))
    assert_full_equal(full, loaded)


# --------------------------------------------------------------------------- S3 (moto)


@pytest.fixture(scope="module")
def s3_ckpt(tmp_path_factory: pytest.TempPathFactory, s3_server: object) -> dict[str, object]:
    """FSDP2 saved by 2 ranks to a bucket on the moto server (the endpoint reaches the
    torchrun processes through AWS_ENDPOINT_URL in their environment)."""
    import uuid

    s3fs = pytest.importorskip("s3fs")
    s3fs.S3FileSystem.clear_instance_cache()
    bucket = f"statekit-fsdp-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem().mkdir(bucket)
    d = tmp_path_factory.mktemp("s3")
    paths = {"url": f"s3://{bucket}/run/ckpt", "full": d / "full.safetensors", "reloaded": d / "reloaded.safetensors"}
    torchrun(
        2, "save", "--flavor", "fsdp2", "--url", str(paths["url"]), "--full", str(paths["full"]),
        "--then-load", str(paths["reloaded"]),
    )  # fmt: skip
    s3fs.S3FileSystem.clear_instance_cache()
    return paths


@pytest.mark.s3
def test_s3_round_trip_reshard_to_1_and_consolidate(s3_ckpt: dict[str, object], tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from statekit_fsdp import consolidate

    assert_full_equal(s3_ckpt["full"], s3_ckpt["reloaded"])
    manifest = manifest_of(s3_ckpt["url"])
    assert {manifest.files[f"model/rank-0000{r}.safetensors"].rank for r in (0, 1)} == {0, 1}
    model, optim = build("plain", seed=1)
    statekit.load(s3_ckpt["url"], {"model": model, "optim": optim})
    assert_full_equal(s3_ckpt["full"], full_state(model, optim)[0])
    consolidate(s3_ckpt["url"], str(tmp_path / "out"))
    consolidated = load_file(str(tmp_path / "out" / "model.safetensors"))
    for name, t in model.state_dict().items():
        assert torch.equal(consolidated[name], t), name


@pytest.mark.s3
@pytest.mark.slow
def test_s3_reshard_2_to_4(s3_ckpt: dict[str, object], tmp_path: Path) -> None:
    out = tmp_path / "loaded.safetensors"
    torchrun(4, "load", "--flavor", "fsdp2", "--url", str(s3_ckpt["url"]), "--full", str(out))
    assert_full_equal(s3_ckpt["full"], out)


# --------------------------------------------------------------------------- FSDP1 and DDP


@pytest.mark.parametrize("flavor", ["fsdp1", pytest.param("fsdp1-flat", marks=pytest.mark.slow)])
def test_fsdp1_round_trip_and_load_into_plain_model(tmp_path: Path, flavor: str) -> None:
    """FSDP1 runs on CPU with ``device_id=torch.device("cpu")``; ``fsdp1-flat`` is
    ``use_orig_params=False`` (the optimizer holds FlatParameters)."""
    url, full, reloaded = tmp_path / "ckpt", tmp_path / "full.safetensors", tmp_path / "reloaded.safetensors"
    torchrun(2, "save", "--flavor", flavor, "--url", str(url), "--full", str(full), "--then-load", str(reloaded))
    assert_full_equal(full, reloaded)
    manifest = manifest_of(str(url))
    assert manifest.records["fsdp"]["model"]["sharding"] == "fsdp1"
    assert {"model/rank-00000.safetensors", "model/rank-00001.safetensors"} <= set(manifest.files)
    model, optim = build("plain", seed=1)  # FQNs of an FSDP1 (use_orig_params) model are the plain ones
    statekit.load(str(url), {"model": model, "optim": optim})
    assert_full_equal(full, full_state(model, optim)[0])


def test_ddp_model_is_left_to_the_core(tmp_path: Path) -> None:
    url, full, reloaded = tmp_path / "ckpt", tmp_path / "full.safetensors", tmp_path / "reloaded.safetensors"
    torchrun(2, "save", "--flavor", "ddp", "--url", str(url), "--full", str(full), "--then-load", str(reloaded))
    assert_full_equal(full, reloaded)
    manifest = manifest_of(str(url))
    assert manifest.objects["model"].owner == "statekit"
    assert manifest.objects["optim"].owner == "statekit"
    assert manifest.files["model.safetensors"].rank == 0  # written once, by rank 0
    assert not any(p.startswith("model/") for p in manifest.files)
    assert "fsdp" not in manifest.records


# --------------------------------------------------------------------------- resumed training


def test_resume_at_same_world_size_is_bit_identical(trained: dict[str, Path], tmp_path: Path) -> None:
    resumed = tmp_path / "resumed.json"
    torchrun(
        2, "train", "--flavor", "fsdp2", "--url", str(trained["url"]), "--steps", str(TRAIN_STEPS),
        "--save-at", str(SAVE_AT), "--losses", str(resumed), "--resume",
    )  # fmt: skip
    full, again = read_losses(trained["losses"]), read_losses(resumed)
    assert sorted(again) == list(range(SAVE_AT, TRAIN_STEPS))
    assert [again[s] for s in again] == [full[s] for s in again]  # bit for bit


def test_resume_resharded_to_1_continues_the_loss_curve(trained: dict[str, Path]) -> None:
    full = read_losses(trained["losses"])
    model, optim = build("plain", seed=7)
    sched = scheduler(optim)
    statekit.load(f"{trained['url']}/checkpoint-{SAVE_AT:08d}", {"model": model, "optim": optim, "sched": sched})
    assert sched.last_epoch == SAVE_AT
    for step in range(SAVE_AT, TRAIN_STEPS):
        loss = train_step(model, optim, step, sched)
        assert math.isclose(loss, full[step], rel_tol=RESHARD_RTOL), (step, loss, full[step])


@pytest.mark.slow
def test_resume_resharded_to_3_continues_the_loss_curve(trained: dict[str, Path], tmp_path: Path) -> None:
    resumed = tmp_path / "resumed.json"
    torchrun(
        3, "train", "--flavor", "fsdp2", "--url", str(trained["url"]), "--steps", str(TRAIN_STEPS),
        "--save-at", str(SAVE_AT), "--losses", str(resumed), "--resume",
    )  # fmt: skip
    full, again = read_losses(trained["losses"]), read_losses(resumed)
    for step, loss in again.items():
        assert math.isclose(loss, full[step], rel_tol=RESHARD_RTOL), (step, loss, full[step])


def test_export_pretrained_assembles_the_shards_into_a_sharded_hf_folder(fsdp2_ckpt: dict[str, Path], tmp_path: Path) -> None:
    """``statekit.export_pretrained`` of a 2-rank FSDP2 checkpoint (the plugin's
    ``STATEKIT_EXPORT_SOURCE``): several weight files and the index, every tensor equal to
    the full model, each compared with the state digest recorded at save."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    out = tmp_path / "hf"
    result = statekit.export_pretrained(str(fsdp2_ckpt["url"]), str(out), max_shard_size=256)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shard_files = sorted(set(index["weight_map"].values()))
    assert len(shard_files) > 1 and list(result.files[: len(shard_files)]) == shard_files
    exported: dict[str, torch.Tensor] = {}
    for name in shard_files:
        with safe_open(str(out / name), "pt") as f:
            assert f.metadata() == {"format": "pt"}
        exported.update(load_file(str(out / name)))
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in exported.values())
    expected, _ = load_full(fsdp2_ckpt["full"])
    assert_full_equal({k: v for k, v in expected.items() if k.startswith("model.")}, {f"model.{k}": v for k, v in exported.items()})
    assert result.digests_compared == len(exported)
