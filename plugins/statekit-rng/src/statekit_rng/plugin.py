"""statekit-rng: every random-number generator of a run, saved and restored per rank.

What one rank saves, to ``rng/rank-<rank:05d>.json`` (+ ``.safetensors``) through
``checkpoint.save_state`` (no pickle):

* Python's ``random`` module state (``random.getstate()``);
* NumPy's global generator (``numpy.random.get_state()``);
* torch's CPU generator (``torch.get_rng_state()``);
* the generators of every device of the current accelerator (CUDA, XPU, MPS, HPU, a
  PrivateUse1 backend...), found with ``torch.accelerator`` and
  ``torch.get_device_module(device_type)``, with no hard-coded list of backends;
* the ``torch.Generator`` of each data loader among ``checkpoint.objects`` and of its
  sampler, by the loader's stable key.

This is the set Accelerate saves in ``Accelerator.save_state``
(``accelerate/checkpointing.py``: ``save_accelerator_state``, as ``random_states_<i>.pkl``),
plus the data-loader generators, stored without pickle and restored *last* on load.

Ordering: the snapshot is taken first on save (``tryfirst``), and the restore runs last on
load (``trylast``), after every model and object has been loaded. The module sets
``STATEKIT_MANAGES_RNG = True``, so the host runs these hooks outside its RNG guard (which
would otherwise put back the states this plugin restores) and does not warn that random
state is not saved.

World-size or device changes: the states that match are restored, and one
:class:`statekit.StatekitWarning` per load lists exactly what was not (ranks, devices,
data-loader generators). A checkpoint saved without this plugin loads without warnings
from it.

Device discovery can be replaced: the hooks call :func:`discover_accelerator` through
this module's namespace at every call, so a test or an exotic backend can substitute a
function returning ``(device_type, module)`` for any ``module`` that follows
:class:`DeviceRngModule`.
"""

from __future__ import annotations

import hashlib
import random
import re
import warnings
import weakref
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from statekit import CorruptCheckpointError, FormatVersionError, StatekitWarning, hookimpl

if TYPE_CHECKING:
    from statekit.engine.context import Checkpoint

STATEKIT_MANAGES_RNG = True
"""Tells the host that this plugin manages random state itself: no RNG guard around its
hooks, and no "RNG state is not saved" warning."""

STATE_FORMAT = 1
"""Version of the per-rank state file layout written by this module."""

RANK_FILE_BASE = "rng/rank-{rank:05d}"
"""Base path (without ``.json`` / ``.safetensors``) of one rank's RNG state."""

LOADER_ROLE = "loader"
"""Key of a data loader's own generator (``loader.generator``: seeds the worker processes)."""

SAMPLER_ROLE = "sampler"
"""Key of the generator of a data loader's sampler (draws the shuffling permutation)."""

_ROLE_INDEX = {LOADER_ROLE: 0, SAMPLER_ROLE: 1}
_RANK_FILE = re.compile(r"^rng/rank-(\d+)\.json$")

# Data loaders seen by statekit_load_state_pre, by checkpoint: a plugin that takes a
# loader in load_state_pre removes it from checkpoint.objects before the restore runs.
_loaders_at_load: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()


# --------------------------------------------------------------------------- devices


class DeviceRngModule(Protocol):
    """The part of a torch device module (``torch.cuda``, ``torch.xpu``...) this plugin uses.

    ``torch.get_device_module(device_type)`` returns such a module for CUDA, XPU and
    PrivateUse1 backends; :func:`discover_accelerator` adapts modules that only have
    per-device ``get_rng_state`` / ``set_rng_state`` (MPS).
    """

    def device_count(self) -> int:
        """Number of devices of this type visible to the process."""
        ...

    def get_rng_state_all(self) -> list[torch.Tensor]:
        """The generator state of every device, as CPU ``torch.uint8`` tensors."""
        ...

    def set_rng_state_all(self, new_states: Sequence[torch.Tensor]) -> None:
        """Set the generator state of devices ``0 .. len(new_states) - 1``."""
        ...


class _PerDeviceRng:
    """Adapts a device module with only ``get_rng_state(device)`` / ``set_rng_state(state,
    device)`` (``torch.mps``) to :class:`DeviceRngModule`."""

    def __init__(self, module: Any) -> None:
        self._module = module

    def device_count(self) -> int:
        count = getattr(self._module, "device_count", None)
        return int(count()) if callable(count) else 1

    def get_rng_state_all(self) -> list[torch.Tensor]:
        n = self.device_count()
        if n == 1:
            return [self._module.get_rng_state()]
        return [self._module.get_rng_state(i) for i in range(n)]

    def set_rng_state_all(self, new_states: Sequence[torch.Tensor]) -> None:
        if len(new_states) == 1 and self.device_count() == 1:
            self._module.set_rng_state(new_states[0])
            return
        for i, state in enumerate(new_states):
            self._module.set_rng_state(state, i)


def _current_accelerator_type() -> str | None:
    accelerator_api = getattr(torch, "accelerator", None)
    if accelerator_api is not None and hasattr(accelerator_api, "current_accelerator"):  # torch >= 2.6
        if not accelerator_api.is_available():
            return None
        device = accelerator_api.current_accelerator()
        return device.type if device is not None else None
    # torch 2.4 / 2.5: probe the in-tree backends, then the PrivateUse1 backend.
    candidates = ["cuda", "xpu", "mps", torch._C._get_privateuse1_backend_name()]
    for device_type in candidates:
        try:
            module = torch.get_device_module(device_type)
        except (RuntimeError, AttributeError):
            continue
        is_available = getattr(module, "is_available", None)
        if callable(is_available) and is_available():
            return device_type
    return None


def discover_accelerator() -> tuple[str, DeviceRngModule] | None:
    """Find the accelerator of this process and the module that holds its generators.

    Follows ``torch.accelerator.current_accelerator()`` / ``torch.accelerator.is_available()``
    (torch >= 2.6; earlier versions probe ``cuda``, ``xpu``, ``mps`` and the PrivateUse1
    backend) and ``torch.get_device_module(device_type)``, the device-generic path torch
    itself documents, instead of Accelerate's per-backend chain
    (``accelerate.utils.random.set_seed``).

    Hooks look this function up in the module namespace at every call, so it can be
    replaced (``monkeypatch.setattr(statekit_rng.plugin, "discover_accelerator", fake)``).

    Returns:
        ``(device_type, module)`` with ``module`` following :class:`DeviceRngModule`
        (``("cuda", torch.cuda)``), or None when no accelerator is available.

    Raises:
        Whatever torch raises while initialising the device runtime.
    """
    device_type = _current_accelerator_type()
    if device_type is None:
        return None
    module = torch.get_device_module(device_type)
    if not (hasattr(module, "get_rng_state_all") and hasattr(module, "set_rng_state_all")):
        module = _PerDeviceRng(module)
    return device_type, module


# --------------------------------------------------------------------------- data loaders


def _data_loaders(objects: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    from torch.utils.data import DataLoader

    for key, obj in objects.items():
        # Accelerate's DataLoaderShard / DataLoaderDispatcher pass this check: their
        # ``__class__`` property reports the wrapped DataLoader's class.
        if isinstance(obj, DataLoader):
            yield key, obj


def _loader_core(loader: Any) -> Any:
    """The torch DataLoader whose ``__iter__`` runs: Accelerate's adapters wrap one as
    ``base_dataloader`` and delegate reads to it, but an attribute set on the adapter would
    not reach it."""
    base = vars(loader).get("base_dataloader")
    return base if base is not None else loader


def find_sampler(loader: Any) -> Any:
    """Return the sampler that draws a data loader's indices (the one holding its generator).

    Looks, in order, at ``loader.batch_sampler.sampler``, ``loader.batch_sampler.batch_sampler
    .sampler`` (Accelerate's ``BatchSamplerShard`` around the original batch sampler) and
    ``loader.sampler``, looking through a batch sampler found there (a ``BatchSampler``
    passed as ``sampler=`` with ``batch_size=None``), as ``accelerate.data_loader.get_sampler``
    and ``statekit.engine.data.sampler_of`` do.

    Args:
        loader: a ``torch.utils.data.DataLoader`` (or an Accelerate ``DataLoaderShard`` /
            ``DataLoaderDispatcher``).

    Returns:
        The sampler object, or None if the loader has none.
    """
    core = _loader_core(loader)
    batch_sampler = getattr(core, "batch_sampler", None)
    candidates = (
        getattr(batch_sampler, "sampler", None),
        getattr(getattr(batch_sampler, "batch_sampler", None), "sampler", None),
        getattr(core, "sampler", None),
    )
    for candidate in candidates:
        if candidate is None:
            continue
        if not _is_batch_sampler(candidate):
            return candidate
        inner = getattr(candidate, "sampler", None)
        if inner is not None and not _is_batch_sampler(inner):
            return inner
    return None


def _is_batch_sampler(obj: Any) -> bool:
    from torch.utils.data import BatchSampler

    return isinstance(obj, BatchSampler) or hasattr(obj, "batch_size")


def _generator_holders(loader: Any) -> dict[str, Any]:
    """``role -> object with a ``generator`` attribute`` for a data loader."""
    holders = {LOADER_ROLE: _loader_core(loader)}
    sampler = find_sampler(loader)
    if sampler is not None and hasattr(sampler, "generator"):
        holders[SAMPLER_ROLE] = sampler
    return holders


def derive_seed(base_seed: int, key: str, role: str) -> int:
    """A 64-bit seed for one generator, derived without touching any random stream.

    Args:
        base_seed: the run's seed (``torch.initial_seed()``).
        key: stable key of the data loader (``dataloader_0``).
        role: ``"loader"`` or ``"sampler"``.

    Returns:
        An int in ``[0, 2**64)``: the first 8 bytes (little-endian) of BLAKE2b of
        ``"statekit-rng/<base_seed>/<key>/<role index>"``; stable across processes,
        machines and Python versions (unlike ``hash()``).
    """
    text = f"statekit-rng/{base_seed}/{key}/{_ROLE_INDEX.get(role, role)}"
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


def _new_generator(device: Any = None) -> torch.Generator:
    if device is None:
        device = torch.get_default_device() if hasattr(torch, "get_default_device") else "cpu"
    return torch.Generator(device=device)


@hookimpl
def statekit_attach(accelerator: Any, objects: MutableMapping[str, Any]) -> None:
    """Give every data loader, and its random sampler, a ``torch.Generator`` of its own.

    Why: a ``DataLoader`` without ``generator`` draws its workers' base seed from the
    global torch generator each time an iterator is built, and a ``RandomSampler``
    without one draws its permutation seed from it at the start of each epoch. The
    number of draws then depends on where the run started, so after a mid-epoch resume
    the global stream (dropout masks, noise) would be shifted against the original run.
    With generators of their own, building an iterator never consumes the global
    generator, and their states are saved and restored by key.

    Each new generator is seeded from ``torch.initial_seed()`` (the run's seed, as set by
    ``torch.manual_seed`` / ``accelerate.utils.set_seed``), the loader's stable key and
    its role (see :func:`derive_seed`): deterministic, and drawn from no random stream.
    Generators already set are kept: in multi-process runs Accelerate's
    ``prepare_data_loader`` gives the sampler a generator (``synchronized_generator``)
    whose state ``accelerate.utils.random.synchronize_rng_states`` broadcasts from rank 0
    at every ``iter()``, and ``SeedableRandomSampler`` reseeds its own every epoch.
    The seed does not include the rank: ranks seeded alike (``set_seed(s)``) get alike
    generators, ranks seeded apart (``set_seed(s, device_specific=True)``) get different
    ones, as they would from the global generator.
    Generators are created on ``torch.get_default_device()``, as Accelerate does.

    Args:
        accelerator: the ``accelerate.Accelerator`` or None (unused).
        objects: the run's stateful objects by stable key; data loaders among them
            (``torch.utils.data.DataLoader``, Accelerate's ``DataLoaderShard`` /
            ``DataLoaderDispatcher``, torchdata's ``StatefulDataLoader``) are changed in
            place. Keys are not added or removed.

    Returns:
        None.
    """
    base_seed = torch.initial_seed()
    for key, loader in _data_loaders(objects):
        for role, holder in _generator_holders(loader).items():
            if getattr(holder, "generator", None) is None:
                generator = _new_generator()
                generator.manual_seed(derive_seed(base_seed, key, role))
                holder.generator = generator


# --------------------------------------------------------------------------- save


def _generator_entry(generator: torch.Generator) -> dict[str, Any]:
    return {"device": str(generator.device), "state": generator.get_state()}


def snapshot(objects: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Capture this process's random states (what one rank's file holds).

    Args:
        objects: stateful objects by stable key; the generators of data loaders among them
            are captured too.

    Returns:
        A dict: ``format`` (int), ``python`` (``random.getstate()`` tuple), ``numpy``
        (``numpy.random.get_state()`` tuple; the key array is ``uint32[624]``), ``torch``
        (``uint8[5056]`` CPU tensor), ``device_type`` (str or None), ``devices`` (one
        ``uint8`` CPU tensor per device), ``loaders`` (``key -> role -> {"device": str,
        "state": uint8 tensor}``).

    Raises:
        Whatever torch raises while reading a device generator.
    """
    import numpy as np

    found = discover_accelerator()
    device_type, device_states = None, []
    if found is not None:
        device_type, module = found
        device_states = [s.detach().to("cpu") for s in module.get_rng_state_all()]
    loaders: dict[str, dict[str, Any]] = {}
    for key, loader in _data_loaders(objects or {}):
        entries = {
            role: _generator_entry(holder.generator)
            for role, holder in _generator_holders(loader).items()
            if isinstance(getattr(holder, "generator", None), torch.Generator)
        }
        if entries:
            loaders[key] = entries
    return {
        "format": STATE_FORMAT,
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "device_type": device_type,
        "devices": device_states,
        "loaders": loaders,
    }


@hookimpl(tryfirst=True)
def statekit_save_state_pre(checkpoint: Checkpoint) -> None:
    """Write this rank's random states to ``rng/rank-<rank:05d>.*``, before any other plugin.

    Runs first (``tryfirst``) so the snapshot is the state the training loop left, on
    every rank. Records (manifest ``records["rng"]``, from rank 0): ``format``,
    ``world_size``, ``device_type``, ``device_count`` and the data-loader keys saved.

    Args:
        checkpoint: the save's context; ``checkpoint.objects`` is read (data loaders) and
            not changed.

    Returns:
        None. Sets ``checkpoint.handles_rng = True``.

    Raises:
        UnsupportedValueError: a state cannot be encoded (a NumPy bit generator with an
            exotic state layout).
        StorageError: the write failed.
    """
    state = snapshot(checkpoint.objects)
    checkpoint.save_state(RANK_FILE_BASE.format(rank=checkpoint.rank), state)
    checkpoint.records.update(
        {
            "format": STATE_FORMAT,
            "world_size": checkpoint.world_size,
            "device_type": state["device_type"],
            "device_count": len(state["devices"]),
            "loaders": sorted(state["loaders"]),
        }
    )
    checkpoint.handles_rng = True


# --------------------------------------------------------------------------- load


def _device_names(device_type: str, indices: Sequence[int]) -> str:
    return ", ".join(f"{device_type}:{i}" for i in indices)


def _restore_devices(saved_type: str | None, saved_states: Sequence[torch.Tensor], not_restored: list[str]) -> None:
    found = discover_accelerator()
    if found is None:
        if saved_type is not None and saved_states:
            not_restored.append(
                f"generators of {_device_names(saved_type, range(len(saved_states)))} "
                f"(this process has no accelerator)"
            )
        return
    now_type, module = found
    now_count = int(module.device_count())
    if saved_type is None:
        if now_count:
            not_restored.append(
                f"generators of {_device_names(now_type, range(now_count))} (the checkpoint was saved "
                "without an accelerator; they keep their current state)"
            )
        return
    if saved_type != now_type:
        not_restored.append(
            f"generators of {_device_names(saved_type, range(len(saved_states)))} (this process runs on "
            f"{now_type!r}; its {now_count} device generator(s) keep their current state)"
        )
        return
    n = min(len(saved_states), now_count)
    if n:
        module.set_rng_state_all(list(saved_states[:n]))
    if len(saved_states) > now_count:
        not_restored.append(
            f"generators of {_device_names(saved_type, range(now_count, len(saved_states)))} "
            f"(saved with {len(saved_states)} {saved_type} device(s), this process has {now_count})"
        )
    elif now_count > len(saved_states):
        not_restored.append(
            f"generators of {_device_names(now_type, range(len(saved_states), now_count))} (the checkpoint "
            f"holds {len(saved_states)} {saved_type} device state(s); they keep their current state)"
        )


def _restore_loaders(saved: Mapping[str, Any], loaders: Mapping[str, Any], not_restored: list[str]) -> None:
    for key, roles in saved.items():
        loader = loaders.get(key)
        if loader is None:
            continue  # not part of this load
        holders = _generator_holders(loader)
        for role, entry in roles.items():
            what = f"data loader {key!r}: {role} generator"
            holder = holders.get(role)
            if holder is None:
                not_restored.append(f"{what} (the loader has no {role} with a 'generator' attribute now)")
                continue
            generator = getattr(holder, "generator", None)
            created = not isinstance(generator, torch.Generator)
            if created:
                generator = _new_generator(entry["device"])
            try:
                generator.set_state(entry["state"])
            except (RuntimeError, TypeError, ValueError) as exc:
                not_restored.append(f"{what} (saved on {entry['device']}, now on {generator.device}: {exc})")
                continue
            if created:
                holder.generator = generator


def _check_state(state: Any, source: str) -> dict[str, Any]:
    if not isinstance(state, dict):
        raise CorruptCheckpointError(f"{source}: not a statekit-rng state", path=source)
    version = state.get("format")
    if isinstance(version, int) and version > STATE_FORMAT:
        raise FormatVersionError(
            f"{source}: statekit-rng state format {version} is newer than this plugin reads ({STATE_FORMAT}); "
            "upgrade statekit-rng"
        )
    missing = [k for k in ("format", "python", "numpy", "torch", "device_type", "devices", "loaders") if k not in state]
    if missing:
        raise CorruptCheckpointError(f"{source}: statekit-rng state lacks {', '.join(missing)}", path=source)
    return state


def restore(state: Mapping[str, Any], loaders: Mapping[str, Any] | None = None, source: str = "<memory>") -> list[str]:
    """Put back what :func:`snapshot` captured, as far as this process matches it.

    Args:
        state: a :func:`snapshot` result (decoded from a checkpoint).
        loaders: data loaders by stable key; the saved generators of those present are
            restored (a loader or sampler with ``generator=None`` gets a new one).
        source: the file the state came from, for error messages.

    Returns:
        What was not restored, one human-readable item per generator group (empty when
        everything matched).

    Raises:
        CorruptCheckpointError: the state lacks a field (names ``source``).
        FormatVersionError: the state was written by a newer statekit-rng.
    """
    import numpy as np

    state = _check_state(state, source)
    not_restored: list[str] = []
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    _restore_devices(state["device_type"], state["devices"], not_restored)
    _restore_loaders(state["loaders"], loaders or {}, not_restored)
    return not_restored


def _ranks_in(files: Mapping[str, Any]) -> list[int]:
    return sorted(int(m.group(1)) for m in map(_RANK_FILE.match, files) if m)


@hookimpl(tryfirst=True)
def statekit_load_state_pre(checkpoint: Checkpoint) -> None:
    """Note the data loaders of this load before another plugin takes them.

    Restores nothing: the restore runs last, in :func:`statekit_load_state_post`.

    Args:
        checkpoint: the load's context (``objects`` is read, not changed).

    Returns:
        None.
    """
    _loaders_at_load[checkpoint] = dict(_data_loaders(checkpoint.objects))


@hookimpl(trylast=True)
def statekit_load_state_post(checkpoint: Checkpoint) -> None:
    """Restore this rank's random states, after everything else was loaded.

    Restores Python ``random``, NumPy's global generator, torch's CPU generator, the
    accelerator's device generators and the generators of the data loaders of this load
    (the pattern of Accelerate's ``load_accelerator_state``, which restores
    ``random_states_<process_index>.pkl`` last). When the checkpoint was saved with a
    different world size, device type or device count, restores what matches and issues
    one :class:`statekit.StatekitWarning` listing what was not restored: this rank's
    states when the checkpoint has no file for it; on rank 0, the ranks saved beyond
    the current world size; device generators by name (``cuda:1``); data-loader
    generators by key. A checkpoint saved without statekit-rng (no ``records["rng"]``)
    is left alone, without warning.

    Args:
        checkpoint: the load's context: ``records`` (saved by
            :func:`statekit_save_state_pre`), ``manifest["files"]``, ``rank``,
            ``world_size``, ``objects``.

    Returns:
        None. Sets ``checkpoint.handles_rng = True`` when a state was restored.

    Raises:
        CorruptCheckpointError: this rank's file fails verification or is malformed.
        FormatVersionError: the file was written by a newer statekit-rng.
    """
    loaders = _loaders_at_load.pop(checkpoint, {})
    loaders.update(_data_loaders(checkpoint.objects))
    records = checkpoint.records
    if not records:
        return
    files = (checkpoint.manifest or {}).get("files", {})
    rank, world_size = checkpoint.rank, checkpoint.world_size
    saved_world = records.get("world_size", (checkpoint.manifest or {}).get("world_size"))
    base = RANK_FILE_BASE.format(rank=rank)
    not_restored: list[str] = []
    if f"{base}.json" in files:
        source = f"{checkpoint.url}/{base}.json"
        not_restored += restore(checkpoint.load_state(base), loaders, source)
        checkpoint.handles_rng = True
    else:
        not_restored.append(
            f"all RNG state of rank {rank} (Python, NumPy, torch CPU, device and data-loader generators): the "
            f"checkpoint has no {base}.json (saved with world size {saved_world}, loaded with {world_size})"
        )
    if rank == 0:
        beyond = [r for r in _ranks_in(files) if r >= world_size]
        if beyond:
            names = ", ".join(str(r) for r in beyond)
            not_restored.append(
                f"RNG state of rank{'s' if len(beyond) > 1 else ''} {names} (saved with world size {saved_world}, "
                f"loaded with {world_size})"
            )
    if not_restored:
        warnings.warn(
            f"statekit-rng: {checkpoint.url}: not restored: " + "; ".join(not_restored),
            StatekitWarning,
            stacklevel=2,
        )
