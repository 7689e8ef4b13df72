"""A peft model in an export (:mod:`statekit.api.export`): its LoRA adapter under the names
peft's ``save_pretrained`` writes (:func:`adapter_names`), or its base model with the adapter
merged as peft's ``merge_and_unload()`` computes it (:func:`merged_names`, :class:`LoraMerge`;
https://github.com/huggingface/peft/blob/main/src/peft/tuners/lora/layer.py). docs/export.md,
"What each checkpoint kind becomes".
"""

from __future__ import annotations

import dataclasses
import json
from collections import OrderedDict

import torch

from statekit.engine.export_source import ExportTensor
from statekit.errors import InvalidOptionError

__all__ = ["PEFT_PREFIX", "LoraMerge", "adapter_names", "base_name", "merged_names"]


@dataclasses.dataclass(frozen=True)
class LoraMerge:
    """A LoRA adapter merged into one base weight: ``weight + transpose(B @ A) * scaling``."""

    lora_a: str
    lora_b: str
    scaling: float
    fan_in_fan_out: bool

    def apply(self, weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``weight`` with the adapter added in place, as peft's ``lora.Linear.merge``
        (``safe_merge=False``) and ``get_delta_weight`` compute it
        (https://github.com/huggingface/peft/blob/main/src/peft/tuners/lora/layer.py)."""
        dtype = b.dtype
        half_on_cpu = dtype in (torch.float16, torch.bfloat16)  # peft casts to fp32 on the CPU
        if half_on_cpu:
            a, b = a.float(), b.float()
        delta = b @ a
        delta = delta.T if self.fan_in_fan_out else delta
        delta.mul_(self.scaling)
        if half_on_cpu:
            delta = delta.to(dtype)
        weight += delta
        return weight


def adapter_names(names: OrderedDict[str, ExportTensor], config: bytes, adapter: str, key: str, url: str) -> OrderedDict[str, ExportTensor]:
    """A saved ``PeftModel``'s adapter tensors under the names peft's ``save_pretrained``
    writes (``...lora_A.default.weight`` -> ``...lora_A.weight``); LoRA without bias or
    ``modules_to_save`` only."""
    body = json.loads(config.decode("utf-8"))
    peft_type = body.get("peft_type")
    if peft_type != "LORA" or body.get("bias", "none") != "none" or body.get("modules_to_save"):
        raise InvalidOptionError(
            f"config: an adapter export supports LoRA with bias='none' and no modules_to_save (got peft_type={peft_type!r}, "
            f"bias={body.get('bias')!r}, modules_to_save={body.get('modules_to_save')!r}); save such a model with "
            "StatekitTrainer, whose checkpoint is peft's own adapter folder"
        )
    marker = f".{adapter}."
    out: OrderedDict[str, ExportTensor] = OrderedDict()
    for name, t in names.items():
        if "lora_" in name and marker in name:
            out[name.replace(f".{adapter}", "", 1)] = t
    if not out:
        raise InvalidOptionError(f"adapter_name={adapter!r}: model {key!r} of {url} has no LoRA tensor of that adapter")
    return out


PEFT_PREFIX = "base_model.model."
"""The prefix ``PeftModel.state_dict()`` puts before the base model's names."""


def base_name(name: str) -> str:
    """A saved ``PeftModel``'s state-dict name under the base model's (``base_model.model.x.base_layer.weight`` -> ``x.weight``)."""
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def merged_names(names: OrderedDict[str, ExportTensor], config: bytes, adapter: str, key: str,
                  url: str) -> tuple[OrderedDict[str, ExportTensor], dict[str, LoraMerge]]:
    """A saved ``PeftModel``'s base tensors under the base model's names
    (``base_model.model.x.base_layer.weight`` -> ``x.weight``), each LoRA-adapted weight with
    the adapter ``adapter`` to merge into it; the adapters' tensors left out."""
    body = json.loads(config.decode("utf-8"))
    unsupported = [what for what, bad in (
        (f"peft_type={body.get('peft_type')!r}", body.get("peft_type") != "LORA"),
        ("use_dora=True", bool(body.get("use_dora"))), ("alpha_pattern", bool(body.get("alpha_pattern"))),
        ("lora_bias=True", bool(body.get("lora_bias"))), (f"bias={body.get('bias')!r}", body.get("bias", "none") != "none"),
        ("modules_to_save", bool(body.get("modules_to_save"))),
        ("an embedding adapter", any("lora_embedding_" in n for n in names))) if bad]
    if unsupported:
        raise InvalidOptionError(f"merge_adapter=True: model {key!r} of {url}: merging supports plain LoRA on linear "
                                 f"layers; this adapter has {', '.join(unsupported)} (export the adapter instead)")
    alpha, rslora, fan_in_fan_out = body.get("lora_alpha", 8), bool(body.get("use_rslora")), bool(body.get("fan_in_fan_out"))
    out: OrderedDict[str, ExportTensor] = OrderedDict()
    merges: dict[str, LoraMerge] = {}
    for name, t in names.items():
        if ".lora_" in name:
            continue
        module, _, leaf = name.removeprefix(PEFT_PREFIX).rpartition(".")
        if module.endswith(".base_layer"):
            module = module.removesuffix(".base_layer")
            a, b = (f"{name.rsplit('.base_layer.', 1)[0]}.lora_{x}.{adapter}.weight" for x in ("A", "B"))
            if leaf == "weight" and a in names and b in names:
                ta = names[a]
                if len(ta.shape) != 2:
                    raise InvalidOptionError(f"merge_adapter=True: {a} of {url} is a {len(ta.shape)}-d adapter "
                                             "(a convolution): merging supports linear layers")
                r = ta.shape[0]
                merges[f"{module}.{leaf}"] = LoraMerge(a, b, alpha / (r ** 0.5) if rslora else alpha / r, fan_in_fan_out)
        out[f"{module}.{leaf}" if module else leaf] = t
    if not merges:
        raise InvalidOptionError(f"adapter_name={adapter!r}: model {key!r} of {url} has no LoRA tensor of that adapter to merge")
    return out, merges
