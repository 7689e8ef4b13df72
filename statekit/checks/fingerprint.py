"""The resume fingerprint's comparison: pure functions on typed fingerprints
(:class:`statekit.format.Fingerprint`): the differences and their effects, and a fingerprint
as text lines. :mod:`statekit.api.fingerprint` reads the live run's and warns or raises.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from statekit.format.manifest_types import Fingerprint


@dataclass(frozen=True)
class Difference:
    """One setting that differs between the saved run and the resuming one.

    Attributes:
        setting: the setting's name as messages show it ("dataset length").
        saved: the saved value.
        live: the live value.
        effect: what the difference does to the resume.
        level: ``"info"`` (warned, never raised: versions), ``"warning"`` (raised with
            ``strict_resume``) or ``"error"`` (always raised).
        where: the data loader's key, for a loader setting.
    """

    setting: str
    saved: Any
    live: Any
    effect: str
    level: str = "warning"
    where: str | None = None

    @property
    def message(self) -> str:
        """``"<setting> <saved> -> <live> (<where>): <effect>"``."""
        where = f" ({self.where})" if self.where else ""
        return f"{self.setting} {_show(self.saved)} -> {_show(self.live)}{where}: {self.effect}"


def _show(value: Any) -> str:
    if isinstance(value, list):
        return ", ".join(map(str, value)) or "none"
    return str(value)


_RUN_EFFECTS = {
    "world_size": ("world size", "the data position is remapped to the new world size (elastic resume)"),
    "mixed_precision": (
        "mixed precision",
        "forward and backward run in another precision: losses will not match bit for bit",
    ),
}

_LOADER_EFFECTS = {
    "dataset_length": ("dataset length", "the data position cannot be mapped; the epoch restarts"),
    "batch_size": (
        "per-device batch size",
        "the saved position counts batches of the old size: the interrupted epoch resumes at "
        "another sample (samples are skipped or seen twice)",
    ),
    "sampler": ("sampler", "the epoch's order differs: the saved position names other samples"),
    "shuffle": ("shuffle", "the epoch's order differs: the saved position names other samples"),
    "seed": ("sampler seed", "the epoch's permutation differs: the saved position names other samples"),
    "drop_last": ("drop_last", "the epoch's last, partial batch is kept or dropped differently: the epoch's end differs"),
    "even_batches": (
        "even_batches",
        "the epoch's last batches are padded differently across ranks: samples at the epoch's end are "
        "repeated or left out differently",
    ),
    "num_workers": (
        "num_workers",
        "batches are built in other processes with their own seeds: random transforms inside the dataset "
        "draw other numbers (a deterministic dataset gives the same batches)",
    ),
}

_VERSION_EFFECTS = {
    "torch": "kernels may differ, losses may not match bit for bit",
    "accelerate": "its data sharding and RNG handling may differ, losses may not match bit for bit",
    "python": "the random module and hashing may differ, losses may not match bit for bit",
    "statekit": "informational: the checkpoint was written by another statekit",
}


def compare(saved: Fingerprint, live: Fingerprint) -> list[Difference]:
    """Every difference between a saved fingerprint and the live one, field by field (a field
    None on either side, or a loader only one side has, is not compared).

    Args:
        saved: the manifest's ``fingerprint``.
        live: :func:`statekit.api.fingerprint.compute` of the resuming run.

    Returns:
        The differences, run settings first, then per data loader, then versions.
    """
    out = []
    if _differs(saved.gradient_accumulation_steps, live.gradient_accumulation_steps):
        out.append(_accumulation(saved, live))
    for field, (setting, effect) in _RUN_EFFECTS.items():
        if _differs(getattr(saved, field), getattr(live, field)):
            out.append(Difference(setting, getattr(saved, field), getattr(live, field), effect))
    if _differs(saved.rng, live.rng):
        out.append(_rng(list(saved.rng or ()), list(live.rng or ())))
    live_loaders = live.dataloaders or {}
    for name, loader in sorted((saved.dataloaders or {}).items()):
        other = live_loaders.get(name)
        if other is None:
            continue
        for field, (setting, effect) in _LOADER_EFFECTS.items():
            if _differs(getattr(loader, field), getattr(other, field)):
                out.append(Difference(setting, getattr(loader, field), getattr(other, field), effect, where=name))
    unrestored = _unrestored(saved.objects, live.objects)
    if unrestored is not None:
        out.append(unrestored)
    saved_versions, live_versions = saved.versions or {}, live.versions or {}
    for name, effect in _VERSION_EFFECTS.items():
        if _differs(saved_versions.get(name), live_versions.get(name)):
            out.append(Difference(name, saved_versions[name], live_versions[name], effect, level="info"))
    return out


def _differs(saved: Any, live: Any) -> bool:
    if isinstance(saved, (list, tuple)) and isinstance(live, (list, tuple)):
        return sorted(map(str, saved)) != sorted(map(str, live))
    return saved is not None and live is not None and saved != live


def _accumulation(saved: Fingerprint, live: Fingerprint) -> Difference:
    before, after = saved.gradient_accumulation_steps, live.gradient_accumulation_steps
    if saved.accumulating:
        return Difference(
            "gradient accumulation steps",
            before,
            after,
            f"the checkpoint holds gradients saved mid-accumulation (a window of {before} micro-batches), "
            f"which cannot be used in windows of {after}; resume with gradient_accumulation_steps={before} "
            "or from a checkpoint saved at an optimizer step (accelerator.sync_gradients True)",
            level="error",
        )
    return Difference(
        "gradient accumulation steps",
        before,
        after,
        "each optimizer step sums another number of micro-batches: optimizer steps and the "
        "learning-rate schedule after the resume differ from the saved run's",
    )


def _unrestored(saved: Any, live: Any) -> Difference | None:
    """The saved objects (model, optimizer, scheduler, data loader...) the resuming run has
    no object for: their state would be left behind without a word."""
    if not isinstance(saved, Mapping) or not isinstance(live, Mapping):
        return None
    left = sorted(k for k in saved if k not in live)
    if not left:
        return None
    named = ", ".join(f"{k} ({saved[k]})" for k in left)
    return Difference(
        "objects",
        sorted(saved),
        sorted(live),
        f"the checkpoint's {named} {'is' if len(left) == 1 else 'are'} not restored: the resuming run has no "
        f"such object; pass {'it' if len(left) == 1 else 'them'} to "
        "accelerator.prepare() (or register_for_checkpointing()) in the saved run's order, or, without "
        "Accelerate, under the same key in the mapping given to statekit.load",
    )


def _rng(saved: list[str], live: list[str]) -> Difference:
    lost = sorted(set(saved) - set(live))
    new = sorted(set(live) - set(saved))
    parts = []
    if lost:
        parts.append(f"the saved {', '.join(lost)} random state is not restored here (statekit-rng not installed, "
                     "or another device)")
    if new:
        parts.append(f"the checkpoint holds no {', '.join(new)} random state; those generators continue from "
                     "this process's seed")
    return Difference("RNG state", sorted(saved), sorted(live), "; ".join(parts) + ": random draws (dropout, "
                      "augmentation) differ from the saved run's")


def describe(fingerprint: Fingerprint) -> list[str]:
    """A fingerprint as text lines (``statekit inspect``): the run's settings, one line
    per data loader, the versions; null fields are shown as ``-``.

    Args:
        fingerprint: a manifest's ``fingerprint``.

    Returns:
        The lines, without a trailing newline.
    """
    def shown(value: Any) -> Any:
        return "-" if value is None else value

    f = fingerprint
    accumulating = " (saved mid-accumulation)" if f.accumulating else ""
    lines = [
        f"world size {shown(f.world_size)}, gradient accumulation steps {shown(f.gradient_accumulation_steps)}"
        f"{accumulating}, mixed precision {shown(f.mixed_precision)}, RNG {_show(list(f.rng or ()))}"
    ]
    for key, loader in sorted((f.dataloaders or {}).items()):
        lines.append(f"{key}: " + ", ".join(f"{name} {shown(getattr(loader, field))}"
                                            for field, (name, _) in _LOADER_EFFECTS.items()))
    if f.versions:
        lines.append("versions: " + ", ".join(f"{k} {v}" for k, v in f.versions.items()))
    return lines
