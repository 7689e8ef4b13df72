"""What statekit-diffusers saves: which models, EMAs and schedulers it takes, their folders, their files.

See :mod:`statekit_diffusers.plugin` for the layout; the hook there calls, in order,
:func:`collect`, :func:`reserve_folders`, :func:`pair_emas` and the writers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from statekit.plugin_api import StatekitError, unwrap_model
from statekit_diffusers import layout, settings
from statekit_diffusers.scheduler import NoiseScheduler

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


def claim(objects: Any, key: str) -> bool:
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
    candidates = _ema_candidates(key, ema, taken, opts, shapes)
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
    return _ema_from_config(key, ema, shapes)


def _ema_candidates(key: str, ema: Any, taken: list[_Model], opts: settings.Settings, shapes: list[tuple[int, ...]]) -> list[_Model]:
    """The taken models an EMA may average: the one the options name (checked), else those
    whose parameter shapes match its shadow parameters (narrowed by its ``model_cls``)."""
    model_cls = getattr(ema, "model_cls", None)
    explicit = opts.ema_target(key, ema)
    if explicit is None:
        candidates = [m for m in taken if m.param_shapes() == shapes]
        if isinstance(model_cls, type):
            candidates = [m for m in candidates if isinstance(m.core, model_cls)] or candidates
        return candidates
    found = _find_model(explicit, taken)
    if found is None:
        raise StatekitError(
            f"statekit-diffusers: {settings.OPTION_EMA} pairs EMA {key!r} with {explicit!r}, "
            "which is not a model this plugin takes in this save (a diffusers model, or a transformers "
            f"model beside one or named in {settings.OPTION_NAMES})"
        )
    if found.param_shapes() != shapes:
        raise StatekitError(
            f"statekit-diffusers: EMA {key!r} has {len(shapes)} shadow parameters whose shapes do not match "
            f"the parameters of {found.key!r} ({found.class_name})"
        )
    return [found]


def _ema_from_config(key: str, ema: Any, shapes: list[tuple[int, ...]]) -> _Ema | None:
    """An EMA of no live model of this save, described by its diffusers ``model_cls`` and
    ``model_config`` (a model built on the meta device gives the parameter names); None
    when it has neither (the core saves it)."""
    model_cls = getattr(ema, "model_cls", None)
    model_config = getattr(ema, "model_config", None)
    # Only a diffusers class builds from its config (transformers classes have no
    # from_config): an EMA of a transformers model that was not taken stays with the core.
    if layout.library_of_class(model_cls) != layout.DIFFUSERS or model_config is None:
        return None
    with torch.device("meta"):
        shell = model_cls.from_config(model_config)
    names = [n for n, _ in shell.named_parameters()]
    if [tuple(p.shape) for p in shell.parameters()] != shapes:
        raise StatekitError(
            f"statekit-diffusers: EMA {key!r}: its model_cls/model_config ({model_cls.__name__}) has parameter "
            "shapes that differ from its shadow parameters"
        )
    name = model_cls.__name__
    config = layout.diffusers_config(model_config, name)
    return _Ema(key, ema, names, config, layout.DIFFUSERS, name, layout.default_folder(name, layout.DIFFUSERS))


def collect(
    models: list[Any], checkpoint: Any, opts: settings.Settings
) -> tuple[list[_Model], list[tuple[str, Any]], list[tuple[str, Any]]]:
    """The diffusers/transformers models, EMAs and noise schedulers of a save.

    A model is taken when it is not sharded, its state is all tensors, and it is a
    diffusers ``ModelMixin``, or a transformers ``PreTrainedModel`` that is a pipeline
    component: the save is a diffusion save (it holds a diffusers model, sharded or not, or
    a noise scheduler, or a pipeline class is given) or a folder name is given for the
    model in code (``diffusers_names``, ``configure(names=...)``).

    Args:
        models: the save's models (as prepared).
        checkpoint: the save's checkpoint.
        opts: the save's settings.

    Returns:
        ``(models taken, [(key, EMAModel)], [(key, NoiseScheduler)])``, the EMAs and
        schedulers among ``checkpoint.objects``.
    """
    ema_cls = layout.ema_class()
    emas = [(k, o) for k, o in checkpoint.objects.items() if ema_cls is not None and isinstance(o, ema_cls)]
    schedulers = [(k, o) for k, o in checkpoint.objects.items() if isinstance(o, NoiseScheduler)]
    diffusion = bool(schedulers) or opts.pipeline is not None
    found: list[_Model] = []
    for wrapped in list(models):
        core = unwrap_model(wrapped, checkpoint.accelerator)
        library = layout.library_of(core)
        if library is None:
            continue
        diffusion = diffusion or library == layout.DIFFUSERS  # a sharded UNet counts too
        if layout.is_sharded_model(core):
            continue
        state = core.state_dict()
        if not all(isinstance(v, torch.Tensor) for v in state.values()):
            continue  # extra (non-tensor) state: the core's codec path keeps it
        found.append(_Model(checkpoint.key_of(wrapped), wrapped, core, library, state))
    # A transformers model alone (a GPT-2 under "model") is not a pipeline component: the
    # core keeps it under its key, with its frozen tensors in files that incremental saves reuse.
    taken = [m for m in found if m.library == layout.DIFFUSERS or diffusion or opts.name_for(m.key, m.wrapped, m.core)]
    return taken, emas, schedulers


def reserve_folders(
    checkpoint: Any, models: list[Any], taken: list[_Model], objects: list[tuple[str, Any]], opts: settings.Settings
) -> tuple[dict[str, str], set[str]]:
    """Folder names given in code first; then the models' derived names around them.

    Every stable key is reserved (a plugin that ran before may have written ``<key>/``),
    bar the keys of what this plugin takes. Sets ``folder`` of every model in ``taken``.

    Returns:
        ``(key -> folder name given in code, every name in use)``.

    Raises:
        StatekitError: a name given in code is used twice.
    """
    used = set(checkpoint.objects) | set(checkpoint.model_keys) | {checkpoint.key_of(m) for m in models} | {"rng"}
    used -= {m.key for m in taken} | {k for k, _ in objects}
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
    for key, obj in objects:
        reserve(key, obj)
    for m in taken:
        m.folder = explicit.get(m.key) or layout.dedupe(layout.default_folder(m.class_name, m.library), used)
    return explicit, used


def pair_emas(
    emas: list[tuple[str, Any]], taken: list[_Model], opts: settings.Settings, explicit: Mapping[str, str], used: set[str]
) -> list[_Ema]:
    """The EMAs that can be paired with a model, with their folders and counters.

    Raises:
        StatekitError: ambiguous or impossible pairing (see :func:`_pair_ema`).
    """
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
    return paired


def write_models(checkpoint: Any, models: list[Any], weights: list[Any], taken: list[_Model], max_bytes: int) -> None:
    """Write each taken model's folder (rank 0), record it, and take it from the core."""
    for m in taken:
        files = _write_folder(checkpoint, m.folder, m.library, _config_of(m), m.state, max_bytes) if checkpoint.rank == 0 else []
        checkpoint.records[m.key] = {"kind": "model", "folder": m.folder, "class": m.class_name, "library": m.library, "weights": files}
        _take_model(models, weights, m.wrapped)


def write_emas(checkpoint: Any, paired: list[_Ema], max_bytes: int) -> None:
    """Write each paired EMA's folder (rank 0), record it, and claim it."""
    for e in paired:
        # EMAModel.save_pretrained registers its counters into the config the same way
        config = {**e.config, **{k: v for k, v in e.counters.items() if k in EMA_COUNTERS}}
        state = dict(zip(e.names, e.ema.shadow_params))
        files = _write_folder(checkpoint, e.folder, e.library, config, state, max_bytes) if checkpoint.rank == 0 else []
        checkpoint.records[e.key] = {
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
        claim(checkpoint.objects, e.key)


def write_schedulers(checkpoint: Any, schedulers: list[tuple[str, Any]], folders: Mapping[str, str]) -> None:
    """Write each noise scheduler's ``scheduler_config.json`` (rank 0), record it, and claim it."""
    for key, wrapper in schedulers:
        folder = folders[key]
        if checkpoint.rank == 0:
            with checkpoint.open(f"{folder}/{layout.SCHEDULER_CONFIG_NAME}", "wb") as f:
                f.write(layout.hf_json(wrapper.config_json()))
        checkpoint.records[key] = {"kind": "scheduler", "folder": folder, "class": wrapper.class_name, "library": layout.DIFFUSERS}
        claim(checkpoint.objects, key)
