"""The statekit-diffusers hooks: diffusers/transformers models, their EMA and noise schedulers.

Registered from the entry point ``diffusers`` in group ``statekit``. Importing this module
never imports diffusers or transformers (``python -X importtime`` shows neither): models
are recognised through ``sys.modules`` (see :mod:`statekit_diffusers.layout`).

Save (``statekit_save_state_pre``), on every rank; files are written by rank 0 only (the
models are replicated):

* every model in ``models`` that is, once Accelerate/DDP/``torch.compile`` wrappers are
  stripped, a ``diffusers.ModelMixin`` or a ``transformers.PreTrainedModel`` whose
  parameters are not sharded (DTensor/FSDP2 or DeepSpeed ZeRO-3 models are left to the
  sharding plugins) is taken and written as ``<folder>/config.json`` plus
  ``<folder>/diffusion_pytorch_model.safetensors`` (transformers: ``model.safetensors``),
  sharded with an index above ``max_shard_size``;
* every ``diffusers.training_utils.EMAModel`` in ``checkpoint.objects`` that can be paired
  with a model is taken and written as ``<folder>_ema/`` in the same layout (its shadow
  parameters under the model's parameter names, its counters in ``config.json`` as
  ``EMAModel.save_pretrained`` does, so ``EMAModel.from_pretrained`` reads the folder);
* every :class:`statekit_diffusers.NoiseScheduler` is taken and written as
  ``scheduler/scheduler_config.json``.

``checkpoint.records[<stable key>]`` says where each object went; load routes it back.

Load (``statekit_load_state_pre``): every model and object whose manifest owner is this
plugin is loaded in place (the optimizer keeps its parameters) after every key, shape and
dtype was checked; a mismatch raises :class:`statekit.StateMismatchError` before any
tensor is written.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from statekit import CorruptCheckpointError, StatekitError, StateMismatchError, hookimpl
from statekit import format as fmt
from statekit.api.saveload import unwrap_model

from statekit_diffusers import layout, settings
from statekit_diffusers.convert import convert
from statekit_diffusers.scheduler import NoiseScheduler

STATEKIT_CONVERTERS = {"diffusers": convert}
"""Converters found by ``statekit convert SRC OUT --to diffusers``."""

EMA_COUNTERS = (
    "decay",
    "min_decay",
    "optimization_step",
    "update_after_step",
    "use_ema_warmup",
    "inv_gamma",
    "power",
)
"""``EMAModel`` attributes saved with its shadow parameters (its ``state_dict`` minus them)."""

PIPELINE_RECORD = "_pipeline"
"""Records key of the pipeline class name (never a stable key: those start with a letter or digit)."""


# --------------------------------------------------------------------------- save


@dataclass
class _Model:
    key: str
    wrapped: torch.nn.Module
    core: torch.nn.Module
    library: str
    state: dict[str, torch.Tensor]
    folder: str = ""

    @property
    def class_name(self) -> str:
        return type(self.core).__name__

    def param_shapes(self) -> list[tuple[int, ...]]:
        return [tuple(p.shape) for p in self.core.parameters()]


@dataclass
class _Ema:
    key: str
    ema: Any
    names: list[str]
    config: dict[str, Any]
    library: str
    model_class: str
    base_folder: str
    model_key: str | None = None
    folder: str = ""
    counters: dict[str, Any] = field(default_factory=dict)


def _take_model(models: list[Any], weights: list[Any], model: Any) -> None:
    i = next(i for i, m in enumerate(models) if m is model)
    models.pop(i)
    weights.pop(i)


def _claim(objects: Any, key: str) -> bool:
    """Pop ``key`` from ``checkpoint.objects``; False if the mapping is read-only."""
    try:
        objects.pop(key)
    except (TypeError, AttributeError):
        return False
    return True


def _config_of(m: _Model) -> dict[str, Any]:
    if m.library == layout.DIFFUSERS:
        return layout.diffusers_config(m.core.config, m.class_name)
    return layout.transformers_config(m.core)


def _write_folder(
    checkpoint: Any, folder: str, library: str, config: dict[str, Any], state: Mapping[str, torch.Tensor], max_bytes: int
) -> list[str]:
    """Write ``config.json`` and the (possibly sharded) weights of one folder; return the
    relative paths of the weight files."""
    weights_name = layout.WEIGHTS_NAME[library]
    plan = layout.plan_shards(state, weights_name, max_bytes)
    with checkpoint.open(f"{folder}/{layout.CONFIG_NAME}", "wb") as f:
        f.write(layout.hf_json(config))
    written = []
    for name, tensors in plan.files.items():
        checkpoint.save_tensors(f"{folder}/{name}", tensors)
        written.append(f"{folder}/{name}")
    if plan.index is not None:
        with checkpoint.open(f"{folder}/{layout.index_name(weights_name)}", "wb") as f:
            f.write(layout.hf_json(plan.index))
    return written


def _find_model(target: Any, taken: list[_Model]) -> _Model | None:
    for m in taken:
        if (isinstance(target, str) and target == m.key) or target is m.wrapped or target is m.core:
            return m
    return None


def _pair_ema(key: str, ema: Any, taken: list[_Model], opts: settings.Settings) -> _Ema | None:
    """Find which model an EMA averages; None when it cannot be told (the core saves it)."""
    shadow = list(ema.shadow_params)
    if any(type(t).__name__ == "DTensor" for t in shadow):
        return None
    shapes = [tuple(t.shape) for t in shadow]
    model_cls = getattr(ema, "model_cls", None)
    explicit = opts.ema_target(key, ema)
    if explicit is not None:
        found = _find_model(explicit, taken)
        if found is None:
            raise StatekitError(
                f"statekit-diffusers: {settings.OPTION_EMA} pairs EMA {key!r} with {explicit!r}, "
                "which is not a diffusers/transformers model of this save"
            )
        if found.param_shapes() != shapes:
            raise StatekitError(
                f"statekit-diffusers: EMA {key!r} has {len(shapes)} shadow parameters whose shapes do not match "
                f"the parameters of {found.key!r} ({found.class_name})"
            )
        candidates = [found]
    else:
        candidates = [m for m in taken if m.param_shapes() == shapes]
        if isinstance(model_cls, type):
            narrowed = [m for m in candidates if isinstance(m.core, model_cls)]
            candidates = narrowed or candidates
    if len(candidates) > 1:
        raise StatekitError(
            f"statekit-diffusers: EMA {key!r} matches several models ({', '.join(m.key for m in candidates)}); "
            f"say which one it averages: {settings.OPTION_EMA}={{{key!r}: <model key>}} or "
            "statekit_diffusers.configure(ema={...})"
        )
    if candidates:
        m = candidates[0]
        names = [n for n, _ in m.core.named_parameters()]
        return _Ema(key, ema, names, _config_of(m), m.library, m.class_name, m.folder, model_key=m.key)
    model_config = getattr(ema, "model_config", None)
    if not isinstance(model_cls, type) or model_config is None:
        return None
    # No live model of this save: build one on the meta device for its parameter names.
    with torch.device("meta"):
        shell = model_cls.from_config(model_config)
    library = layout.library_of(shell)
    if library is None:
        return None
    names = [n for n, _ in shell.named_parameters()]
    if [tuple(p.shape) for p in shell.parameters()] != shapes:
        raise StatekitError(
            f"statekit-diffusers: EMA {key!r}: its model_cls/model_config ({model_cls.__name__}) has parameter "
            "shapes that differ from its shadow parameters"
        )
    config = layout.diffusers_config(model_config, model_cls.__name__) if library == layout.DIFFUSERS else layout.transformers_config(shell)
    return _Ema(key, ema, names, config, library, model_cls.__name__, layout.default_folder(model_cls.__name__, library))


@hookimpl
def statekit_save_state_pre(models: list[Any], weights: list[Any], output_dir: str, checkpoint: Any) -> None:
    """Take diffusers/transformers models, EMAs and noise schedulers; write their folders.

    See the module docstring. Folder names: given in code (``diffusers_names`` option or
    :func:`statekit_diffusers.configure`), else from the class (``unet``, ``vae``...),
    made unique with ``_1``, ``_2``.

    Raises:
        StatekitError: ambiguous EMA pairing, duplicate folder names given in code, a
            malformed option. (The host reports it as a PluginError; nothing is committed.)
    """
    opts = settings.resolve(checkpoint.options)
    ema_cls = layout.ema_class()
    taken: list[_Model] = []
    for wrapped in list(models):
        core = unwrap_model(wrapped, checkpoint.accelerator)
        library = layout.library_of(core)
        if library is None or layout.is_sharded_model(core):
            continue
        state = core.state_dict()
        if not all(isinstance(v, torch.Tensor) for v in state.values()):
            continue  # extra (non-tensor) state: the core's codec path keeps it
        taken.append(_Model(checkpoint.key_of(wrapped), wrapped, core, library, state))
    emas = [(k, o) for k, o in checkpoint.objects.items() if ema_cls is not None and isinstance(o, ema_cls)]
    schedulers = [(k, o) for k, o in checkpoint.objects.items() if isinstance(o, NoiseScheduler)]
    if not (taken or emas or schedulers):
        return

    # Folder names: names given in code first, derived names around them.
    # Every stable key is reserved (a plugin that ran before may have written "<key>/"), bar our own.
    all_model_keys = set(getattr(checkpoint, "_model_keys", {}).values()) | {checkpoint.key_of(m) for m in models}
    used = set(checkpoint.objects) | all_model_keys | {"rng"}
    used -= {m.key for m in taken} | {k for k, _ in emas} | {k for k, _ in schedulers}
    explicit: dict[str, str] = {}

    def reserve(key: str, *objs: Any) -> None:
        name = opts.name_for(key, *objs)
        if name is None:
            return
        if name in used:
            raise StatekitError(f"statekit-diffusers: folder name {name!r} for {key!r} is used twice in this save")
        used.add(name)
        explicit[key] = name

    for m in taken:
        reserve(m.key, m.wrapped, m.core)
    for key, obj in emas + schedulers:
        reserve(key, obj)
    for m in taken:
        m.folder = explicit.get(m.key) or layout.dedupe(layout.default_folder(m.class_name, m.library), used)

    paired: list[_Ema] = []
    for key, ema in emas:
        e = _pair_ema(key, ema, taken, opts)
        if e is None:
            continue
        e.folder = explicit.get(key) or layout.dedupe(f"{e.base_folder}_ema", used)
        e.counters = {name: getattr(ema, name) for name in EMA_COUNTERS}
        if getattr(ema, "cur_decay_value", None) is not None:
            e.counters["cur_decay_value"] = ema.cur_decay_value
        paired.append(e)
    scheduler_folders = {key: explicit.get(key) or layout.dedupe("scheduler", used) for key, _ in schedulers}

    write = checkpoint.rank == 0
    records = checkpoint.records
    for m in taken:
        files = _write_folder(checkpoint, m.folder, m.library, _config_of(m), m.state, opts.max_shard_bytes) if write else []
        records[m.key] = {"kind": "model", "folder": m.folder, "class": m.class_name, "library": m.library, "weights": files}
        _take_model(models, weights, m.wrapped)
    for e in paired:
        # EMAModel.save_pretrained registers its counters into the config the same way
        config = {**e.config, **{k: v for k, v in e.counters.items() if k in EMA_COUNTERS}}
        state = dict(zip(e.names, e.ema.shadow_params))
        files = _write_folder(checkpoint, e.folder, e.library, config, state, opts.max_shard_bytes) if write else []
        records[e.key] = {
            "kind": "ema",
            "folder": e.folder,
            "class": type(e.ema).__name__,
            "library": layout.DIFFUSERS,
            "model_class": e.model_class,
            "model_library": e.library,
            "model_key": e.model_key,
            "counters": e.counters,
            "params": e.names,
            "weights": files,
        }
        _claim(checkpoint.objects, e.key)
    for key, wrapper in schedulers:
        folder = scheduler_folders[key]
        if write:
            with checkpoint.open(f"{folder}/{layout.SCHEDULER_CONFIG_NAME}", "wb") as f:
                f.write(layout.hf_json(wrapper.config_json()))
        records[key] = {"kind": "scheduler", "folder": folder, "class": wrapper.class_name, "library": layout.DIFFUSERS}
        _claim(checkpoint.objects, key)
    if opts.pipeline:
        records[PIPELINE_RECORD] = opts.pipeline


# --------------------------------------------------------------------------- load


def _record(checkpoint: Any, key: str, kind: str) -> dict[str, Any]:
    rec = checkpoint.records.get(key)
    if not isinstance(rec, dict) or rec.get("kind") != kind or not isinstance(rec.get("folder"), str):
        raise CorruptCheckpointError(
            f"{checkpoint.url}: the manifest says statekit-diffusers saved {key!r} but has no valid {kind} record for it",
            path=checkpoint.url,
        )
    return rec


def _saved_shapes(checkpoint: Any, files: list[str]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for rel in files:
        url = f"{checkpoint.url}/{rel}"
        size = checkpoint.manifest["files"].get(rel, {}).get("size_bytes") if checkpoint.manifest else None
        with checkpoint.open(rel, "rb") as f:
            header, _ = fmt.parse_header(f.read(8), f.read, size, url)
        file_shapes = {e.name: (e.shape, e.dtype) for e in header.entries}
        for alias, name in header.aliases.items():
            file_shapes[alias] = file_shapes[name]
        shapes.update(file_shapes)
    return shapes


def _check_fits(
    checkpoint: Any, what: str, targets: Mapping[str, torch.Tensor], files: list[str]
) -> None:
    saved = _saved_shapes(checkpoint, files)
    mismatched = {
        k: f"saved {list(saved[k][0])} {saved[k][1]} vs live {list(t.shape)} {t.dtype}"
        for k, t in targets.items()
        if k in saved and (tuple(t.shape) != saved[k][0] or t.dtype != saved[k][1])
    }
    missing = set(targets) - set(saved)
    unexpected = set(saved) - set(targets)
    if missing or unexpected or mismatched:
        where = files[0].rsplit("/", 1)[0] if files else "?"
        raise StateMismatchError(f"{what} ({checkpoint.url}/{where}/; nothing was loaded)", missing, unexpected, mismatched)


def _fill(checkpoint: Any, what: str, targets: Mapping[str, torch.Tensor], files: list[str]) -> None:
    try:
        with torch.no_grad():
            for rel in files:
                checkpoint.load_tensors(rel, into=targets)
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(
            f"{exc} ({what} is partly overwritten: load a good checkpoint into it before use)", path=exc.path
        ) from exc


_TRANSFORMERS_META = ("architectures", "transformers_version", "torch_dtype", "dtype")


def _prepare_model(checkpoint: Any, key: str, wrapped: Any) -> Callable[[], None]:
    rec = _record(checkpoint, key, "model")
    core = unwrap_model(wrapped, checkpoint.accelerator)
    what = f"model {key!r} ({type(core).__name__} in {rec['folder']}/)"
    targets = core.state_dict()
    files = list(rec.get("weights") or [])
    _check_fits(checkpoint, what, targets, files)
    saved_config = checkpoint.load_json(f"{rec['folder']}/{layout.CONFIG_NAME}")

    def run() -> None:
        _fill(checkpoint, what, targets, files)
        library = layout.library_of(core)
        if library == layout.DIFFUSERS:
            changes = layout.config_changes(core.config, saved_config)
            if changes:
                core.register_to_config(**changes)
        elif library == layout.TRANSFORMERS:
            live = core.config.to_dict()
            changes = {k: v for k, v in layout.config_changes(live, saved_config).items() if k not in _TRANSFORMERS_META}
            if changes:
                core.config.update(changes)

    return run


def _prepare_ema(checkpoint: Any, key: str, ema: Any) -> Callable[[], None]:
    rec = _record(checkpoint, key, "ema")
    names = list(rec.get("params") or [])
    shadow = list(ema.shadow_params)
    what = f"EMA {key!r} ({rec['folder']}/)"
    if len(names) != len(shadow):
        raise StateMismatchError(
            f"{what}: saved {len(names)} shadow parameters, the live EMA has {len(shadow)} (nothing was loaded)"
        )
    targets = dict(zip(names, shadow))
    files = list(rec.get("weights") or [])
    _check_fits(checkpoint, what, targets, files)
    counters = dict(rec.get("counters") or {})
    cur_decay = counters.pop("cur_decay_value", None)

    def run() -> None:
        _fill(checkpoint, what, targets, files)
        ema.load_state_dict(counters)  # EMAModel validates the counters itself
        ema.cur_decay_value = cur_decay

    return run


def _prepare_scheduler(checkpoint: Any, key: str, wrapper: Any) -> Callable[[], None]:
    rec = _record(checkpoint, key, "scheduler")
    config = checkpoint.load_json(f"{rec['folder']}/{layout.SCHEDULER_CONFIG_NAME}")
    if not isinstance(wrapper, NoiseScheduler):
        raise StatekitError(
            f"{checkpoint.url}: {key!r} holds a noise scheduler configuration; load it into a "
            f"statekit_diffusers.NoiseScheduler, not a {type(wrapper).__name__}"
        )
    return lambda: wrapper.load_state_dict({"class": rec.get("class"), "config": config})


def _is_mine(checkpoint: Any, key: str, kinds: tuple[str, ...]) -> bool:
    """Whether this plugin saved ``key``: the manifest's owner says so; a directory that
    Accelerate wrote under ``statekit.attach`` has no objects table, so there the records do."""
    owner = checkpoint.owner_of(key)
    if owner is not None:
        return owner == checkpoint.plugin
    rec = checkpoint.records.get(key)
    return isinstance(rec, dict) and rec.get("kind") in kinds


@hookimpl
def statekit_load_state_pre(models: list[Any], input_dir: str, checkpoint: Any) -> None:
    """Load every model, EMA and noise scheduler this plugin saved, in place, and take them.

    Every key, shape and dtype is checked (and every config read) before the first tensor
    is written, so a mismatch leaves all models untouched.

    Raises:
        StateMismatchError: a model or EMA does not fit its saved weights (keys listed).
        CorruptCheckpointError: a record or file is missing, malformed or fails verification.
    """
    if not checkpoint.records:
        return
    jobs: list[Callable[[], None]] = []
    mine_models = [m for m in models if _is_mine(checkpoint, checkpoint.key_of(m), ("model",))]
    for wrapped in mine_models:
        jobs.append(_prepare_model(checkpoint, checkpoint.key_of(wrapped), wrapped))
    mine_objects = [k for k in list(checkpoint.objects) if _is_mine(checkpoint, k, ("ema", "scheduler"))]
    for key in mine_objects:
        obj = checkpoint.objects[key]
        kind = (checkpoint.records.get(key) or {}).get("kind")
        if kind == "ema":
            jobs.append(_prepare_ema(checkpoint, key, obj))
        else:
            jobs.append(_prepare_scheduler(checkpoint, key, obj))
    for job in jobs:
        job()
    for wrapped in mine_models:
        models.pop(next(i for i, m in enumerate(models) if m is wrapped))
    for key in mine_objects:
        _claim(checkpoint.objects, key)
