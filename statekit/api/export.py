"""Export one model of a checkpoint as a Hugging Face folder (``from_pretrained``), streamed and self-verified.

``statekit.export_pretrained`` and ``statekit convert CKPT OUT --to hf``; what is written and
why, the checkpoint kinds and the memory measured: ``docs/export.md``. The tensors come one
at a time from a :class:`ModelSource`: the core's own tensor files (models written by
``statekit.save``, the Accelerate bridge, ``CheckpointManager``, statekit-offload), or the
source the owning plugin offers (``STATEKIT_EXPORT_SOURCE`` of its module: statekit-fsdp
assembles each tensor from its shards, statekit-transformers and statekit-diffusers read
their folders). Shards follow ``huggingface_hub.split_state_dict_into_shards_factory``
(https://github.com/huggingface/huggingface_hub/blob/main/src/huggingface_hub/serialization/_base.py)
and transformers' names (``model-00001-of-00002.safetensors``, ``model.safetensors.index.json``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import tempfile
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from statekit.checks import digest as sd
from statekit.engine.context import CORE, Checkpoint
from statekit.api.export_peft import PEFT_PREFIX, LoraMerge, adapter_names, base_name, merged_names
from statekit.engine.export_source import ExportTensor, ModelSource, TensorFiles
from statekit.engine.read import model_tensor_files
from statekit.errors import (
    CheckpointExistsError,
    CorruptCheckpointError,
    InvalidOptionError,
    PluginMissingError,
    StatekitError,
    StatekitWarning,
    UnsupportedDtypeError,
    warn_user,
)
from statekit.format import CHUNK_BYTES, SAFETENSORS_CODES, encode_header, tensor_bytes
from statekit.format.manifest import read_manifest
from statekit.hooks.registry import get_plugin_manager
from statekit.storage import Storage

logger = logging.getLogger("statekit.export")

__all__ = ["ExportResult", "ExportTensor", "ModelSource", "TensorFiles", "export_pretrained", "model_source", "parse_shard_size"]

EXPORT_SOURCE = "STATEKIT_EXPORT_SOURCE"
"""The plugin module attribute the exporter looks up on a model's owner: ``fn(checkpoint,
key) -> ModelSource | None`` (``checkpoint``: a verifying load :class:`statekit.Checkpoint`)."""

DEFAULT_MAX_SHARD_SIZE = "5GB"
"""transformers' ``save_pretrained`` default (5 * 10**9 bytes)."""

_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_WEIGHT_FILE = re.compile(r".*\.(safetensors|bin|pt|pth|ckpt|msgpack|h5)$|.*\.index\.json$")


# --------------------------------------------------------------------------- result


@dataclasses.dataclass(frozen=True)
class ExportResult:
    """What :func:`export_pretrained` wrote.

    Attributes:
        url: the output folder.
        key: the model exported (its key in the checkpoint).
        files: the files written, in order (weights, index, then the others).
        tensors: the number of tensors written.
        total_size: the bytes of tensor data written (``metadata.total_size`` of the index).
        digests_compared: tensors compared with the checkpoint's ``state_digest``.
        dropped_ties: tied names not written (each is the same tensor as one written).
    """

    url: str
    key: str
    files: tuple[str, ...]
    tensors: int
    total_size: int
    digests_compared: int
    dropped_ties: tuple[str, ...]


# --------------------------------------------------------------------------- options


def parse_shard_size(value: Any) -> int:
    """``max_shard_size`` in bytes: an int, or a string such as ``"5GB"`` (10**9) or ``"2GiB"`` (2**30).

    Raises:
        InvalidOptionError: not a positive size (names ``max_shard_size`` and the value).
    """
    size: float | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]I?B)\s*", value.upper())
        if m:
            size = float(m.group(1)) * _UNITS[m.group(2)]
    if size is None or size < 1:
        raise InvalidOptionError(f"max_shard_size={value!r}: must be a positive number of bytes or a size such as '5GB' or '500MiB'")
    return int(size)


def _config_files(config: Any) -> dict[str, bytes]:
    """The files one ``config`` item stands for (see :func:`export_pretrained`)."""
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if os.path.isdir(path):
            out = {}
            for name in sorted(os.listdir(path)):
                full = os.path.join(path, name)
                if os.path.isfile(full) and not _WEIGHT_FILE.match(name):
                    with open(full, "rb") as f:
                        out[name] = f.read()
            return out
        if os.path.isfile(path):
            with open(path, "rb") as f:
                data = f.read()
            return {_config_name(_json_of(data, path)): data}
        raise InvalidOptionError(f"config={path!r}: no such file or directory")
    if hasattr(config, "save_pretrained") and not isinstance(config, torch.nn.Module):
        with tempfile.TemporaryDirectory(prefix="statekit-export-") as tmp:
            config.save_pretrained(tmp)  # the library's own writer (a config, a tokenizer, a peft config)
            return _config_files(tmp)
    if isinstance(config, Mapping):
        body = json.loads(json.dumps(dict(config), default=_json_default))
        return {_config_name(body): (json.dumps(body, indent=2, sort_keys=True) + "\n").encode("utf-8")}
    raise InvalidOptionError(
        f"config={type(config).__name__}: give a transformers/diffusers/peft config, a tokenizer, a dict, "
        "or the path of a config file or folder"
    )


def _json_default(value: Any) -> Any:
    if isinstance(value, (set, frozenset, tuple)):
        return sorted(value) if isinstance(value, (set, frozenset)) else list(value)
    raise InvalidOptionError(f"config: value {value!r} is not JSON")


def _json_of(data: bytes, source: str) -> Any:
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidOptionError(f"config={source!r}: not a JSON file ({exc})") from None


def _config_name(body: Any) -> str:
    return "adapter_config.json" if isinstance(body, Mapping) and "peft_type" in body else "config.json"


# --------------------------------------------------------------------------- sources


def model_source(checkpoint: Checkpoint, key: str) -> ModelSource:
    """The :class:`ModelSource` of model ``key``: its owner plugin's (``STATEKIT_EXPORT_SOURCE``),
    else the core's tensor files (``<key>.safetensors`` and the object's other tensor files).

    Raises:
        PluginMissingError: the owner plugin is not installed and the files are not the core's.
        StatekitError: the owner offers no export and the files are not the core's.
    """
    manifest = checkpoint.manifest
    assert manifest is not None
    obj = manifest.objects[key]
    plugin = get_plugin_manager().get_plugin(obj.owner) if obj.owner != CORE else None
    make = getattr(plugin, EXPORT_SOURCE, None)
    if make is not None:
        source = make(checkpoint, key)
        if source is not None:
            return source
    rels = _core_tensor_files(key, obj.files or (), manifest.files)
    if rels:
        return TensorFiles(checkpoint, rels, checkpoint.referenced(key)).source()
    if obj.owner != CORE and plugin is None:
        distribution = obj.owner_distribution or f"statekit-{obj.owner}"
        raise PluginMissingError(
            f"{checkpoint.url}: model {key!r} was saved by plugin {obj.owner!r}, which is not installed: "
            f"pip install {distribution}", obj.owner, distribution,
        )
    raise StatekitError(f"{checkpoint.url}: model {key!r} (saved by {obj.owner!r}) is not stored as tensor files "
                        "statekit can export, and its plugin offers no export")


def _core_tensor_files(key: str, object_files: Sequence[str], files: Mapping[str, Any]) -> list[str]:
    """``<key>.safetensors`` and the object's other ``<key>.*.safetensors`` files (an
    incremental save's frozen files, statekit-offload's offloaded files), in name order."""
    first = f"{key}.safetensors"
    if first not in files:
        return []
    others = {rel for rel in object_files if rel != first and rel.startswith(f"{key}.") and rel.endswith(".safetensors")}
    others |= set(model_tensor_files(key, list(files))[1:])
    return [first, *sorted(others)]


# --------------------------------------------------------------------------- the export


def export_pretrained(
    ckpt_url: str,
    out_url: str,
    *,
    model_key: str | None = None,
    config: Any = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    adapter_name: str = "default",
    merge_adapter: bool = False,
    storage_options: dict[str, Any] | None = None,
    overwrite: bool = False,
    verify: bool = True,
) -> ExportResult:
    """Write one model of a committed checkpoint as a folder ``from_pretrained`` loads.

    Weights go to ``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` shards and
    ``model.safetensors.index.json`` above ``max_shard_size`` (``adapter_model.safetensors``
    for an adapter, ``diffusion_pytorch_model*`` for a diffusers model), metadata
    ``{"format": "pt"}``, a tied weight once (transformers' ``_tied_weights_keys`` decide
    which name when the config names the class). Tensors are read, digested and written
    one at a time (peak: about one tensor plus 16 MiB); each is compared with the
    checkpoint's ``state_digest`` where it records one, and every source file's checksum
    is checked first. Details: ``docs/export.md``.

    Args:
        ckpt_url: the checkpoint (any fsspec URL).
        out_url: the output folder (any fsspec URL; created; must be empty unless ``overwrite``).
        model_key: which model (its key in the checkpoint); None: the only one.
        config: what to write beside the weights, or a list of such: a transformers
            ``PretrainedConfig``, a tokenizer or a peft config (written by their own
            ``save_pretrained``), a dict (``adapter_config.json`` when it has ``peft_type``,
            else ``config.json``), or the path of a JSON file or of a folder (its files but
            weights are copied). Replaces the files of the same name the checkpoint recorded.
            An adapter config turns a saved peft model into its adapter (LoRA only).
        max_shard_size: bytes per weight file, an int or ``"5GB"``-style (10**9; ``"GiB"``: 2**30).
        adapter_name: the peft adapter to export, with an adapter config.
        merge_adapter: with an adapter config, write the base model with that LoRA adapter
            merged into its weights (``W + scaling * B @ A``, as peft's ``merge_and_unload()``
            computes it, bit for bit) under the base model's names, instead of the adapter;
            ``adapter_config.json`` is then not written (pass the base model's config).
        storage_options: fsspec options for both URLs.
        overwrite: write into a non-empty ``out_url`` (files of the same name replaced).
        verify: check the source files' checksums and the tensors' digests.

    Returns:
        An :class:`ExportResult`.

    Raises:
        InvalidOptionError: a bad ``max_shard_size``, ``model_key`` or ``config`` (named);
            ``merge_adapter`` without a LoRA adapter config, or with one whose variant
            (DoRA, ``alpha_pattern``, ``lora_bias``, embedding or convolution layers) it
            does not merge.
        CheckpointExistsError: ``out_url`` is not empty and ``overwrite`` is False.
        CheckpointNotFoundError, IncompleteCheckpointError: no committed checkpoint.
        CorruptCheckpointError: a source file fails its checksum, or a tensor's digest
            differs from the one recorded (names the tensor); what was written is removed.
        UnsupportedDtypeError: a dtype safetensors cannot store (names the tensor).
        PluginMissingError, StatekitError: the model cannot be read (names owner and key).
    """
    shard_bytes = parse_shard_size(max_shard_size)
    extra = _user_files(config)
    storage = Storage(ckpt_url, storage_options)
    manifest = read_manifest(storage)
    key = _model_key(manifest, model_key, storage.url)
    out = Storage(out_url, storage_options)
    out.invalidate()
    if not overwrite and out.exists() and out.listdir():
        raise CheckpointExistsError(f"{out.url} exists and is not empty; choose a new folder or pass overwrite=True")
    checkpoint = Checkpoint(storage, mode="load", manifest=manifest, verify=verify)
    source = model_source(checkpoint, key)
    try:
        files = {**source.files, **extra}
        plan = _plan(source, files, key, adapter_name, storage.url, manifest, merge_adapter)
        if merge_adapter:
            files = {name: data for name, data in files.items() if name != "adapter_config.json"}
        if verify and source.verify is not None:
            source.verify()
        stale = _weight_files(out) if overwrite else set()
        result = _write(checkpoint, key, source, plan, files, out, shard_bytes, verify)
    finally:
        source.close()
    for rel in sorted(stale - set(result.files)):  # an earlier export's weights: from_pretrained would read them
        logger.info("export to %s: removed %s, the weights of an earlier export (overwrite=True)", out.url, rel)
        out.remove(rel)
    mismatch = _config_mismatch(files.get("config.json"), plan)
    if mismatch:
        warn_user(f"exported {key!r} to {out.url}: {mismatch}; from_pretrained would initialise what is missing "
                  "at random: is config.json the config of this model?", StatekitWarning)
    if config is None and "config.json" not in result.files and "adapter_config.json" not in result.files:
        warn_user(f"exported {key!r} to {out.url} without a config.json: from_pretrained needs one "
                  "(pass config=, or --config on the command line)", StatekitWarning)
    return result


_EXPORT_WEIGHTS = re.compile(r"^(model|adapter_model|diffusion_pytorch_model)(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?$")


def _weight_files(out: Storage) -> set[str]:
    """The weight files (and index) an export names so, already in ``out``."""
    return {name for name in out.listdir() if _EXPORT_WEIGHTS.match(name)} if out.exists() else set()


def _user_files(config: Any) -> dict[str, bytes]:
    if config is None:
        return {}
    items = config if isinstance(config, (list, tuple)) else [config]
    out: dict[str, bytes] = {}
    for item in items:
        out.update(_config_files(item))
    return out


def _model_key(manifest: Any, model_key: str | None, url: str) -> str:
    models = [k for k, o in manifest.objects.items() if o.kind == "model"]
    if model_key is not None:
        if model_key not in models:
            raise InvalidOptionError(f"model_key={model_key!r}: {url} has no such model (models: {models or 'none'})")
        return model_key
    if not models:
        raise StatekitError(f"{url}: the checkpoint holds no model to export")
    if len(models) > 1:
        raise InvalidOptionError(f"model_key=None: {url} holds several models ({', '.join(models)}); name one")
    return models[0]


@dataclasses.dataclass
class _Plan:
    names: OrderedDict[str, ExportTensor]  # output name -> the source tensor
    weights_name: str
    single_file: bool
    state_paths: bool
    dropped: list[str]
    merges: dict[str, LoraMerge] = dataclasses.field(default_factory=dict)  # output name -> the adapter merged into it


def _plan(source: ModelSource, files: Mapping[str, bytes], key: str, adapter_name: str, url: str, manifest: Any,
          merge_adapter: bool = False) -> _Plan:
    """Output names: ties once (which name: transformers' ``_tied_weights_keys`` of the
    class the config names, else the stored one), an adapter's selection and names, or
    the base names with the adapter merged (``merge_adapter``)."""
    keep_as = _tie_targets(files)
    source = _recorded_ties(source, manifest, key)
    names: OrderedDict[str, ExportTensor] = OrderedDict()
    groups: dict[str, list[str]] = {}
    for alias, stored in source.aliases.items():
        groups.setdefault(stored, []).append(alias)
    dropped = []
    for t in source.tensors:
        members = [t.name, *groups.get(t.name, [])]
        out_name = next((keep_as[m] for m in members if m in keep_as and keep_as[m] in members), t.name)
        names[out_name] = t
        dropped += [m for m in members if m != out_name]
    weights_name, single = source.weights_name, source.weights_name == "adapter_model"
    if merge_adapter:
        if source.weights_name == "adapter_model":
            raise InvalidOptionError(f"merge_adapter=True: model {key!r} of {url} holds a LoRA adapter only (a Trainer "
                                     "checkpoint of a peft model), not its base: export the adapter, then "
                                     "PeftModel.from_pretrained(base, OUT).merge_and_unload()")
        if "adapter_config.json" not in files or source.weights_name != "model":
            raise InvalidOptionError(f"merge_adapter=True: model {key!r} of {url} needs a LoRA adapter config "
                                     "(config=peft_model.peft_config['default'], or an adapter_config.json)")
        names, merges = merged_names(names, files["adapter_config.json"], adapter_name, key, url)
        dropped = [base_name(n) for n in dropped]
        return _Plan(names, weights_name, single, source.state_paths, dropped, merges)
    if "adapter_config.json" in files and source.weights_name == "model":
        names = adapter_names(names, files["adapter_config.json"], adapter_name, key, url)
        weights_name, single = "adapter_model", True
    elif source.weights_name == "model" and any(n.startswith(PEFT_PREFIX) and ".lora_" in n for n in names):
        raise InvalidOptionError(
            f"model {key!r} of {url} is a peft LoRA model (its tensors are named {PEFT_PREFIX}...base_layer / lora_*), "
            "which from_pretrained of a base model cannot read: pass its adapter config beside the base's "
            "(config=[base_config, peft_model.peft_config['default']]) for the adapter folder, and add "
            "merge_adapter=True (--merge-adapter) for the base with the adapter merged")
    return _Plan(names, weights_name, single, source.state_paths, dropped)


def _recorded_ties(source: ModelSource, manifest: Any, key: str) -> ModelSource:
    """Ties the file does not hold as aliases (a sharded model's tensors are stored per
    name) but the checkpoint recorded (``state_digest.ties``: one storage at save, and equal
    recorded digests): the later names become aliases of the first."""
    recorded = manifest.state_digest
    groups = (recorded.ties or {}).get(key) if recorded is not None and source.state_paths else None
    if not groups:
        return source
    stored = {t.name for t in source.tensors}
    digests = recorded.objects.get(key) or {}
    aliases = dict(source.aliases)
    for group in groups:
        present = [name for name in group if name in stored]
        values = {digests.get(name) for name in present}
        if len(present) > 1 and len(values) == 1 and None not in values:
            aliases.update({name: present[0] for name in present[1:]})
    if aliases == source.aliases:
        return source
    return dataclasses.replace(source, tensors=[t for t in source.tensors if t.name not in aliases], aliases=aliases)


def _config_mismatch(config_json: bytes | None, plan: _Plan) -> str | None:
    """What the model class ``config.json`` names (``architectures``, built on the meta
    device from it) expects that the exported weights lack or shape otherwise, in words;
    None when they agree, or when transformers or the class is not available."""
    if config_json is None:
        return None
    try:
        import transformers

        body = json.loads(config_json.decode("utf-8"))
        cls = getattr(transformers, (body.get("architectures") or [None])[0] or "", None)
        if cls is None or "model_type" not in body:
            return None
        built = transformers.AutoConfig.for_model(**body)
        with torch.device("meta"):
            expected = {k: tuple(v.shape) for k, v in cls(built).state_dict().items()}
    except Exception:  # noqa: BLE001 - an exotic config or class: from_pretrained will say
        return None
    written = {name: t.shape for name, t in plan.names.items()}
    missing = sorted(set(expected) - set(written) - set(plan.dropped))
    shapes = sorted(n for n in set(expected) & set(written) if tuple(written[n]) != expected[n])
    if not missing and not shapes:
        return None
    parts = []
    if missing:
        parts.append(f"{len(missing)} tensors {cls.__name__} expects are not in the weights (first {missing[0]!r})")
    if shapes:
        n = shapes[0]
        parts.append(f"{len(shapes)} tensors have other shapes than {cls.__name__} expects (first {n!r}: "
                     f"{list(written[n])} written, {list(expected[n])} expected)")
    return "; ".join(parts)


def _tie_targets(files: Mapping[str, bytes]) -> dict[str, str]:
    """``tied name -> the name transformers keeps`` for the class ``config.json`` names
    (``architectures``), from its ``_tied_weights_keys``; empty when unknown."""
    data = files.get("config.json")
    if data is None:
        return {}
    try:
        body = json.loads(data.decode("utf-8"))
        import transformers

        cls = getattr(transformers, (body.get("architectures") or [None])[0] or "", None)
    except Exception:  # noqa: BLE001 - no transformers, no class: aliases decide
        return {}
    tied = getattr(cls, "_tied_weights_keys", None)
    return {str(k): str(v) for k, v in tied.items()} if isinstance(tied, Mapping) else {}


def _shards(plan: _Plan, shard_bytes: int) -> list[tuple[str, list[str]]]:
    """``(file name, output names)`` per weight file, in order."""
    single = f"{plan.weights_name}.safetensors"
    if plan.single_file:
        return [(single, list(plan.names))]
    try:
        from huggingface_hub import split_state_dict_into_shards_factory
    except ImportError:
        split = None
    else:
        split = split_state_dict_into_shards_factory(
            dict(plan.names), get_storage_size=lambda t: t.nbytes, max_shard_size=shard_bytes,
            filename_pattern=plan.weights_name + "{suffix}.safetensors",
        )
    if split is not None:
        return [(f, list(names)) for f, names in split.filename_to_tensors.items()]
    # the same rule without huggingface_hub: in order; a tensor above the limit alone; a new
    # shard when the next tensor would pass it
    groups: list[list[str]] = []
    current: list[str] = []
    size = 0
    for name, t in plan.names.items():
        if t.nbytes > shard_bytes:
            groups.append([name])
            continue
        if current and size + t.nbytes > shard_bytes:
            groups.append(current)
            current, size = [], 0
        current.append(name)
        size += t.nbytes
    if current or not groups:
        groups.append(current)
    if len(groups) == 1:
        return [(single, groups[0])]
    n = len(groups)
    return [(f"{plan.weights_name}-{i + 1:05d}-of-{n:05d}.safetensors", g) for i, g in enumerate(groups)]


class _Digests:
    """The checkpoint's recorded digests of model ``key`` and the sampling they used."""

    def __init__(self, manifest: Any, key: str, enabled: bool) -> None:
        recorded = manifest.state_digest if enabled else None
        self.sampling = sd.Sampling.from_json(recorded.sampling) if recorded is not None else None
        self.by_path: Mapping[str, str] = (recorded.objects.get(key) or {}) if recorded is not None else {}
        self.compared = 0

    def check(self, t: torch.Tensor, path: str, out_name: str, url: str, key: str) -> None:
        value = self.by_path.get(path)
        if value is None or self.sampling is None:
            return
        dtype, _, expected = value.partition(":")
        if dtype != str(t.dtype).removeprefix("torch."):
            return  # recorded in another dtype (a mixed-precision live copy): not comparable
        actual = sd.tensor_digest(t, self.sampling)
        if actual != expected:
            raise CorruptCheckpointError(
                f"{url}: tensor {path!r} of model {key!r} (exported as {out_name!r}) does not match the checkpoint's "
                f"state digest (recorded {expected}, read {actual}): the checkpoint's data differs from what was saved",
                path=url,
            )
        self.compared += 1


def _write(checkpoint: Checkpoint, key: str, source: ModelSource, plan: _Plan, files: Mapping[str, bytes],
           out: Storage, shard_bytes: int, verify: bool) -> ExportResult:
    shards = _shards(plan, shard_bytes)
    digests = _Digests(checkpoint.manifest, key, verify and plan.state_paths)
    written: list[str] = []
    total = 0
    try:
        for file_name, names in shards:
            specs = []
            for name in names:
                t = plan.names[name]
                code = SAFETENSORS_CODES.get(t.dtype)
                if code is None:
                    raise UnsupportedDtypeError(f"{checkpoint.url}: tensor {t.name!r} of model {key!r} has dtype {t.dtype}, "
                                                "which safetensors cannot store natively")
                specs.append((name, code, t.shape, t.nbytes))
            header = encode_header(specs, {"format": "pt"})
            written.append(file_name)
            with out.open_write(file_name) as f:
                f.write(header)
                for name in names:
                    entry = plan.names[name]
                    tensor = source.read(entry.name)
                    if tensor.dtype != entry.dtype or tuple(tensor.shape) != entry.shape:
                        raise CorruptCheckpointError(
                            f"{checkpoint.url}: tensor {entry.name!r} of model {key!r} reads as {list(tensor.shape)} "
                            f"{tensor.dtype}, its header says {list(entry.shape)} {entry.dtype}", path=checkpoint.url)
                    digests.check(tensor, entry.name, name, checkpoint.url, key)
                    merge = plan.merges.get(name)
                    if merge is not None:
                        a, b = source.read(merge.lora_a), source.read(merge.lora_b)
                        digests.check(a, merge.lora_a, name, checkpoint.url, key)
                        digests.check(b, merge.lora_b, name, checkpoint.url, key)
                        tensor = merge.apply(tensor, a, b)
                    for chunk in _chunks(tensor):
                        f.write(chunk)
                    total += entry.nbytes
                    del tensor
        if len(shards) > 1:
            index = {"metadata": {"total_size": total},
                     "weight_map": {name: file_name for file_name, names in shards for name in names}}
            index["weight_map"] = dict(sorted(index["weight_map"].items()))
            index_name = f"{plan.weights_name}.safetensors.index.json"
            out.write_bytes(index_name, (json.dumps(index, indent=2, sort_keys=True) + "\n").encode("utf-8"))
            written.append(index_name)
        for name, data in files.items():
            out.write_bytes(name, data)
            written.append(name)
    except BaseException:
        for name in written:
            try:
                out.remove(name)
            except (OSError, StatekitError):
                logger.warning("statekit.export: could not remove %s after a failed export", out.url_of(name))
        raise
    logger.info("statekit.export: %s -> %s: %d tensors, %d bytes, %d digests compared", checkpoint.url, out.url,
                len(plan.names), total, digests.compared)
    return ExportResult(url=out.url, key=key, files=tuple(written), tensors=len(plan.names), total_size=total,
                        digests_compared=digests.compared, dropped_ties=tuple(plan.dropped))


def _chunks(t: torch.Tensor) -> Iterator[memoryview]:
    view = tensor_bytes(t)
    for start in range(0, len(view), CHUNK_BYTES):
        yield view[start : start + CHUNK_BYTES]
