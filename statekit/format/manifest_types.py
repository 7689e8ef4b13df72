"""The manifest's types: pure dataclasses for ``statekit.json`` (format ``statekit/1`` or ``statekit/2``),
parsed and validated in one place (:meth:`Manifest.from_json`) and turned back into the
exact JSON object they came from (:meth:`Manifest.to_json`).

Modelled on ``torch.distributed.checkpoint.metadata``: the metadata of a checkpoint is a
set of plain dataclasses in one module, with no I/O. Reading and writing the file
(``read_manifest``, ``manifest_bytes``) is :mod:`statekit.format.manifest`; the schema is
``statekit/manifest.schema.json`` and ``docs/format.md`` explains every field.

The types:

- :class:`Manifest`: the whole file; ``files`` and ``objects`` map to
- :class:`FileEntry` (size, checksum, rank, writer of one file) and
  :class:`ObjectEntry` (kind, owner, scope, files of one saved object);
- :class:`Fingerprint`: the resume fingerprint (the settings an exact resume depends on),
  with a :class:`LoaderSettings` per data loader;
- :class:`ResumeAudit`: the verdict of the resume the saving run continued from.

``records`` (plugin name -> the plugin's JSON) and ``metadata`` (the user's JSON) stay
plain mappings: their contents belong to a plugin or the user, not to the format.

Compatibility rules, the same for every type:

- Fields a newer minor writer adds (unknown keys) are kept in ``extra`` and written back
  unchanged, so a manifest read and written again loses nothing.
- The key order of a parsed object is remembered: ``to_json()`` of a parsed manifest is
  the parsed object again, key for key and in order, so its bytes round-trip exactly.
  A manifest built in code (the save path) writes its keys in the order the format
  documents.
- Fields are read as attributes (``manifest.step``, ``manifest.files[rel].checksum``); the
  JSON form is ``to_json()``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from statekit.errors import CorruptCheckpointError, FormatVersionError
from statekit.storage.hashing import checksum_bytes

FORMAT = "statekit/1"
"""The manifest's ``format`` value of a checkpoint whose every model is one tensor file."""

FORMAT_SPLIT = "statekit/2"
"""The ``format`` of a checkpoint in which a model's tensors span several files (an
incremental save's frozen-tensor files, :mod:`statekit.engine.incremental`): a reader of
format 1 only would read the first file and miss the rest, so it must refuse the
checkpoint (``FormatVersionError``). Otherwise the same layout as :data:`FORMAT`."""

READ_FORMATS = frozenset({FORMAT, FORMAT_SPLIT})
"""The ``format`` values this version reads."""

MANIFEST_CHECKSUM = "manifest_checksum"
"""The manifest's field holding the XXH3-64 checksum of the rest of the manifest
(:func:`canonical_bytes`); optional: manifests written before it existed have none."""

__all__ = [
    "FORMAT",
    "FORMAT_SPLIT",
    "MANIFEST_CHECKSUM",
    "READ_FORMATS",
    "FileEntry",
    "Fingerprint",
    "StateDigest",
    "LoaderSettings",
    "Manifest",
    "ObjectEntry",
    "ResumeAudit",
    "canonical_bytes",
    "check_relpath",
]


def check_relpath(path: str, source: str = "manifest", error: type[Exception] = CorruptCheckpointError) -> str:
    """Validate a checkpoint-relative path: no scheme, no absolute path, no ``..``.

    Args:
        path: the relative path.
        source: what holds it (a manifest URL), named in the error.
        error: the error class to raise (writers pass a plain ``StatekitError``: a bad
            path given to a writer is a caller bug, not a corrupt checkpoint).

    Returns:
        ``path`` unchanged.

    Raises:
        CorruptCheckpointError: the path escapes the checkpoint or is malformed.
    """
    parts = path.split("/") if isinstance(path, str) else []
    if (
        not parts
        or "://" in path
        or path.startswith("/")
        or "\\" in path
        or any(p in ("", ".", "..") for p in parts)
    ):
        message = f"{source}: invalid relative path {path!r} (must stay inside the checkpoint)"
        raise error(message, path=source) if error is CorruptCheckpointError else error(message)
    return path


def canonical_bytes(body: Mapping[str, Any]) -> bytes:
    """The manifest's JSON without its checksum as canonical JSON (sorted keys, no spaces):
    what :data:`MANIFEST_CHECKSUM` covers. The checksum covers the values, not the layout,
    so re-indenting the file keeps it valid.

    Args:
        body: the manifest's JSON object.

    Returns:
        UTF-8 bytes (lone surrogates passed through).

    Raises:
        ValueError: the object is not strict JSON (NaN or infinity).
    """
    rest = {k: v for k, v in body.items() if k != MANIFEST_CHECKSUM}
    text = json.dumps(rest, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    # surrogatepass: a lone surrogate (os.fsdecode of a non-UTF-8 file name in metadata) is
    # valid in the manifest file (written with \u escapes) and must not fail the commit
    return text.encode("utf-8", "surrogatepass")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@functools.cache
def _json_fields(cls: type) -> list[str]:
    """The JSON keys of a manifest type's fields, in declaration order (computed once per class)."""
    return [f.name for f in dataclasses.fields(cls) if f.name not in cls._JSON_ONLY]  # type: ignore[attr-defined]


class _JsonRecord:
    """What every manifest type shares: the JSON form (``to_json``) with the parsed key
    order and the unknown keys (``extra``) kept."""

    _NULLABLE: ClassVar[frozenset[str]] = frozenset()
    """Fields written as JSON ``null`` when None (others are left out when None)."""
    _JSON_ONLY: ClassVar[frozenset[str]] = frozenset({"extra", "key_order"})
    """Dataclass fields that are not JSON keys."""

    extra: Mapping[str, Any]
    key_order: tuple[str, ...]

    def _field_names(self) -> list[str]:
        return _json_fields(type(self))

    def _json_value(self, name: str) -> Any:
        value = getattr(self, name)
        if isinstance(value, _JsonRecord):
            return value.to_json()
        if isinstance(value, tuple):  # (a file's prefixes are pairs: JSON arrays too)
            return [list(v) if isinstance(v, tuple) else v for v in value]
        if isinstance(value, dict) and value and isinstance(next(iter(value.values())), _JsonRecord):
            return {k: v.to_json() for k, v in value.items()}
        return value

    def to_json(self) -> dict[str, Any]:
        """The JSON object this record is written as (parsed records: the object read, key
        for key and in the same order; unknown keys included).

        Returns:
            A new dict of JSON values (nested records turned into dicts too).
        """
        names = self._field_names()
        known = set(names)
        out: dict[str, Any] = {}
        for key in self.key_order:  # a parsed record: its keys as read (a None was a JSON null)
            if key in known:
                out[key] = self._json_value(key)
            elif key in self.extra:
                out[key] = self.extra[key]
        for name in names:  # built in code, or fields added after parsing (a checksum)
            if name not in out and (getattr(self, name) is not None or (not self.key_order and name in self._NULLABLE)):
                out[name] = self._json_value(name)
        for key, value in self.extra.items():
            if key not in out:
                out[key] = value
        return out


def _built(cls: type, values: dict[str, Any]) -> Any:
    """An instance of the frozen dataclass ``cls`` with every field in ``values``, made
    without the frozen ``__init__``'s per-field ``object.__setattr__`` (a manifest of a
    sharded checkpoint holds tens of thousands of file entries)."""
    obj = object.__new__(cls)
    obj.__dict__.update(values)
    return obj


def _need_object(value: Any, what: str, source: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise CorruptCheckpointError(f"{source}: manifest field {what!r} is not an object", path=source)
    return value


@dataclasses.dataclass(frozen=True)
class FileEntry(_JsonRecord):
    """One file of a checkpoint (``files[<relative path>]``).

    Attributes:
        size_bytes: the file's size in bytes.
        checksum: ``"xxh3_64:<16 hex digits>"`` of the file's bytes.
        rank: the rank that wrote it.
        writer: ``"statekit"`` for the core, else the plugin's name; None in manifests
            written before it was recorded.
        prefixes: incremental saves: ``(offset, 16 hex digits)`` running XXH3-64 checksums
            of the file's first ``offset`` bytes (the end of the header, 1 MiB later, then every 64 MiB;
            :class:`statekit.storage.hashing.PrefixHasher`), which the next save compares
            with the bytes it would write; None elsewhere.
        reused_from: the name of the checkpoint directory (same root) whose identical file
            this one is (a hard link or server-side copy: not written again); None for a
            file this save wrote.
        digest: incremental saves of tensors on an accelerator: ``"mix64:<16 hex digits>"``
            (:mod:`statekit.checks.digest`), which the next save computes on the
            device to recognise the file unchanged without copying it to the host; None
            elsewhere.
        extra: keys this version does not know (a newer writer's), written back as read.
        key_order: the parsed object's key order (empty when built in code).
    """

    size_bytes: int
    checksum: str
    rank: int
    writer: str | None = None
    prefixes: tuple[tuple[int, str], ...] | None = None
    reused_from: str | None = None
    digest: str | None = None
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict, repr=False)
    key_order: tuple[str, ...] = dataclasses.field(default=(), repr=False, compare=False)

    _KEYS: ClassVar[frozenset[str]] = frozenset(
        {"size_bytes", "checksum", "rank", "writer", "prefixes", "reused_from", "digest"}
    )

    @classmethod
    def from_json(cls, entry: Any, path: str, source: str) -> FileEntry:
        """Parse and validate one file entry.

        Args:
            entry: the parsed JSON value.
            path: its relative path (validated too), named in errors.
            source: the manifest's URL, named in errors.

        Returns:
            The entry.

        Raises:
            CorruptCheckpointError: the path escapes the checkpoint, or the entry lacks an
                integer ``size_bytes``/``rank`` or a string ``checksum``.
        """
        check_relpath(path, source)
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("size_bytes"), int)
            or not isinstance(entry.get("checksum"), str)
            or not isinstance(entry.get("rank"), int)
        ):
            raise CorruptCheckpointError(f"{source}: manifest entry for file {path!r} is malformed", path=source)
        prefixes = entry.get("prefixes")
        if prefixes is not None:
            if not isinstance(prefixes, list) or not all(
                isinstance(p, list) and len(p) == 2 and _is_int(p[0]) and isinstance(p[1], str) for p in prefixes
            ):
                raise CorruptCheckpointError(f"{source}: manifest entry for file {path!r}: malformed 'prefixes'", path=source)
            prefixes = tuple((p[0], p[1]) for p in prefixes)
        reused_from = entry.get("reused_from")
        if reused_from is not None and not isinstance(reused_from, str):
            raise CorruptCheckpointError(f"{source}: manifest entry for file {path!r}: malformed 'reused_from'", path=source)
        digest = entry.get("digest")
        if digest is not None and not isinstance(digest, str):
            raise CorruptCheckpointError(f"{source}: manifest entry for file {path!r}: malformed 'digest'", path=source)
        return _built(cls, {
            "size_bytes": entry["size_bytes"],
            "checksum": entry["checksum"],
            "rank": entry["rank"],
            "writer": entry.get("writer"),
            "prefixes": prefixes,
            "reused_from": reused_from,
            "digest": digest,
            "extra": {k: v for k, v in entry.items() if k not in cls._KEYS} if len(entry) > 4 else {},
            "key_order": tuple(entry),
        })

    _NULLABLE = frozenset({"writer"})


@dataclasses.dataclass(frozen=True)
class ObjectEntry(_JsonRecord):
    """One saved object (``objects[<stable key>]``).

    Attributes:
        kind: what it is (``model``, ``optimizer``, ``dataloader``, ``rng``...).
        owner: ``"statekit"`` (the core) or the plugin that saved it.
        per_rank: saved by every rank (True) or by rank 0 only (False); None when not
            recorded.
        files: the core's files of this object (core-owned objects); None when not recorded.
        owner_distribution: the distribution to install to load a plugin-owned object.
        extra: keys this version does not know, written back as read.
        key_order: the parsed object's key order (empty when built in code).
    """

    kind: str
    owner: str
    per_rank: bool | None = None
    files: tuple[str, ...] | None = None
    owner_distribution: str | None = None
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict, repr=False)
    key_order: tuple[str, ...] = dataclasses.field(default=(), repr=False, compare=False)

    _KEYS: ClassVar[frozenset[str]] = frozenset({"kind", "owner", "per_rank", "files", "owner_distribution"})

    @classmethod
    def from_json(cls, obj: Any, key: str, source: str) -> ObjectEntry:
        """Parse and validate one object entry.

        Args:
            obj: the parsed JSON value.
            key: the object's stable key, named in errors.
            source: the manifest's URL, named in errors.

        Returns:
            The entry.

        Raises:
            CorruptCheckpointError: the entry lacks a string ``kind`` or ``owner``.
        """
        if not isinstance(obj, dict) or not isinstance(obj.get("kind"), str) or not isinstance(obj.get("owner"), str):
            raise CorruptCheckpointError(f"{source}: manifest entry for object {key!r} is malformed", path=source)
        files = obj.get("files")
        return _built(cls, {
            "kind": obj["kind"],
            "owner": obj["owner"],
            "per_rank": obj.get("per_rank"),
            "files": tuple(files) if isinstance(files, list) else files,
            "owner_distribution": obj.get("owner_distribution"),
            "extra": {k: v for k, v in obj.items() if k not in cls._KEYS},
            "key_order": tuple(obj),
        })


@dataclasses.dataclass(frozen=True)
class LoaderSettings(_JsonRecord):
    """What a data loader's position depends on, in the resume fingerprint; a setting the
    loader does not say is None (written as JSON null, never compared).

    Attributes:
        batch_size: samples per batch on one device.
        dataset_length: samples in the dataset (None: an iterable dataset without length).
        drop_last: the epoch's last, partial batch is dropped.
        even_batches: Accelerate pads the last batches so that every rank gets as many.
        num_workers: data-loader worker processes.
        sampler: the sampler's class name.
        shuffle: the sampler draws a random order.
        seed: the sampler's seed, where it has one.
        extra: keys this version does not know.
        key_order: the parsed object's key order (empty when built in code).
    """

    batch_size: int | None = None
    dataset_length: int | None = None
    drop_last: bool | None = None
    even_batches: bool | None = None
    num_workers: int | None = None
    sampler: str | None = None
    shuffle: bool | None = None
    seed: int | None = None
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict, repr=False)
    key_order: tuple[str, ...] = dataclasses.field(default=(), repr=False, compare=False)

    _NULLABLE = frozenset({"batch_size", "dataset_length", "drop_last", "even_batches", "num_workers", "sampler",
                           "shuffle", "seed"})

    @classmethod
    def from_json(cls, value: Any, source: str, key: str) -> LoaderSettings:
        """Parse one data loader's entry of the fingerprint.

        Args:
            value: the parsed JSON value.
            source: the manifest's URL, named in errors.
            key: the data loader's stable key, named in errors.

        Returns:
            The settings (values as written: the comparison judges them).

        Raises:
            CorruptCheckpointError: it is not a JSON object.
        """
        if not isinstance(value, dict):
            raise CorruptCheckpointError(
                f"{source}: manifest field 'fingerprint' holds data loader {key!r} that is not an object", path=source)
        names = set(_json_fields(cls))
        return cls(**{k: v for k, v in value.items() if k in names},
                   extra={k: v for k, v in value.items() if k not in names}, key_order=tuple(value))


@dataclasses.dataclass(frozen=True)
class Fingerprint(_JsonRecord):
    """The resume fingerprint: the settings an exact resume depends on (``docs/concepts.md``,
    Resume fingerprint); a setting that could not be determined is None. Built and compared
    field by field by :mod:`statekit.api.fingerprint` (a setting a newer writer adds is kept
    in ``extra`` and written back, not compared: this version knows no effect for it).

    Attributes:
        world_size: processes that saved.
        gradient_accumulation_steps: Accelerate's setting.
        accumulating: saved between two optimizer steps of gradient accumulation.
        mixed_precision: Accelerate's setting.
        rng: the random-number-generator kinds saved.
        dataloaders: per data loader (stable key): what its position depends on
            (:class:`LoaderSettings`).
        objects: the objects saved, stable key -> kind; None in fingerprints written
            before it was recorded.
        versions: python, torch, accelerate, statekit versions.
        extra: keys this version does not know.
        key_order: the parsed object's key order (empty when built in code).
    """

    world_size: int | None = None
    gradient_accumulation_steps: int | None = None
    accumulating: bool | None = None
    mixed_precision: str | None = None
    rng: tuple[str, ...] | None = None
    dataloaders: Mapping[str, LoaderSettings] | None = None
    objects: Mapping[str, str] | None = None
    versions: Mapping[str, str] | None = None
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict, repr=False)
    key_order: tuple[str, ...] = dataclasses.field(default=(), repr=False, compare=False)

    _NULLABLE = frozenset({"world_size", "gradient_accumulation_steps", "accumulating", "mixed_precision", "rng"})

    @classmethod
    def from_json(cls, value: Any, source: str) -> Fingerprint:
        """Parse the ``fingerprint`` field.

        Args:
            value: the parsed JSON value.
            source: the manifest's URL, named in errors.

        Returns:
            The fingerprint (its values as written: the comparison judges them).

        Raises:
            CorruptCheckpointError: it is not a JSON object, or its ``dataloaders`` is not
                an object of objects.
        """
        if not isinstance(value, dict):
            raise CorruptCheckpointError(f"{source}: manifest field 'fingerprint' is not an object", path=source)
        names = {f.name for f in dataclasses.fields(cls)} - cls._JSON_ONLY
        rng = value.get("rng")
        known = {k: v for k, v in value.items() if k in names}
        if isinstance(rng, list):
            known["rng"] = tuple(rng)
        loaders = value.get("dataloaders")
        if loaders is not None:
            loaders = _need_object(loaders, "fingerprint.dataloaders", source)
            known["dataloaders"] = {k: LoaderSettings.from_json(v, source, k) for k, v in loaders.items()}
        return cls(**known, extra={k: v for k, v in value.items() if k not in names}, key_order=tuple(value))


@dataclasses.dataclass(frozen=True)
class ResumeAudit(_JsonRecord):
    """The verdict of the resume the saving run continued from (``docs/concepts.md``,
    Resume audit); written by :mod:`statekit.checks.audit`.

    Attributes:
        resumed_from: ``{"url": ..., "step": ...}`` of the checkpoint the run resumed from.
        verdict: ``verified``, ``diverged``, ``unverifiable`` or ``pending``.
        detail: the verdict in words.
        loaders: per data loader (stable key): ``{"verdict", "detail"}``.
        state: the state check of that resume (``{"verdict", "detail", "compared",
            "sampled"}``: :mod:`statekit.checks.state_check`), or None (not checked, or
            written before it existed).
        extra: keys this version does not know.
        key_order: the parsed object's key order (empty when built in code).
    """

    resumed_from: Mapping[str, Any]
    verdict: str
    detail: str
    loaders: Mapping[str, Mapping[str, Any]]
    state: Mapping[str, Any] | None = None
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict, repr=False)
    key_order: tuple[str, ...] = dataclasses.field(default=(), repr=False, compare=False)

    _KEYS: ClassVar[frozenset[str]] = frozenset({"resumed_from", "verdict", "detail", "loaders", "state"})

    @classmethod
    def from_json(cls, value: Any, source: str) -> ResumeAudit:
        """Parse the ``resume_audit`` field.

        Args:
            value: the parsed JSON value.
            source: the manifest's URL, named in errors.

        Returns:
            The audit (missing parts read as empty).

        Raises:
            CorruptCheckpointError: it is not a JSON object.
        """
        value = _need_object(value, "resume_audit", source)
        return cls(
            resumed_from=value.get("resumed_from") or {},
            verdict=value.get("verdict") or "",
            detail=value.get("detail") or "",
            loaders=value.get("loaders") or {},
            state=value.get("state") if isinstance(value.get("state"), dict) else None,
            extra={k: v for k, v in value.items() if k not in cls._KEYS},
            key_order=tuple(value),
        )

    def to_json(self) -> dict[str, Any]:  # noqa: D102 (as the base)
        out = super().to_json()
        for key in self._KEYS:  # parsed without a part (read as empty): written back without it
            if self.key_order and key not in self.key_order:
                out.pop(key, None)
        return out


@dataclasses.dataclass(frozen=True)
class StateDigest(_JsonRecord):
    """The digests of the saved objects' live tensors at save (issue 38,
    :mod:`statekit.checks.digest`), checked against the live objects after a load
    (:mod:`statekit.checks.state_check`).

    Attributes:
        algorithm: the digest's algorithm (``"emix64"``).
        sampling: which elements were summed (:class:`statekit.checks.digest.Sampling`
            as JSON: ``block``, ``stride``, ``full_below``).
        objects: per object (stable key), per tensor (its path in the object's state
            dict, ``"layers.0.weight"``, ``"state.0.exp_avg"``): ``"<dtype>:<16 hex digits>"``.
        uncompared: per object, per tensor: why it was not digested at save (a ``DTensor``
            whose placements give no global positions, on a mesh of part of the world);
            named by the check after a load. None (absent) when every tensor was digested.
        ties: per model, the groups of tensor paths that were one tensor at save (tied
            weights: ``[["transformer.wte.weight", "lm_head.weight"]]``, the same storage
            and view), each in state dict order; the check names a member no longer tied
            to the others after a load. None (absent) when no model held a tie, or in
            checkpoints written before it existed (ties not checked).
        extra: keys this version does not know.
        key_order: the parsed object's key order (empty when built in code).
    """

    algorithm: str
    sampling: Mapping[str, int]
    objects: Mapping[str, Mapping[str, str]]
    uncompared: Mapping[str, Mapping[str, str]] | None = None
    ties: Mapping[str, Sequence[Sequence[str]]] | None = None
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict, repr=False)
    key_order: tuple[str, ...] = dataclasses.field(default=(), repr=False, compare=False)

    _KEYS: ClassVar[frozenset[str]] = frozenset({"algorithm", "sampling", "objects", "uncompared", "ties"})

    @classmethod
    def from_json(cls, value: Any, source: str) -> StateDigest:
        """Parse the ``state_digest`` field.

        Args:
            value: the parsed JSON value.
            source: the manifest's URL, named in errors.

        Returns:
            The digests.

        Raises:
            CorruptCheckpointError: it is not an object of the documented shape.
        """
        value = _need_object(value, "state_digest", source)
        objects = value.get("objects")
        sampling = value.get("sampling")
        uncompared = value.get("uncompared")
        ties = value.get("ties")

        def strings(table: Any) -> bool:
            return isinstance(table, dict) and all(
                isinstance(o, dict) and all(isinstance(d, str) for d in o.values()) for o in table.values())

        def groups(table: Any) -> bool:
            return isinstance(table, dict) and all(
                isinstance(o, list) and all(isinstance(g, list) and all(isinstance(p, str) for p in g) for g in o)
                for o in table.values())

        if not isinstance(value.get("algorithm"), str) or not isinstance(sampling, dict) or not strings(objects) \
                or not (uncompared is None or strings(uncompared)) or not (ties is None or groups(ties)):
            raise CorruptCheckpointError(f"{source}: manifest field 'state_digest' is malformed", path=source)
        return cls(algorithm=value["algorithm"], sampling=sampling, objects=objects, uncompared=uncompared, ties=ties,
                   extra={k: v for k, v in value.items() if k not in cls._KEYS}, key_order=tuple(value))


@dataclasses.dataclass(frozen=True)
class Lineage(_JsonRecord):
    """Where a checkpoint sits in its root's history (issue 38: lineage): the run that
    wrote it, the branch of that run, and the checkpoint it descends from
    (:mod:`statekit.manager.lineage`).

    Attributes:
        run_id: the run: inherited from the checkpoint the run resumed from, new
            (``uuid4().hex``) for a run that started fresh, or ``CheckpointManager``'s
            ``run_id``.
        branch: the branch of the run: inherited by a crash-resume, new at every rollback
            (``resume(step=K)``) and for a fresh run.
        parent: the name of the checkpoint it descends from (the one the run resumed from,
            for the first save after a resume; else the run's previous save), or None.
        extra: keys this version does not know.
        key_order: the parsed object's key order (empty when built in code).
    """

    run_id: str
    branch: str
    parent: str | None
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict, repr=False)
    key_order: tuple[str, ...] = dataclasses.field(default=(), repr=False, compare=False)

    _NULLABLE = frozenset({"parent"})
    _KEYS: ClassVar[frozenset[str]] = frozenset({"run_id", "branch", "parent"})

    @classmethod
    def from_json(cls, value: Any, source: str) -> Lineage:
        """Parse the ``lineage`` field.

        Args:
            value: the parsed JSON value.
            source: the manifest's URL, named in errors.

        Returns:
            The lineage.

        Raises:
            CorruptCheckpointError: it is not an object of the documented shape.
        """
        value = _need_object(value, "lineage", source)
        parent = value.get("parent")
        if not isinstance(value.get("run_id"), str) or not isinstance(value.get("branch"), str) \
                or not (parent is None or isinstance(parent, str)):
            raise CorruptCheckpointError(f"{source}: manifest field 'lineage' is malformed", path=source)
        return cls(run_id=value["run_id"], branch=value["branch"], parent=parent,
                   extra={k: v for k, v in value.items() if k not in cls._KEYS}, key_order=tuple(value))


_REQUIRED: dict[str, type] = {
    "statekit_version": str,
    "created": str,
    "world_size": int,
    "plugins": dict,
    "objects": dict,
    "files": dict,
    "metadata": dict,
    "records": dict,
}
"""The manifest's required fields and their JSON types."""


@dataclasses.dataclass(frozen=True)
class Manifest(_JsonRecord):
    """A checkpoint's manifest (``statekit.json``, format ``statekit/1`` or ``statekit/2``).

    Returned by :func:`statekit.save`, :func:`statekit.load`, ``CheckpointManager.save``
    and ``resume``, :func:`statekit.save_state`, :func:`~statekit.format.manifest.read_manifest`,
    and given to plugins as ``checkpoint.manifest`` at load.

    Attributes:
        statekit_version: the statekit version that wrote it.
        created: commit time, UTC ISO 8601 with a ``Z`` suffix.
        step: the training step, or None.
        world_size: processes that saved.
        plugins: plugin name -> version, for every plugin that wrote, claimed or recorded.
        objects: stable key -> :class:`ObjectEntry`.
        records: plugin name -> what the plugin stored in ``checkpoint.records`` (its JSON).
        files: relative path -> :class:`FileEntry`, every file of the checkpoint.
        metadata: user metadata (the metrics given to ``CheckpointManager.save``...).
        fingerprint: the resume fingerprint; None in checkpoints written without one.
        resume_audit: the verdict of the resume the saving run continued from; None when
            it did not resume.
        state_digest: the digests of the saved objects' live tensors
            (:class:`StateDigest`); None in checkpoints written without one.
        lineage: run, branch and parent of the checkpoint (:class:`Lineage`); None in
            checkpoints written before it existed or outside a ``CheckpointManager``.
        manifest_checksum: XXH3-64 of the rest (canonical JSON); None before the commit
            and in manifests written before it existed.
        format: ``"statekit/1"``, or ``"statekit/2"`` when a model spans several tensor files (:data:`FORMAT_SPLIT`).
        extra: top-level keys this version does not know (a newer minor writer's), kept
            and written back as read.
        key_order: the parsed object's key order (empty when built in code).
        incompatible_keys: after a non-strict :func:`statekit.load`: stable key ->
            ``{"missing_keys": [...], "unexpected_keys": [...]}`` of every model the core
            loaded; never written.
        missing_objects: after a non-strict load: the keys the checkpoint did not hold;
            never written.
    """

    statekit_version: str
    created: str
    step: int | None
    world_size: int
    plugins: Mapping[str, str]
    objects: Mapping[str, ObjectEntry]
    records: Mapping[str, Any]
    files: Mapping[str, FileEntry]
    metadata: Mapping[str, Any]
    fingerprint: Fingerprint | None = None
    resume_audit: ResumeAudit | None = None
    state_digest: StateDigest | None = None
    lineage: Lineage | None = None
    manifest_checksum: str | None = None
    format: str = FORMAT
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict, repr=False)
    key_order: tuple[str, ...] = dataclasses.field(default=(), repr=False, compare=False)
    incompatible_keys: Mapping[str, Mapping[str, list[str]]] | None = dataclasses.field(default=None, compare=False)
    missing_objects: tuple[str, ...] | None = dataclasses.field(default=None, compare=False)

    _NULLABLE = frozenset({"step"})
    _JSON_ONLY = frozenset({"extra", "key_order", "incompatible_keys", "missing_objects"})
    _ORDER: ClassVar[tuple[str, ...]] = (
        "format", "statekit_version", "created", "step", "world_size", "plugins", "objects", "records", "files",
        "metadata", "fingerprint", "resume_audit", "state_digest", "lineage", "manifest_checksum",
    )
    """The key order of a manifest built in code (the order the save path always wrote)."""

    def _field_names(self) -> list[str]:
        return list(self._ORDER)

    @classmethod
    def from_json(cls, manifest: Any, source: str, *, check_checksum: bool = True) -> Manifest:
        """Parse and validate a manifest: the one place a manifest is checked against format
        version 1 (``docs/format.md``).

        Args:
            manifest: the parsed JSON object, or the file's bytes.
            source: the manifest's URL, named in errors.
            check_checksum: compare the manifest with its own :data:`MANIFEST_CHECKSUM`
                (when it has one).

        Returns:
            The manifest.

        Raises:
            FormatVersionError: ``format`` is not ``statekit/1`` (a newer or foreign format).
            CorruptCheckpointError: the bytes are not JSON, a required field is missing or
                has the wrong type, a file or object entry is malformed, the optional
                ``fingerprint`` or ``resume_audit`` is not an object, or the manifest does
                not match its own checksum (edited or damaged after its commit).
        """
        if isinstance(manifest, (bytes, bytearray, memoryview)):
            try:
                manifest = json.loads(bytes(manifest).decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise CorruptCheckpointError(f"{source}: manifest is not valid JSON: {exc}", path=source) from None
        if not isinstance(manifest, dict):
            raise CorruptCheckpointError(f"{source}: manifest is not a JSON object", path=source)
        fmt = manifest.get("format")
        if fmt not in READ_FORMATS:
            if isinstance(fmt, str) and fmt.startswith("statekit/"):
                raise FormatVersionError(
                    f"{source}: checkpoint format {fmt!r} is not supported by this statekit "
                    f"(reads {' and '.join(sorted(READ_FORMATS))}); upgrade statekit"
                )
            raise CorruptCheckpointError(f"{source}: not a statekit manifest (format={fmt!r})", path=source)
        for key, typ in _REQUIRED.items():
            if not isinstance(manifest.get(key), typ) or isinstance(manifest.get(key), bool):
                raise CorruptCheckpointError(f"{source}: manifest field {key!r} missing or not {typ.__name__}", path=source)
        step = manifest.get("step")
        if step is not None and not _is_int(step):
            raise CorruptCheckpointError(f"{source}: manifest field 'step' is not an integer", path=source)
        fingerprint = manifest.get("fingerprint")
        if "fingerprint" in manifest:  # optional (older checkpoints lack it)
            fingerprint = Fingerprint.from_json(fingerprint, source)
        files = {path: FileEntry.from_json(entry, path, source) for path, entry in manifest["files"].items()}
        objects = {key: ObjectEntry.from_json(obj, key, source) for key, obj in manifest["objects"].items()}
        audit = ResumeAudit.from_json(manifest["resume_audit"], source) if "resume_audit" in manifest else None
        digest = StateDigest.from_json(manifest["state_digest"], source) if "state_digest" in manifest else None
        lineage = Lineage.from_json(manifest["lineage"], source) if "lineage" in manifest else None
        recorded = manifest.get(MANIFEST_CHECKSUM)
        if check_checksum and recorded is not None:
            actual = checksum_bytes(canonical_bytes(manifest)) if isinstance(recorded, str) else None
            if actual != recorded:
                raise CorruptCheckpointError(
                    f"{source}: the manifest does not match its own checksum (recorded {recorded!r}, computed {actual!r}): "
                    "it was edited or damaged after the commit",
                    path=source,
                )
        known = set(cls._ORDER)
        return cls(
            format=fmt,
            statekit_version=manifest["statekit_version"],
            created=manifest["created"],
            step=step,
            world_size=manifest["world_size"],
            plugins=manifest["plugins"],
            objects=objects,
            records=manifest["records"],
            files=files,
            metadata=manifest["metadata"],
            fingerprint=fingerprint,
            resume_audit=audit,
            state_digest=digest,
            lineage=lineage,
            manifest_checksum=recorded,
            extra={k: v for k, v in manifest.items() if k not in known},
            key_order=tuple(manifest),
        )

    def sealed(self) -> tuple[Manifest, bytes]:
        """This manifest with :data:`MANIFEST_CHECKSUM` set, and the bytes of its file.

        Every file of a checkpoint is checksummed in the manifest; the manifest checksums
        itself, so one flipped bit in it (a ``step`` of 9 instead of 8, a metric that
        steers ``keep_best``) is a :class:`CorruptCheckpointError` at read, not a silent
        wrong resume. The checksum is taken over the manifest as a reader parses it back
        (JSON turns integer keys into strings), in canonical form.

        Returns:
            ``(manifest, data)``: the manifest with its checksum, and UTF-8 JSON indented
            one space per level.

        Raises:
            ValueError: the manifest is not strict JSON (NaN or infinity).
        """
        body = self.to_json()
        parsed = json.loads(json.dumps(body, allow_nan=False))
        checksum = checksum_bytes(canonical_bytes(parsed))
        body[MANIFEST_CHECKSUM] = checksum
        data = json.dumps(body, indent=1, allow_nan=False).encode("utf-8")
        return dataclasses.replace(self, manifest_checksum=checksum), data

    def size_of(self, rel: str) -> int | None:
        """The size the manifest records for file ``rel``.

        Args:
            rel: a path relative to the checkpoint.

        Returns:
            Its size in bytes, or None when the manifest does not list it.
        """
        entry = self.files.get(rel)
        return entry.size_bytes if entry is not None else None

    @property
    def size_bytes(self) -> int:
        """The checkpoint's size: the sum of its files' sizes, in bytes."""
        return sum(entry.size_bytes for entry in self.files.values())

    @property
    def reused_bytes(self) -> int:
        """Bytes of the files an incremental save reused from an earlier checkpoint
        (``reused_from``: hard-linked or copied server-side, not written), in bytes."""
        return sum(entry.size_bytes for entry in self.files.values() if entry.reused_from)

    @property
    def written_bytes(self) -> int:
        """Bytes the save that made this checkpoint wrote: :attr:`size_bytes` less
        :attr:`reused_bytes`."""
        return self.size_bytes - self.reused_bytes

    def layout(self, core: str) -> str:
        """How the checkpoint's files are laid out: ``records[core]["layout"]``
        (``"accelerate"`` when an attached accelerator wrote them), else ``"statekit"``.

        Args:
            core: the core's owner name (``"statekit"``).

        Returns:
            The layout name.
        """
        record = self.records.get(core)
        return record.get("layout", "statekit") if isinstance(record, Mapping) else "statekit"
