"""The manifest's types: frozen dataclasses for ``statekit.json`` (modelled on
``torch.distributed.checkpoint.metadata``), parsed and validated in one place
(:meth:`Manifest.from_json`), written by ``to_json()`` in canonical order; no I/O.
Versioning: docs/format.md, "Versioning" (a newer major is a ``FormatVersionError``; a
newer minor's keys are ignored).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from statekit.errors import CorruptCheckpointError, FormatVersionError
from statekit.format.layout import check_relpath
from statekit.storage.hashing import checksum_bytes

FORMAT = "statekit/1"
"""The manifest's ``format`` value of a checkpoint whose every model is one tensor file."""

FORMAT_SPLIT = "statekit/2"
"""The ``format`` of a checkpoint in which a model's tensors span several files (an
incremental save's frozen-tensor files): a reader of version 1 only refuses it."""

FORMAT_REFERENCED = "statekit/3"
"""The ``format`` of a checkpoint that references a model's frozen tensors in a pretrained
folder instead of holding them (``references``): a reader of versions 1 and 2 refuses it
rather than load a model without them."""

READ_FORMATS = frozenset({FORMAT, FORMAT_SPLIT, FORMAT_REFERENCED})
"""The ``format`` values this version reads."""

MANIFEST_CHECKSUM = "manifest_checksum"
"""The field holding the XXH3-64 checksum of the rest of the manifest (:func:`canonical_bytes`)."""

__all__ = ["FORMAT", "FORMAT_REFERENCED", "FORMAT_SPLIT", "MANIFEST_CHECKSUM", "READ_FORMATS", "FileEntry", "Fingerprint",
           "Reference", "SourceFile", "SourceTensor", "StateDigest",
           "LoaderSettings", "Lineage", "Manifest", "ObjectEntry", "ResumeAudit", "canonical_bytes"]


def canonical_bytes(body: Mapping[str, Any]) -> bytes:
    """What :data:`MANIFEST_CHECKSUM` covers: the manifest's JSON object ``body`` without it as
    canonical JSON UTF-8 bytes (``docs/format.md``, ``manifest_checksum``); raises ``ValueError``
    when it is not strict JSON (NaN or infinity)."""
    rest = {k: v for k, v in body.items() if k != MANIFEST_CHECKSUM}
    text = json.dumps(rest, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    # surrogatepass: a lone surrogate (os.fsdecode of a non-UTF-8 file name in metadata) is
    # valid in the manifest file (written with \u escapes) and must not fail the commit
    return text.encode("utf-8", "surrogatepass")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _corrupt(source: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{source}: {what}", path=source)


@functools.cache
def _json_fields(cls: type) -> tuple[str, ...]:
    """The JSON keys of a manifest type, in declaration order: the order they are written in."""
    return tuple(f.name for f in dataclasses.fields(cls) if f.name not in cls._NOT_WRITTEN)  # type: ignore[attr-defined]


def _known(cls: type, value: dict[str, Any]) -> dict[str, Any]:
    """The keys of ``value`` that ``cls`` knows (a newer minor writer's others are ignored)."""
    return {k: value[k] for k in _json_fields(cls) if k in value}


def _json_value(value: Any) -> Any:
    if isinstance(value, _Record):
        return value.to_json()
    if isinstance(value, tuple):  # (a file's prefixes are pairs: JSON arrays too)
        return [list(v) if isinstance(v, tuple) else v for v in value]
    if isinstance(value, dict) and value and isinstance(next(iter(value.values())), _Record):
        return {k: v.to_json() for k, v in value.items()}
    return value


class _Record:
    """The JSON form every manifest type shares."""

    _NULLABLE: ClassVar[frozenset[str]] = frozenset()  # written as null when None (others: left out)
    _NOT_WRITTEN: ClassVar[frozenset[str]] = frozenset()  # dataclass fields that are not JSON keys

    def to_json(self) -> dict[str, Any]:
        """A new dict of JSON values (nested records too), keys in the canonical order."""
        out: dict[str, Any] = {}
        for name in _json_fields(type(self)):
            value = getattr(self, name)
            if value is not None or name in self._NULLABLE:
                out[name] = _json_value(value)
        return out


def _built(cls: type, values: dict[str, Any]) -> Any:
    """``cls(**values)`` without the frozen ``__init__``'s per-field ``object.__setattr__`` (speed)."""
    obj = object.__new__(cls)
    obj.__dict__.update(values)
    return obj


def _need_object(value: Any, what: str, source: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _corrupt(source, f"manifest field {what!r} is not an object")
    return value


def _prefixes(value: Any, path: str, source: str) -> tuple[tuple[int, str], ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(
        isinstance(p, list) and len(p) == 2 and _is_int(p[0]) and isinstance(p[1], str) for p in value
    ):
        raise _corrupt(source, f"manifest entry for file {path!r}: malformed 'prefixes'")
    return tuple((p[0], p[1]) for p in value)


@dataclasses.dataclass(frozen=True)
class FileEntry(_Record):
    """One file of a checkpoint (``files[<relative path>]``; ``docs/format.md``, Manifest).

    Attributes:
        size_bytes: the file's size in bytes.
        checksum: ``"xxh3_64:<16 hex digits>"`` of the file's bytes.
        rank: the rank that wrote it.
        writer: ``"statekit"`` for the core, else the plugin's name; None when not recorded.
        prefixes: incremental saves: ``(offset in bytes, 16 hex digits)`` XXH3-64 checksums of
            the file's first ``offset`` bytes; None elsewhere.
        reused_from: the checkpoint directory (same root) whose identical file this is
            (hard-linked or copied, not written); None for a file this save wrote.
        digest: incremental saves from an accelerator: ``"mix64:<16 hex digits>"``
            (:mod:`statekit.checks.digest`); None elsewhere.
    """

    size_bytes: int
    checksum: str
    rank: int
    writer: str | None = None
    prefixes: tuple[tuple[int, str], ...] | None = None
    reused_from: str | None = None
    digest: str | None = None

    _NULLABLE = frozenset({"writer"})

    @classmethod
    def from_json(cls, entry: Any, path: str, source: str) -> FileEntry:
        """Parse one file entry (``path``, validated too, and ``source``, the manifest's URL, named
        in errors).

        Raises:
            CorruptCheckpointError: the path escapes the checkpoint, or a field is missing or malformed.
        """
        check_relpath(path, source)
        if not isinstance(entry, dict) or not isinstance(entry.get("size_bytes"), int) \
                or not isinstance(entry.get("checksum"), str) or not isinstance(entry.get("rank"), int):
            raise _corrupt(source, f"manifest entry for file {path!r} is malformed")
        for name in ("reused_from", "digest"):
            if not isinstance(entry.get(name), (str, type(None))):
                raise _corrupt(source, f"manifest entry for file {path!r}: malformed {name!r}")
        return _built(cls, {"size_bytes": entry["size_bytes"], "checksum": entry["checksum"], "rank": entry["rank"],
                            "writer": entry.get("writer"), "prefixes": _prefixes(entry.get("prefixes"), path, source),
                            "reused_from": entry.get("reused_from"), "digest": entry.get("digest")})


@dataclasses.dataclass(frozen=True)
class ObjectEntry(_Record):
    """One saved object (``objects[<key>]``; fields: ``docs/format.md``); None: not recorded."""

    kind: str
    owner: str
    per_rank: bool | None = None
    files: tuple[str, ...] | None = None
    owner_distribution: str | None = None

    @classmethod
    def from_json(cls, obj: Any, key: str, source: str) -> ObjectEntry:
        """Parse one object entry; raises ``CorruptCheckpointError`` (``key``, ``source`` named)
        when it lacks a string ``kind`` or ``owner``."""
        if not isinstance(obj, dict) or not isinstance(obj.get("kind"), str) or not isinstance(obj.get("owner"), str):
            raise _corrupt(source, f"manifest entry for object {key!r} is malformed")
        files = obj.get("files")
        return _built(cls, {"kind": obj["kind"], "owner": obj["owner"], "per_rank": obj.get("per_rank"),
                            "files": tuple(files) if isinstance(files, list) else files,
                            "owner_distribution": obj.get("owner_distribution")})


@dataclasses.dataclass(frozen=True)
class LoaderSettings(_Record):
    """What a data loader's position depends on (``fingerprint.dataloaders[<key>]``; fields:
    ``docs/format.md``, ``fingerprint``); a setting the loader does not say is None (null, never compared)."""

    batch_size: int | None = None
    dataset_length: int | None = None
    drop_last: bool | None = None
    even_batches: bool | None = None
    num_workers: int | None = None
    sampler: str | None = None
    shuffle: bool | None = None
    seed: int | None = None

    _NULLABLE = frozenset({"batch_size", "dataset_length", "drop_last", "even_batches", "num_workers", "sampler",
                           "shuffle", "seed"})

    @classmethod
    def from_json(cls, value: Any, source: str, key: str) -> LoaderSettings:
        """Parse one data loader's entry of the fingerprint; raises ``CorruptCheckpointError``
        (``source``, ``key`` named) when it is not a JSON object."""
        if not isinstance(value, dict):
            raise _corrupt(source, f"manifest field 'fingerprint' holds data loader {key!r} that is not an object")
        return cls(**_known(cls, value))


@dataclasses.dataclass(frozen=True)
class Fingerprint(_Record):
    """The resume fingerprint: the settings an exact resume depends on (fields: ``docs/format.md``,
    ``fingerprint``; ``docs/concepts.md``, Resume fingerprint); a setting that could not be
    determined is None. Built and compared by :mod:`statekit.api.fingerprint`."""

    world_size: int | None = None
    gradient_accumulation_steps: int | None = None
    accumulating: bool | None = None
    mixed_precision: str | None = None
    rng: tuple[str, ...] | None = None
    dataloaders: Mapping[str, LoaderSettings] | None = None
    objects: Mapping[str, str] | None = None
    versions: Mapping[str, str] | None = None

    _NULLABLE = frozenset({"world_size", "gradient_accumulation_steps", "accumulating", "mixed_precision", "rng"})

    @classmethod
    def from_json(cls, value: Any, source: str) -> Fingerprint:
        """Parse the ``fingerprint`` field; raises ``CorruptCheckpointError`` (``source`` named)
        when it, or its ``dataloaders``, is not an object of objects."""
        known = _known(cls, _need_object(value, "fingerprint", source))
        if isinstance(known.get("rng"), list):
            known["rng"] = tuple(known["rng"])
        loaders = known.get("dataloaders")
        if loaders is not None:
            loaders = _need_object(loaders, "fingerprint.dataloaders", source)
            known["dataloaders"] = {k: LoaderSettings.from_json(v, source, k) for k, v in loaders.items()}
        return cls(**known)


@dataclasses.dataclass(frozen=True)
class ResumeAudit(_Record):
    """The verdict of the resume the saving run continued from (fields: ``docs/format.md``,
    ``resume_audit``; ``docs/concepts.md``, Resume audit); written by :mod:`statekit.checks.audit`.
    ``state`` is None when the load was not state-checked."""

    resumed_from: Mapping[str, Any]
    verdict: str
    detail: str
    loaders: Mapping[str, Mapping[str, Any]]
    state: Mapping[str, Any] | None = None

    @classmethod
    def from_json(cls, value: Any, source: str) -> ResumeAudit:
        """Parse the ``resume_audit`` field (missing parts read as empty); raises
        ``CorruptCheckpointError`` (``source`` named) when it is not a JSON object."""
        value = _need_object(value, "resume_audit", source)
        return cls(
            resumed_from=value.get("resumed_from") or {},
            verdict=value.get("verdict") or "",
            detail=value.get("detail") or "",
            loaders=value.get("loaders") or {},
            state=value.get("state") if isinstance(value.get("state"), dict) else None,
        )


def _strings(table: Any) -> bool:  # {object: {path: str}}
    return isinstance(table, dict) and all(
        isinstance(o, dict) and all(isinstance(d, str) for d in o.values()) for o in table.values())


def _groups(table: Any) -> bool:  # {object: [[str, ...], ...]}
    return isinstance(table, dict) and all(
        isinstance(o, list) and all(isinstance(g, list) and all(isinstance(p, str) for p in g) for g in o)
        for o in table.values())


@dataclasses.dataclass(frozen=True)
class StateDigest(_Record):
    """The digests of the saved objects' live tensors at save (fields: ``docs/format.md``,
    ``state_digest``; :mod:`statekit.checks.digest`), checked after a load by
    :mod:`statekit.checks.state_check`. ``uncompared`` and ``ties`` are None when there are none."""

    algorithm: str
    sampling: Mapping[str, int]
    objects: Mapping[str, Mapping[str, str]]
    uncompared: Mapping[str, Mapping[str, str]] | None = None
    ties: Mapping[str, Sequence[Sequence[str]]] | None = None

    @classmethod
    def from_json(cls, value: Any, source: str) -> StateDigest:
        """Parse the ``state_digest`` field; raises ``CorruptCheckpointError`` (``source`` named) when it
        is not an object of the documented shape."""
        known = _known(cls, _need_object(value, "state_digest", source))
        if not isinstance(known.get("algorithm"), str) or not isinstance(known.get("sampling"), dict) \
                or not _strings(known.get("objects")) or not (known.get("uncompared") is None or _strings(known["uncompared"])) \
                or not (known.get("ties") is None or _groups(known["ties"])):
            raise _corrupt(source, "manifest field 'state_digest' is malformed")
        return cls(**known)


@dataclasses.dataclass(frozen=True)
class Lineage(_Record):
    """Where a checkpoint sits in its root's history: ``run_id``, ``branch``, ``parent`` (None for a
    fresh run's first save); ``docs/format.md``, ``lineage``; :mod:`statekit.manager.lineage`."""

    run_id: str
    branch: str
    parent: str | None

    _NULLABLE = frozenset({"parent"})

    @classmethod
    def from_json(cls, value: Any, source: str) -> Lineage:
        """Parse the ``lineage`` field; raises ``CorruptCheckpointError`` (``source`` named) when it
        is not an object of the documented shape."""
        value = _need_object(value, "lineage", source)
        parent = value.get("parent")
        if not isinstance(value.get("run_id"), str) or not isinstance(value.get("branch"), str) \
                or not (parent is None or isinstance(parent, str)):
            raise _corrupt(source, "manifest field 'lineage' is malformed")
        return cls(run_id=value["run_id"], branch=value["branch"], parent=parent)


@dataclasses.dataclass(frozen=True)
class SourceFile(_Record):
    """One safetensors file of a referenced pretrained folder (``references[<key>].files[<name>]``).

    Attributes:
        size_bytes: the file's size, bytes.
        header_checksum: ``"xxh3_64:<16 hex digits>"`` of its first ``8 + N`` bytes (the
            length and the JSON header): a file whose tensors were renamed, retyped, reshaped
            or moved no longer matches.
    """

    size_bytes: int
    header_checksum: str


@dataclasses.dataclass(frozen=True)
class SourceTensor(_Record):
    """Where one referenced tensor is (``references[<key>].tensors[<state-dict name>]``).

    Attributes:
        file: the source file, relative to the folder.
        name: the tensor's name in that file (a peft or compiled model's state-dict name
            differs: ``base_model.model.x.base_layer.weight`` is ``x.weight`` there).
        checksum: ``"xxh3_64:<16 hex digits>"`` of the tensor's bytes as stored.
    """

    file: str
    name: str
    checksum: str


@dataclasses.dataclass(frozen=True)
class Reference(_Record):
    """A model's frozen tensors kept in a pretrained folder, not in the checkpoint
    (``references[<key>]``; docs/export.md, "A frozen base is referenced"; the engine:
    :mod:`statekit.engine.references`).

    Attributes:
        source: the folder's URL as given or learned (``/models/llama``, ``s3://bucket/base``).
        base_id: ``xxh3_64`` hex of the files' names, sizes and header checksums: the folder
            name of a copy carried beside the checkpoints (``<root>/.statekit-bases/<base_id>``).
        files: file name -> :class:`SourceFile`.
        tensors: the model's state-dict name -> :class:`SourceTensor`.
    """

    source: str
    base_id: str
    files: Mapping[str, SourceFile]
    tensors: Mapping[str, SourceTensor]

    @classmethod
    def from_json(cls, value: Any, source: str, key: str) -> Reference:
        """Parse ``references[key]``; raises ``CorruptCheckpointError`` (``source`` and ``key``
        named) when it is not of the documented shape or a file name escapes the folder."""
        what = f"manifest field 'references' of model {key!r} is malformed"
        if not isinstance(value, dict) or not isinstance(value.get("source"), str) \
                or not isinstance(value.get("base_id"), str) or not isinstance(value.get("files"), dict) \
                or not isinstance(value.get("tensors"), dict):
            raise _corrupt(source, what)
        files, tensors = {}, {}
        for name, f in value["files"].items():
            check_relpath(name, source)
            if not isinstance(f, dict) or not _is_int(f.get("size_bytes")) or not isinstance(f.get("header_checksum"), str):
                raise _corrupt(source, what)
            files[name] = SourceFile(f["size_bytes"], f["header_checksum"])
        for name, t in value["tensors"].items():
            if not isinstance(t, dict) or not all(isinstance(t.get(k), str) for k in ("file", "name", "checksum")) \
                    or t["file"] not in files:
                raise _corrupt(source, what)
            tensors[name] = SourceTensor(t["file"], t["name"], t["checksum"])
        return cls(source=value["source"], base_id=value["base_id"], files=files, tensors=tensors)


def _references(value: Any, source: str) -> dict[str, Reference]:
    return {key: Reference.from_json(ref, source, key) for key, ref in _need_object(value, "references", source).items()}


# the manifest's required fields and their JSON types; its optional records and their parsers
_REQUIRED: dict[str, type] = {"statekit_version": str, "created": str, "world_size": int, "plugins": dict,
                               "objects": dict, "files": dict, "metadata": dict, "records": dict}
_OPTIONAL: dict[str, Any] = {"fingerprint": Fingerprint.from_json, "resume_audit": ResumeAudit.from_json,
                             "state_digest": StateDigest.from_json, "lineage": Lineage.from_json,
                             "references": _references}


def _manifest_object(manifest: Any, source: str) -> dict[str, Any]:
    """The manifest's JSON object, its format read by this version and its required fields typed."""
    if isinstance(manifest, (bytes, bytearray, memoryview)):
        try:
            manifest = json.loads(bytes(manifest).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise _corrupt(source, f"manifest is not valid JSON: {exc}") from None
    if not isinstance(manifest, dict):
        raise _corrupt(source, "manifest is not a JSON object")
    fmt = manifest.get("format")
    if not isinstance(fmt, str) or fmt not in READ_FORMATS:  # (a list is unhashable: not a set lookup)
        if isinstance(fmt, str) and fmt.startswith("statekit/"):
            raise FormatVersionError(
                f"{source}: checkpoint format {fmt!r} is not supported by this statekit "
                f"(reads {' and '.join(sorted(READ_FORMATS))}); upgrade statekit"
            )
        raise _corrupt(source, f"not a statekit manifest (format={fmt!r})")
    for key, typ in _REQUIRED.items():
        if not isinstance(manifest.get(key), typ) or isinstance(manifest.get(key), bool):
            raise _corrupt(source, f"manifest field {key!r} missing or not {typ.__name__}")
    if manifest.get("step") is not None and not _is_int(manifest["step"]):
        raise _corrupt(source, "manifest field 'step' is not an integer")
    return manifest


def _check_checksum(manifest: dict[str, Any], source: str) -> None:
    recorded = manifest.get(MANIFEST_CHECKSUM)
    if recorded is None:  # written before the checksum existed
        return
    actual = checksum_bytes(canonical_bytes(manifest)) if isinstance(recorded, str) else None
    if actual != recorded:
        raise _corrupt(source, f"the manifest does not match its own checksum (recorded {recorded!r}, computed {actual!r}): "
                               "it was edited or damaged after the commit")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Manifest(_Record):
    """A checkpoint's manifest (``statekit.json``; every field: ``docs/format.md``, Manifest), as
    saves and loads return it and plugins get it (``checkpoint.manifest``). Read by attribute;
    the JSON object is :meth:`to_json`.

    Attributes:
        format: ``"statekit/1"``, or ``"statekit/2"`` when a model spans several tensor files.
        statekit_version: the statekit version that wrote it.
        created: commit time, UTC ISO 8601 with a ``Z`` suffix.
        step: the training step, or None.
        world_size: processes that saved.
        plugins: plugin name -> version, for every plugin that wrote, claimed or recorded.
        objects: stable key -> :class:`ObjectEntry`.
        records: plugin name -> what the plugin stored in ``checkpoint.records`` (its JSON).
        files: relative path -> :class:`FileEntry`, every file of the checkpoint.
        metadata: user metadata (the metrics given to ``CheckpointManager.save``...).
        fingerprint: the resume fingerprint (:class:`Fingerprint`), or None.
        resume_audit: the verdict of the resume the saving run continued from
            (:class:`ResumeAudit`), or None.
        state_digest: the digests of the saved objects' live tensors (:class:`StateDigest`), or None.
        lineage: run, branch and parent of the checkpoint (:class:`Lineage`), or None.
        references: model key -> :class:`Reference`, the frozen tensors a pretrained folder
            holds for it (format ``statekit/3``), or None.
        manifest_checksum: XXH3-64 of the rest (:func:`canonical_bytes`); None before the commit.
        incompatible_keys: after a non-strict :func:`statekit.load`, never written: stable key
            -> ``{"missing_keys": [...], "unexpected_keys": [...]}`` of every model the core loaded.
        missing_objects: after a non-strict load, never written: the keys the checkpoint lacked.
    """

    format: str = FORMAT
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
    references: Mapping[str, Reference] | None = None
    manifest_checksum: str | None = None
    incompatible_keys: Mapping[str, Mapping[str, list[str]]] | None = dataclasses.field(default=None, compare=False)
    missing_objects: tuple[str, ...] | None = dataclasses.field(default=None, compare=False)

    _NULLABLE = frozenset({"step"})
    _NOT_WRITTEN = frozenset({"incompatible_keys", "missing_objects"})

    @classmethod
    def from_json(cls, manifest: Any, source: str, *, check_checksum: bool = True) -> Manifest:
        """Parse and validate a manifest (``manifest``: its JSON object or bytes; ``source``: its URL,
        named in errors); unknown keys are ignored. ``check_checksum``: compare it with its own
        :data:`MANIFEST_CHECKSUM`, if any.

        Raises:
            FormatVersionError: ``format`` is a ``statekit/N`` this version does not read.
            CorruptCheckpointError: not JSON, a field missing or of the wrong type, a malformed
                entry, or a manifest that does not match its own checksum.
        """
        manifest = _manifest_object(manifest, source)
        optional = {name: parse(manifest[name], source) for name, parse in _OPTIONAL.items() if name in manifest}
        files = {path: FileEntry.from_json(entry, path, source) for path, entry in manifest["files"].items()}
        objects = {key: ObjectEntry.from_json(obj, key, source) for key, obj in manifest["objects"].items()}
        if check_checksum:
            _check_checksum(manifest, source)
        return cls(**{**_known(cls, manifest), "step": manifest.get("step"), "files": files, "objects": objects, **optional})

    def sealed(self) -> tuple[Manifest, bytes]:
        """This manifest with :data:`MANIFEST_CHECKSUM` set, in canonical form.

        Returns:
            ``(manifest, data)``: the sealed manifest and the file's bytes (UTF-8 JSON).

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
        """The size the manifest records for one file.

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
        (``reused_from``: hard-linked or copied server-side, not written)."""
        return sum(entry.size_bytes for entry in self.files.values() if entry.reused_from)

    @property
    def written_bytes(self) -> int:
        """Bytes the save that made this checkpoint wrote: :attr:`size_bytes` less
        :attr:`reused_bytes`."""
        return self.size_bytes - self.reused_bytes

    def layout(self, core: str) -> str:
        """How the checkpoint's files are laid out: ``records[core]["layout"]`` (``"accelerate"``
        when an attached accelerator wrote them), else ``"statekit"``.

        Args:
            core: the core's owner name (``"statekit"``).

        Returns:
            The layout name.
        """
        record = self.records.get(core)
        return record.get("layout", "statekit") if isinstance(record, Mapping) else "statekit"
