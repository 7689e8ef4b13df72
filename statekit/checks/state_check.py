"""The state check: the live tensors of every saved object, digested at save (:func:`record`)
and compared with the live objects after every load (:func:`check`), naming each tensor
that differs (issue 38). Deliberate differences (a cast, a ``strict=False`` omission) are
named, not faults; a lateral cast and a broken tie are faults. DTensors are digested by
their shards in one all-reduce (so :func:`record` and :func:`check` are collectives).
What is digested, the modes (:data:`MODE_ENV`), what sampling can miss: docs/concepts.md,
"State check".
"""

from __future__ import annotations

import dataclasses
import logging
import os
import zlib
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from statekit import distributed, format as fmt
from statekit.errors import InvalidOptionError, StateCheckWarning, StateMismatchError, warn_user
from statekit.checks import digest as sd
from statekit.format.manifest_types import Manifest, StateDigest

logger = logging.getLogger("statekit")

MODE_ENV = "STATEKIT_STATE_CHECK"
"""Environment variable choosing the state check: ``sampled``, ``full`` or ``off`` (unset:
full when every digested tensor is on an accelerator, sampled otherwise)."""

MODES = ("sampled", "full", "off")


@dataclasses.dataclass(frozen=True)
class LiveTensors:
    """One saved or loaded object's tensors as the state check digests them, read from the
    live object by :func:`statekit.engine.live_state.live_tensors`.

    Attributes:
        key: the object's key in the checkpoint (``"model"``, ``"optimizer_1"``).
        kind: its kind (``"model"``, ``"optimizer"``, ...; a model's ties are recorded).
        per_rank: one copy per rank (digested under ``<key>/rank-<r>``).
        tensors: ``path in its state dict -> tensor`` (DTensors and meta tensors included).
    """

    key: str
    kind: str
    per_rank: bool
    tensors: Mapping[str, torch.Tensor]


@dataclasses.dataclass
class StateVerdict:
    """The state check of one load.

    Attributes:
        verdict: ``"verified"`` (every compared tensor equals its saved digest),
            ``"mismatch"`` (at least one differs) or ``"not recorded"`` (the checkpoint
            holds no state digest: written before it existed, or with the check off).
        compared: tensors compared.
        sampled: the digests were sampled (:class:`statekit.checks.digest.Sampling`).
        differences: per differing tensor, ``"<object> '<key>': <what differs>"``.
        mismatched: ``"<object key>:<tensor path>" -> "saved digest ..., live ..."``.
        deliberate: the deliberate differences, ``(object, tensor path, what)`` (loaded into
            another dtype, left out by ``strict=False``, offloaded).
    """

    verdict: str
    compared: int = 0
    sampled: bool = False
    differences: list[str] = dataclasses.field(default_factory=list)
    mismatched: dict[str, str] = dataclasses.field(default_factory=dict, repr=False)
    deliberate: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)

    @property
    def detail(self) -> str:
        """The verdict in words."""
        if self.verdict == "not recorded":
            return "the checkpoint holds no state digest"
        if self.differences:
            return "; ".join(self.differences)
        how = "sampled" if self.sampled else "every element"
        grouped: dict[tuple[str, str], list[str]] = {}
        for what, path, reason in self.deliberate:
            grouped.setdefault((what, reason), []).append(path)
        noted = "".join(f"; {what}: {len(paths)} tensor(s) {reason} ({paths[0]}{', ...' if len(paths) > 1 else ''})"
                        for (what, reason), paths in grouped.items())
        return f"{self.compared} tensors equal their saved digests ({how}){noted}"

    def to_json(self) -> dict[str, Any]:
        """The ``state`` record of the next manifest's ``resume_audit``."""
        return {"verdict": self.verdict, "detail": self.detail, "compared": self.compared, "sampled": self.sampled}


def mode() -> str | None:
    """The chosen mode (:data:`MODE_ENV`), or None for the default.

    Raises:
        InvalidOptionError: the variable holds another value.
    """
    value = os.environ.get(MODE_ENV, "").strip().lower()
    if not value:
        return None
    if value not in MODES:
        raise InvalidOptionError(f"{MODE_ENV}={value!r}: must be one of {', '.join(MODES)}")
    return value


def _digestible_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Without meta tensors (shapes only: nothing to digest)."""
    return {path: t for path, t in tensors.items() if t.device.type != "meta"}


def flatten(value: Any, prefix: str, out: dict[str, torch.Tensor]) -> None:
    """Add every tensor of a state tree to ``out`` under its dotted path (``prefix``: the tree's
    own; a bare tensor is ``"tensor"``).
    """
    if isinstance(value, torch.Tensor):
        out[prefix or "tensor"] = value  # (a DTensor too: its shards are summed by their global positions)
    elif isinstance(value, Mapping):
        for k, v in value.items():
            flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            flatten(v, f"{prefix}.{i}" if prefix else str(i), out)


def _sampling(tensors: Iterable[torch.Tensor]) -> sd.Sampling | None:
    chosen = mode()
    if chosen == "off":
        return None
    if chosen == "full":
        return sd.Sampling.FULL
    if chosen == "sampled":
        return sd.Sampling()
    on_host = any(t.device.type == "cpu" for t in tensors)
    return sd.Sampling() if on_host else sd.Sampling.FULL


def record(objects: list[LiveTensors]) -> StateDigest | None:
    """The state digest of a save: every digested tensor of every object, now. Every rank calls
    it at the same point; rank 0 returns the digest.

    Args:
        objects: the save's objects (:func:`statekit.engine.live_state.live_tensors`).

    Returns:
        The manifest's ``state_digest`` on rank 0 (None there when nothing is digested or
        the check is off); None on the other ranks.

    Raises:
        InvalidOptionError: :data:`MODE_ENV` holds an unknown mode.
        CollectiveTimeoutError: a rank did not reach the all-reduce of the DTensors.
    """
    if mode() == "off":
        return None
    own = {o.key: _digestible_tensors(o.tensors) for o in objects if o.per_rank}  # this rank's
    whole = _WholeObjects([o for o in objects if not o.per_rank])
    sampling = _sampling(t for ts in (*whole.tensors.values(), *own.values()) for t in ts.values())
    per_rank = _per_rank_digests(own, sampling) if own else {}  # (every rank holds them: a collective)
    if sampling is None or not (whole.tensors or whole.offloaded or per_rank):
        return None
    rank = distributed.rank_and_world_size()[0]
    sums, uncompared = _digests({(key, path): t for key, named in whole.tensors.items() for path, t in named.items()},
                                sampling, plain=rank == 0)
    if rank != 0:
        return None
    return whole.digest(sampling, per_rank, sums, uncompared)


class _WholeObjects:
    """The objects saved whole (not per rank), sorted for the digest: their digestible
    tensors, the offloaded ones (meta: nothing here to digest), and each model's ties."""

    def __init__(self, objects: list[LiveTensors]) -> None:
        self.tensors: dict[str, dict[str, torch.Tensor]] = {}
        self.offloaded: dict[str, dict[str, str]] = {}
        self.ties: dict[str, list[list[str]]] = {}
        for o in objects:
            if o.kind == "model" and (groups := tie_groups(o.tensors)):
                self.ties[o.key] = groups
            for path, t in o.tensors.items():
                if t.device.type == "meta":  # offloaded: Accelerate's hooks hold it elsewhere
                    self.offloaded.setdefault(o.key, {})[path] = "offloaded (meta on the live object)"
            named = _digestible_tensors(o.tensors)
            if named:
                self.tensors[o.key] = named

    def digest(self, sampling: sd.Sampling, per_rank: Mapping[str, dict[str, str]], sums: Mapping[_Name, str],
               uncompared: Mapping[_Name, str]) -> StateDigest:
        """The manifest's record: ``"<dtype>:<digest>"`` per tensor, what was not digested and why."""
        recorded: dict[str, dict[str, str]] = dict(per_rank)
        not_digested: dict[str, dict[str, str]] = {key: dict(paths) for key, paths in self.offloaded.items()}
        for key, named in self.tensors.items():
            for path, t in named.items():
                if (key, path) in sums:
                    recorded.setdefault(key, {})[path] = f"{_dtype(t)}:{sums[key, path]}"
                else:
                    not_digested.setdefault(key, {})[path] = uncompared[key, path]
        return StateDigest(algorithm=sd.ALGORITHM, sampling=sampling.to_json(), objects=recorded,
                           uncompared=not_digested or None, ties=self.ties or None)


def tie_groups(named: Mapping[str, torch.Tensor]) -> list[list[str]]:
    """The groups (two or more, in state dict order) of paths of ``named`` that are one tensor
    (tied weights: same storage, offset, shape, strides, dtype; meta, empty, DTensor and
    subclass tensors left out).
    """
    by_view: dict[tuple[Any, ...], list[str]] = {}
    for path, t in named.items():
        view = _view(t)
        if view is not None:
            by_view.setdefault(view, []).append(path)
    return [paths for paths in by_view.values() if len(paths) > 1]


def _view(t: torch.Tensor) -> tuple[Any, ...] | None:
    """What makes two tensors one (:func:`tie_groups`), or None where it cannot be told."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided or t.device.type == "meta" \
            or t.numel() == 0:
        return None
    try:
        pointer = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    if not pointer:
        return None
    return (str(t.device), pointer, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def _per_rank_digests(own: Mapping[str, Mapping[str, torch.Tensor]], sampling: sd.Sampling) -> dict[str, dict[str, str]]:
    """The per-rank objects' digests under ``<key>/rank-<r>``, gathered to rank 0 in one gather."""
    rank, world = distributed.rank_and_world_size()
    mine: dict[str, dict[str, str]] = {}
    for key, named in own.items():
        if named:
            sums = sd.digests(named, sampling)
            mine[fmt.rank_path(key, rank)] = {path: f"{_dtype(t)}:{sums[path]}" for path, t in named.items()}
    if world == 1:
        return mine
    gathered = distributed.gather_to_rank0(mine)
    return {key: paths for each in gathered or [] for key, paths in each.items()}


class StateRecorder:
    """The state digest of a checkpoint written from state dicts read back from files
    (``statekit convert``): each object's tensors are digested as written (CPU, no DTensors).

    Raises:
        InvalidOptionError: :data:`MODE_ENV` holds an unknown mode (on creation).
    """

    def __init__(self) -> None:
        self.sampling = _sampling([torch.empty(0)])
        self._objects: dict[str, dict[str, str]] = {}

    def add(self, key: str, state: Any) -> None:
        """Digest one object's state (a state dict, or a mapping of tensors) under ``key``,
        its key in the checkpoint: the paths are those of the live object's ``state_dict()``."""
        if self.sampling is None:
            return
        named: dict[str, torch.Tensor] = {}
        flatten(state, "", named)
        named = _digestible_tensors(named)
        if named:
            sums = sd.digests(named, self.sampling)
            self._objects[key] = {path: f"{_dtype(t)}:{sums[path]}" for path, t in named.items()}

    def digest(self) -> StateDigest | None:
        """The manifest's ``state_digest`` (None: nothing digested, or the check off)."""
        if self.sampling is None or not self._objects:
            return None
        return StateDigest(algorithm=sd.ALGORITHM, sampling=self.sampling.to_json(), objects=dict(self._objects))


_Name = tuple[str, str]
"""``(object key, tensor path)``."""


def _digests(
    tensors: Mapping[_Name, torch.Tensor], sampling: sd.Sampling, plain: bool = True
) -> tuple[dict[_Name, str], dict[_Name, str]]:
    """Digests of many tensors of many objects: the plain ones batched (when ``plain``), the
    DTensors by :func:`_shard_digests`; returns ``(digests, why not digested)``.
    """
    local = {name: t for name, t in tensors.items() if not sd.is_dtensor(t)} if plain else {}
    batch = sd.digests({str(i): t for i, t in enumerate(local.values())}, sampling)
    sums = dict(zip(local, batch.values()))
    shards, uncompared = _shard_digests({name: t for name, t in tensors.items() if sd.is_dtensor(t)}, sampling)
    sums.update(shards)
    return sums, uncompared


def _shard_digests(dtensors: Mapping[_Name, torch.Tensor], sampling: sd.Sampling) -> tuple[dict[_Name, str], dict[_Name, str]]:
    """DTensors' digests: each rank's share summed in one all-reduce (same DTensors, same order
    on every rank); returns ``(digests, why not digested)`` (a mesh not the whole world, a
    ``Partial`` or ``_StridedShard`` placement). Raises ``CollectiveTimeoutError``.
    """
    world = distributed.rank_and_world_size()[1]
    slots: list[_Name] = []
    values: list[int] = []
    uncompared: dict[_Name, str] = {}
    own: dict[_Name, str] = {}
    for name, t in dtensors.items():
        size = t.device_mesh.size()
        if size != world:  # (the ranks outside it hold no share: they would not take part)
            uncompared[name] = f"a DTensor on a mesh of {size} of the {world} ranks"
            continue
        try:
            share, failed = sd.shard_sum(t, sampling), 0
        except ValueError as exc:
            share, failed = 0, 1
            own[name] = f"a DTensor with {exc}"
        slots.append(name)
        values += [share & 0xFFFFFFFF, share >> 32, failed]  # 32-bit halves: the sums never overflow an int64
    if world > 1 and slots:
        tag = zlib.crc32("\0".join(f"{key}\0{path}" for key, path in slots).encode())
        summed = distributed.sum_over_ranks([len(slots), tag, *values])
        if summed[:2] != [len(slots) * world, tag * world]:  # not the same DTensors on every rank: no sum is right
            return {}, {**uncompared, **{n: "ranks hold different DTensors, not summed" for n in slots}}
        values = summed[2:]
    sums: dict[_Name, str] = {}
    for i, name in enumerate(slots):
        low, high, failed = values[3 * i: 3 * i + 3]
        if failed:
            uncompared[name] = own.get(name) or f"a DTensor whose share {failed} rank(s) could not compute"
        else:
            sums[name] = sd.format_sum(low + (high << 32))
    return sums, uncompared


def _all_zeros(tensors: Mapping[_Name, torch.Tensor]) -> dict[_Name, bool]:
    """Whether each tensor is all zeros (a DTensor: on every rank; one all-reduce for all
    of them, called by every rank with the same DTensors)."""
    out = {name: bool((t == 0).all()) for name, t in tensors.items() if not sd.is_dtensor(t)}
    shards = [(name, t) for name, t in tensors.items() if sd.is_dtensor(t)]
    if shards:
        nonzero = distributed.sum_over_ranks([int(bool((t.to_local() != 0).any())) for _, t in shards])
        out.update({name: not n for (name, _), n in zip(shards, nonzero)})
    return out


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


_COMPONENT = {torch.complex32: torch.float16, torch.complex64: torch.float32, torch.complex128: torch.float64}


def _widens(saved: torch.dtype, live: torch.dtype) -> bool:
    """Whether every value of dtype ``saved`` is exactly a value of dtype ``live``."""
    if saved.is_complex or live.is_complex:
        part, wide = _COMPONENT.get(saved, saved), _COMPONENT.get(live)
        return live.is_complex and wide is not None and part.is_floating_point and (part == wide or _widens(part, wide))
    if saved.is_floating_point and live.is_floating_point:
        return torch.finfo(live).bits > torch.finfo(saved).bits and torch.finfo(live).eps <= torch.finfo(saved).eps
    if not (saved.is_floating_point or live.is_floating_point or saved.is_complex or live.is_complex
            or torch.bool in (saved, live)):
        wide, narrow = torch.iinfo(live), torch.iinfo(saved)
        return wide.min <= narrow.min and wide.max >= narrow.max
    return False


def _cast(saved: str, live: str) -> str | None:
    """How a tensor saved as ``saved`` and live as ``live`` was cast: ``"widening"``, ``"narrowing"``,
    ``"lateral"`` (a fault: bfloat16 and float16, int and float, signed and unsigned), or None.
    """
    old, new = getattr(torch, saved, None), getattr(torch, live, None)
    if not (isinstance(old, torch.dtype) and isinstance(new, torch.dtype)):
        return None
    if _widens(old, new):
        return "widening"
    return "narrowing" if _widens(new, old) else "lateral"


def check(
    manifest: Manifest,
    objects: list[LiveTensors],
    url: str,
    *,
    strict: bool = False,
    left_out: Mapping[str, Iterable[str]] | None = None,
    names: Mapping[str, Mapping[str, str]] | None = None,
) -> StateVerdict:
    """Compare the live objects, as a load left them, with the checkpoint's state digest
    (a collective when DTensors are compared).

    Args:
        manifest: the loaded checkpoint's manifest.
        objects: the objects the load restored (:func:`statekit.engine.live_state.live_tensors`).
        url: the checkpoint, for messages.
        strict: do not warn on a mismatch: the caller raises it (:func:`raise_mismatch`).
        left_out: per object key, the state-dict keys a ``strict=False`` load left out.
        names: per object key, its optimizer's parameter names by state path prefix
            (:func:`optimizer_names`), for messages.

    Returns:
        The verdict (a mismatch is warned with :class:`StateCheckWarning` unless ``strict``).

    Raises:
        InvalidOptionError: :data:`MODE_ENV` holds an unknown mode.
        CollectiveTimeoutError: a rank did not reach the all-reduce of the DTensors.
    """
    saved = manifest.state_digest
    if saved is None or mode() == "off":
        return StateVerdict("not recorded")
    try:
        sampling = sd.Sampling.from_json(saved.sampling)
    except (KeyError, TypeError, ValueError):
        return StateVerdict("not recorded")
    comparison = _Comparison(names or {})
    for index, live in enumerate(objects):
        comparison.object(index, live, manifest, {str(k) for k in (left_out or {}).get(live.key, ())})
    verdict = comparison.judge(sampling)
    if verdict.differences:
        if not strict:
            warn_user(f"{url}: state check after the load: {_listed(verdict)}", StateCheckWarning)
    else:  # (at DEBUG: a save and a load log one INFO line each; the verdict is in the next manifest)
        logger.debug("state check of %s: %s", url, verdict.detail)
    return verdict


_Order = tuple[int, int, int]
"""Where a note sorts: (object, 0 while reading its paths / 1 for a digest or dtype that
differs / 2 for a tie broken, path): the order of a check one object at a time, though the
digests of every object are computed at once; a tensor's own faults in the same order."""


class _Comparison:
    """One load's comparison: :meth:`read` and :meth:`tied`, then :meth:`judge`."""

    def __init__(self, names: Mapping[str, Mapping[str, str]]) -> None:
        self.names = names
        self.whats: dict[str, str] = {}  # object key -> "<kind> '<key>'"
        self.compared = 0
        self._deliberate: list[tuple[_Order, tuple[str, str, str]]] = []
        self._faults: dict[_Name, list[tuple[_Order, str, str]]] = {}  # per tensor: (order, its value, message)
        self._tensors: dict[_Name, tuple[torch.Tensor, str, str, str, _Order]] = {}  # to digest

    def note(self, order: _Order, what: str, path: str, reason: str) -> None:
        """A deliberate difference (named, not a fault)."""
        self._deliberate.append((order, (what, path, reason)))

    def differ(self, order: _Order, key: str, path: str, value: str, message: str) -> None:
        """A fault of one tensor (``path`` of object ``key``): ``message`` follows its name
        (``" differs from ..."``); a tensor's faults are one difference, in order."""
        self._faults.setdefault((key, path), []).append((order, value, message))

    def object(self, index: int, live: LiveTensors, manifest: Manifest, skipped: set[str]) -> None:
        """Read one object against what the save recorded of it: its digests (:meth:`read`),
        its ties (:meth:`tied`) and what the save could not digest (named)."""
        what = self.whats[live.key] = f"{live.kind} {live.key!r}"
        saved = manifest.state_digest
        for path, reason in ((saved.uncompared or {}).get(live.key) or {}).items():
            self.note((index, 0, -1), what, path, f"not digested at save ({reason}), not compared")
        rank, world = distributed.rank_and_world_size()
        if live.per_rank and manifest.world_size not in (None, world):
            return  # another world size: this rank's saved copy is not this rank's state
        recorded = saved.objects.get(fmt.rank_path(live.key, rank) if live.per_rank else live.key)
        if not recorded:
            return
        self.read(index, live.key, recorded, live.tensors, skipped)
        groups = (saved.ties or {}).get(live.key) if live.kind == "model" and not live.per_rank else None
        if groups:
            self.tied(index, live.key, list(recorded), groups, live.tensors)

    def read(self, index: int, key: str, recorded: Mapping[str, str], live: Mapping[str, torch.Tensor],
             skipped: set[str]) -> None:
        """Match one object's recorded digests with its live tensors (missing, offloaded and
        left-out ones judged now, the rest in :meth:`judge`).
        """
        what = self.whats[key]
        for i, (path, value) in enumerate(recorded.items()):
            dtype, _, digest = value.partition(":")
            tensor = live.get(path)
            if tensor is not None and tensor.device.type == "meta":  # offloaded: the weights live elsewhere
                self.note((index, 0, i), what, path, "offloaded (meta on the live object), not compared")
            elif tensor is None and path in skipped:
                self.note((index, 0, i), what, path, "not loaded (strict=False)")
            elif tensor is None:
                self.differ((index, 0, i), key, path, "saved, but the live object has no such tensor after the load",
                            " is missing after the load")
            else:
                live_dtype = _dtype(tensor)
                try:
                    cast = tensor if live_dtype == dtype else tensor.to(getattr(torch, dtype))  # compared cast back
                except (AttributeError, TypeError, RuntimeError):
                    if live_dtype != dtype and _cast(dtype, live_dtype) == "lateral":
                        self.differ((index, 1, i), key, path, _dtypes(dtype, live_dtype),
                                    _lateral(dtype, live_dtype, ""))
                    else:
                        self.note((index, 0, i), what, path, f"loaded as {live_dtype} (saved {dtype}), not compared")
                    continue
                self._tensors[key, path] = (cast, live_dtype, dtype, digest, (index, 0, i))

    def tied(self, index: int, key: str, paths: list[str], groups: Iterable[Iterable[str]],
             live: Mapping[str, torch.Tensor]) -> None:
        """Judge one model's recorded ties against its live tensors: members no longer one tensor
        with the largest still-tied part are faults; unknowable members are not judged.
        """
        position = {path: i for i, path in enumerate(paths)}
        for group in groups:
            parts: dict[tuple[Any, ...], list[str]] = {}
            for path in group:
                view = _view(live[path]) if path in live else None
                if view is not None:
                    parts.setdefault(view, []).append(path)
            if len(parts) < 2:
                continue
            kept = max(parts.values(), key=len)  # (the first of the largest: dicts keep the members' order)
            for part in parts.values():
                if part is kept:
                    continue
                for path in part:
                    self.differ((index, 2, position.get(path, len(paths))), key, path,
                                f"tied to {kept[0]!r} at save, not tied now",
                                f" tied to {kept[0]!r} at save, not tied now (they would be updated separately)")

    def judge(self, sampling: sd.Sampling) -> StateVerdict:
        """Digest every tensor read (DTensors: a collective), compare, and the verdict."""
        sums, uncompared = _digests({name: t[0] for name, t in self._tensors.items()}, sampling)
        differing: dict[_Name, tuple[str, _Order]] = {}
        for name, (_, live_dtype, dtype, digest, order) in self._tensors.items():
            if name in uncompared:
                self._uncompared(name, live_dtype, dtype, order, uncompared[name])
            elif live_dtype == dtype:
                self.compared += 1
                if sums.get(name) != digest:
                    differing[name] = (digest, (order[0], 1, order[2]))
            elif self._cast_back(name, live_dtype, dtype, digest, sums.get(name), order):
                self.compared += 1
        return self._verdict(sampling, differing, sums)

    def _uncompared(self, name: _Name, live_dtype: str, dtype: str, order: _Order, why: str) -> None:
        """A tensor the digest could not compute now (a DTensor's placements): named; a
        lateral cast is a fault all the same."""
        key, path = name
        if live_dtype != dtype and _cast(dtype, live_dtype) == "lateral":
            self.differ((order[0], 1, order[2]), key, path, _dtypes(dtype, live_dtype), _lateral(dtype, live_dtype, ""))
        self.note(order, self.whats[key], path, f"{why}, not compared")

    def _cast_back(self, name: _Name, live_dtype: str, dtype: str, digest: str, live: str | None, order: _Order) -> bool:
        """Judge one tensor loaded into another dtype, compared after the cast back (a fault
        or a deliberate difference is recorded here); True when it counts as compared."""
        key, path = name
        what = self.whats[key]
        cast = _cast(dtype, live_dtype)
        if cast == "lateral":  # a fault even with the values kept: the run goes on in other arithmetic
            values = ", equal values after the cast back" if live == digest else (
                f", other values after the cast back (saved digest {digest}, live {live})")
            self.differ((order[0], 1, order[2]), key, path, _dtypes(dtype, live_dtype), _lateral(dtype, live_dtype, values))
            return True
        if live == digest:
            self.note(order, what, path, f"loaded as {live_dtype} (saved {dtype}), equal after the cast back")
            return True
        if cast == "widening":  # lossless: the values themselves differ
            self.differ(order, key, path, f"loaded as {live_dtype} (saved {dtype}), other values",
                        f" loaded as {live_dtype} (saved {dtype}) differs from the saved state after the cast "
                        f"back (saved digest {digest}, live {live})")
            return False
        self.note(order, what, path, f"loaded as {live_dtype} (saved {dtype}), a narrowing cast, not compared")
        return False

    def _verdict(self, sampling: sd.Sampling, differing: Mapping[_Name, tuple[str, _Order]],
                 sums: Mapping[_Name, str]) -> StateVerdict:
        """The faults of every tensor, each tensor's in order, as one verdict."""
        zeros = _all_zeros({name: self._tensors[name][0] for name in differing})
        for (key, path), (digest, order) in differing.items():
            self.differ(order, key, path, f"saved digest {digest}, live {sums[key, path]}",
                        f"{' is all zeros,' if zeros[key, path] else ''} differs from the saved state (saved digest "
                        f"{digest}, live {sums[key, path]})")
        differences = []
        for (key, path), faults in self._faults.items():
            faults.sort(key=lambda f: f[0])
            differences.append((faults[0][0], f"{key}:{path}", "; ".join(value for _, value, _ in faults),
                                f"{self.whats[key]}: {_named(path, self.names.get(key))}"
                                + ";".join(message for _, _, message in faults)))
        differences.sort(key=lambda d: d[0])
        return StateVerdict(
            "mismatch" if differences else "verified", compared=self.compared, sampled=not sampling.is_full,
            differences=[message for _, _, _, message in differences],
            mismatched={key: value for _, key, value, _ in differences},
            deliberate=[note for _, note in sorted(self._deliberate, key=lambda d: d[0])])


def _dtypes(saved: str, live: str) -> str:
    return f"saved {saved}, live {live}"


def _lateral(saved: str, live: str, values: str) -> str:
    """A lateral cast's message (:func:`_cast`)."""
    return (f" loaded as {live} (saved {saved}): a cast that neither widens nor narrows{values}; the run "
            f"goes on in {live} arithmetic")


def _listed(verdict: StateVerdict) -> str:
    shown = "; ".join(verdict.differences[:10]) + (
        f"; ... ({len(verdict.differences) - 10} more)" if len(verdict.differences) > 10 else "")
    rank, world = distributed.rank_and_world_size()
    where = f" on rank {rank} of {world}" if world > 1 else ""
    return f"{len(verdict.differences)} tensor(s){where} differ from the state saved: {shown}"


def raise_mismatch(verdict: StateVerdict, url: str) -> None:
    """Raise a mismatch verdict of a ``strict_resume`` load (after it was recorded for the
    next save's ``resume_audit``).

    Args:
        verdict: :func:`check`'s verdict.
        url: the checkpoint, for the message.

    Raises:
        StateMismatchError: the verdict is a mismatch; ``mismatched`` maps
            ``"<object>:<tensor path>"`` to the saved and live digests. The load completed:
            the objects hold what it loaded.
    """
    if verdict.verdict != "mismatch":
        return
    error = StateMismatchError(
        f"{url} after the load (the state check; the load completed, the objects hold what it loaded)",
        reason=_listed(verdict))
    error.mismatched = dict(verdict.mismatched)
    raise error


def _named(path: str, parameters: Mapping[str, str] | None) -> str:
    """An optimizer state path as people name it: ``state.3.exp_avg`` is ``exp_avg of
    'layers.3.weight'`` (``parameters``: :func:`optimizer_names`); any other path as it is."""
    kind, _, rest = path.partition(".")
    index, _, slot = rest.partition(".")
    name = (parameters or {}).get(f"{kind}.{index}") if kind == "state" and slot else None
    return f"{slot} of {name!r}" if name is not None else path


def optimizer_names(optimizer: Any, parameter_names: Mapping[int, str]) -> dict[str, str]:
    """``"state.<i>" -> "<parameter name>"`` for every parameter of one optimizer (numbered in
    group order as ``state_dict`` does), whether or not it holds state now.

    Args:
        optimizer: the optimizer (an ``AcceleratedOptimizer`` is unwrapped).
        parameter_names: ``id(parameter) -> name``
            (:func:`statekit.engine.optimizer_fit.parameter_names`).

    Returns:
        The parameter name of each state path prefix.
    """
    optimizer = getattr(optimizer, "optimizer", optimizer)
    out: dict[str, str] = {}
    index = 0
    for group in getattr(optimizer, "param_groups", []):
        for p in group["params"]:
            name = parameter_names.get(id(p))
            if name is not None:
                out[f"state.{index}"] = name
            index += 1
    return out


__all__ = ["MODES", "MODE_ENV", "LiveTensors", "StateRecorder", "StateVerdict", "check", "flatten", "optimizer_names",
           "raise_mismatch", "record", "tie_groups"]
