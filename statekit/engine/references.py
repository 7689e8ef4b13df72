"""A checkpoint's references to a pretrained folder: the tensors of a model that equal, byte
for byte, tensors of the folder (:mod:`statekit.engine.pretrained`: where a model's folder is,
its files and checksums) are recorded as references (:class:`statekit.format.Reference`:
folder, file, name, checksum) instead of written; a load reads them from that folder, each
tensor checked against its checksum; a copy of the checkpoint at another root carries the
folder once.

The save side is :func:`reference_frozen`; the load side :class:`ResolvedReference`; the
carried copies :func:`carry_references`. Why a reference is safe and what it costs:
docs/export.md, "A frozen base is referenced", and docs/design-notes.md; the format:
docs/format.md, ``references``; replication: docs/tiers.md, "A referenced frozen base".
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from statekit.engine.incremental import frozen_names
from statekit.engine.locking import end_copy_in_progress, mark_copy_in_progress
from statekit.engine.pretrained import Source, SourceFolder, base_id, folder_for, live_checksum
from statekit.errors import ChangedBaseError, CorruptCheckpointError, MissingBaseError, StatekitWarning, StorageError, warn_user
from statekit.format.header import view_identity
from statekit.format.manifest_types import Reference, SourceFile, SourceTensor
from statekit.storage import Storage

logger = logging.getLogger("statekit")

BASES_DIR = ".statekit-bases"
"""The folder of a checkpoint root that holds carried copies of referenced folders
(``<root>/.statekit-bases/<base_id>/<file>``: a replica tier's copy, or one put there by hand);
a load looks there when the recorded folder is gone."""

CARRIED_RECORD = "statekit-base.json"
"""The record statekit writes in a carried copy (``<root>/.statekit-bases/<base_id>/``) once
every file it copied there verified: JSON ``{"base_id", "source", "files": {name:
{size_bytes, header_checksum}}}``. It (or statekit's lock, left by an interrupted carry or
deletion) is what shows statekit wrote the folder: ``statekit gc`` removes only such a folder,
and only when no committed checkpoint of the root references its ``base_id``."""

_COPY_CHUNK = 16 * 1024**2  # bytes per read/write while carrying a base file


# ---------------------------------------------------------------------- save side


_WRAPPER_PREFIXES = ("base_model.model.", "_orig_mod.", "module.")


def candidate_names(name: str, model: torch.nn.Module | None) -> list[str]:
    """The names a model's state-dict key ``name`` may have in its pretrained files, most
    likely first: itself; without wrapper prefixes (peft's ``base_model.model.``, a compiled
    model's ``_orig_mod.``, DDP's ``module.``) and peft's ``.base_layer``; with and without
    the model's ``base_model_prefix`` (transformers: a head model loaded from a base
    model's folder). A candidate is used only when its bytes are equal."""
    names = [name]
    plain = name
    changed = True
    while changed:
        changed = False
        for prefix in _WRAPPER_PREFIXES:
            if plain.startswith(prefix):
                plain, changed = plain[len(prefix):], True
        for infix in (".base_layer.", "._orig_mod."):
            if infix in plain:
                plain, changed = plain.replace(infix, "."), True
    names.append(plain)
    prefix = _base_model_prefix(model)
    if prefix:
        names += [plain[len(prefix) + 1:]] if plain.startswith(prefix + ".") else [f"{prefix}.{plain}"]
    return list(dict.fromkeys(names))


def _base_model_prefix(model: torch.nn.Module | None) -> str | None:
    for inner in (model, getattr(model, "base_model", None), getattr(getattr(model, "base_model", None), "model", None)):
        prefix = getattr(inner, "base_model_prefix", None)
        if isinstance(prefix, str) and prefix:
            return prefix
    return None


def reference_frozen(
    key: str, weights: Mapping[str, torch.Tensor], model: torch.nn.Module | None, source: Source
) -> tuple[Reference | None, dict[str, torch.Tensor]]:
    """Split model ``key``'s state dict into the frozen tensors ``source`` holds byte for
    byte (the reference) and the rest (to write).

    Args:
        key: the model's stable key (named in logs).
        weights: its state dict, tensors only.
        model: the unwrapped model (which parameters are frozen), or None.
        source: the pretrained folder.

    Returns:
        ``(reference, rest)``: the :class:`Reference` (None when no tensor is referenced:
        then ``rest`` is ``weights``) and the tensors still to write, in state-dict order.

    Raises:
        CorruptCheckpointError: a file of the folder has a malformed header.
        StorageError: reading the folder failed.
        A missing folder is not an error here: nothing is referenced (logged; a warning
        when the folder was declared with :func:`reference_pretrained`).
    """
    frozen = frozen_names(weights, model, all_frozen=True)
    if not frozen:
        return None, dict(weights)
    try:
        folder, checksums = folder_for(source)
    except MissingBaseError as exc:
        if source.declared:
            warn_user(f"model {key!r}: not referencing its frozen tensors: {exc}; they are written", StatekitWarning)
        else:
            logger.warning("model %r: not referencing its frozen tensors: %s; they are written", key, exc)
        return None, dict(weights)
    referenced: dict[str, SourceTensor] = {}
    by_view: dict[Any, SourceTensor] = {}
    for name in weights:
        if name not in frozen:
            continue
        t = weights[name]
        tied = by_view.get(view_identity(t))
        if tied is not None:  # a tied name (lm_head = wte): the same source tensor
            referenced[name] = tied
            continue
        found = _matching(name, t, model, folder, checksums)
        if found is not None:
            referenced[name] = by_view[view_identity(t)] = found
    if not referenced:
        if source.declared:
            warn_user(f"model {key!r}: none of its {len(frozen)} frozen tensors equals a tensor of {source.url} "
                      "(reference_pretrained): they are written; is it the folder the model was loaded from?",
                      StatekitWarning)
        return None, dict(weights)
    used = {s.file for s in referenced.values()}
    files = {n: f for n, f in folder.files.items() if n in used}
    reference = Reference(source=source.url, base_id=base_id(files), files=files, tensors=referenced)
    nbytes = sum(weights[n].numel() * weights[n].element_size() for n in referenced)
    logger.info("model %r: %d frozen tensors (%.1f MB) referenced in %s, not written", key, len(referenced), nbytes / 1e6,
                source.url)
    return reference, {n: t for n, t in weights.items() if n not in referenced}


def _matching(name: str, t: torch.Tensor, model: torch.nn.Module | None, folder: SourceFolder,
              checksums: dict[str, str]) -> SourceTensor | None:
    """The source tensor equal to ``t`` byte for byte among ``name``'s candidates, or None."""
    mine: str | None = None
    for candidate in candidate_names(name, model):
        where = folder.tensors.get(candidate)
        if where is None or where.entry.dtype != t.dtype or tuple(where.entry.shape) != tuple(t.shape):
            continue
        if candidate not in checksums:
            checksums[candidate] = folder.checksum(candidate)
        mine = mine or live_checksum(t)
        if checksums[candidate] == mine:
            return SourceTensor(file=where.file, name=candidate, checksum=mine)
    return None


# ---------------------------------------------------------------------- load side


class ResolvedReference:
    """A checkpoint's reference of one model, its folder found and its files' headers checked
    (the recorded folder, else the one the loading model names, else a copy carried beside
    the checkpoints: :data:`BASES_DIR`).

    Args:
        reference: the manifest's :class:`Reference`.
        checkpoint: the checkpoint's storage (where a carried copy is looked for: its parent).
        key: the model's key, named in errors.
        storage_options: fsspec options for a remote folder (the checkpoint's, when on the
            same filesystem).
        also: the folder the loading model declares or learned (:func:`source_of`), tried
            after the recorded one: a base that moved loads from where the model now comes
            from (every file and tensor is checked the same way).

    Raises:
        MissingBaseError: neither the folder nor a carried copy exists (names the folder).
        ChangedBaseError: a file's size or header differs from the record (names the file).
    """

    def __init__(self, reference: Reference, checkpoint: Storage, key: str,
                 storage_options: dict[str, Any] | None = None, also: Source | None = None) -> None:
        self.reference = reference
        self.key = key
        problems: list[BaseException] = []
        for storage in self._places(reference, checkpoint, storage_options, also):
            try:
                # a folder other than the recorded one is taken only when every referenced
                # tensor's bytes match (else a load would overwrite part of the model first)
                self.folder = self._checked(storage, tensors=storage.url.rstrip("/") != reference.source.rstrip("/"))
                self.url = storage.url
                return
            except (MissingBaseError, ChangedBaseError) as exc:
                problems.append(exc)
        first = problems[0] if problems else MissingBaseError(f"pretrained folder {reference.source} is not reachable")
        raise type(first)(
            f"model {key!r} of {checkpoint.url} references frozen tensors in {reference.source}: {first}"
            + (f"; no carried copy at {carried_url(checkpoint, reference)} either" if len(problems) < 2 else
               f"; also tried: {'; '.join(str(p) for p in problems[1:])}")
            + " (restore the folder; if it moved, load into a model from_pretrained of its new place or name it with "
              "statekit.reference_pretrained(model, folder); or load a copy made self-contained with "
              "`statekit convert CKPT OUT --to statekit --materialize`)",
            getattr(first, "url", reference.source),
        ) from None

    @staticmethod
    def _places(reference: Reference, checkpoint: Storage, storage_options: dict[str, Any] | None,
                also: Source | None) -> list[Storage]:
        """Where to look, in order: the recorded folder, the folder the loading model names
        (``from_pretrained``'s or :func:`reference_pretrained`'s: a moved base), a carried copy."""
        places = []
        try:
            source = Storage(reference.source, storage_options if _same_protocol(reference.source, checkpoint) else None)
            places.append(source)
        except StorageError:
            pass
        if also is not None and also.url.rstrip("/") != reference.source.rstrip("/"):
            try:
                places.append(Storage(also.url, also.storage_options))
            except StorageError:
                pass
        carried = Storage(carried_url(checkpoint, reference), fs=checkpoint.fs)
        if carried.exists():
            places.append(carried)
        return places

    def _checked(self, storage: Storage, tensors: bool = False) -> SourceFolder:
        """The folder at ``storage`` when its files' sizes and headers (and with ``tensors``,
        every referenced tensor's bytes) are as recorded."""
        ref = self.reference
        for name, recorded in ref.files.items():
            url = storage.url_of(name)
            try:
                size = storage.size(name)
            except (FileNotFoundError, StorageError):
                raise MissingBaseError(f"{url} does not exist", url) from None
            if size != recorded.size_bytes:
                raise ChangedBaseError(f"{url} is {size} bytes, {recorded.size_bytes} when the checkpoint was saved", url)
        folder = SourceFolder(storage, only=ref.files)
        for name, recorded in ref.files.items():
            if folder.files[name].header_checksum != recorded.header_checksum:
                raise ChangedBaseError(f"{storage.url_of(name)}: its header (tensor names, dtypes, shapes or offsets) "
                                       "changed since the checkpoint was saved", storage.url_of(name))
        if tensors:
            for name, src in ref.tensors.items():
                if folder.checksum(src.name) != src.checksum:
                    raise ChangedBaseError(f"{storage.url_of(src.file)}: tensor {src.name!r} differs from the "
                                           "checkpoint's record", storage.url_of(src.file))
        return folder

    def shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The referenced tensors' shapes and dtypes, by the model's state-dict name."""
        out = {}
        for name, src in self.reference.tensors.items():
            where = self.folder.tensors.get(src.name)
            if where is None or where.file != src.file:
                raise ChangedBaseError(f"{self.folder.storage.url_of(src.file)} has no tensor {src.name!r}", self.url)
            out[name] = (tuple(where.entry.shape), where.entry.dtype)
        return out

    def load(self, into: Mapping[str, torch.Tensor] | None = None, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """Read every referenced tensor, into ``into``'s tensors (by state-dict name) where
        given, else into fresh CPU tensors; each is checked against its checksum after it is
        read. ``names``: only these state-dict names (all when None).

        Returns:
            State-dict name -> tensor (the ``into`` target where one was given).

        Raises:
            ChangedBaseError: a tensor's bytes differ from the record (names the file and
                tensor; an ``into`` target is then overwritten with them: the message says so).
        """
        from statekit.engine.file_reader import FileReader

        reader = FileReader(self.folder.storage, None, verify=False)
        out: dict[str, torch.Tensor] = {}
        by_file: dict[str, dict[str, list[str]]] = {}
        wanted = set(self.reference.tensors) if names is None else set(names)
        for name, src in self.reference.tensors.items():
            if name in wanted:
                by_file.setdefault(src.file, {}).setdefault(src.name, []).append(name)
        for file, names in by_file.items():
            targets = {src: into[own[0]] for src, own in names.items() if into is not None and own[0] in into}
            read = reader.load_tensors(file, into=targets or None, names=list(names))
            for src, own in names.items():
                first = read[src]
                for name in own:
                    target = into.get(name) if into is not None else None
                    if target is not None and target is not first and view_identity(target) != view_identity(first):
                        with torch.no_grad():
                            target.copy_(first)
                    out[name] = target if target is not None else first
        for name in out:
            self.check(name, out[name], overwritten=into is not None)
        return out

    def check(self, name: str, tensor: torch.Tensor, overwritten: bool = False) -> None:
        """Compare a referenced tensor as read (state-dict ``name``) with its recorded checksum.

        Raises:
            ChangedBaseError: its bytes differ (names the file and tensor; ``overwritten``:
                the message says the model holds them now).
        """
        src = self.reference.tensors[name]
        if live_checksum(tensor) != src.checksum:
            url = self.folder.storage.url_of(src.file)
            raise ChangedBaseError(
                f"{url}: tensor {src.name!r} (state-dict name {name!r} of model {self.key!r}) differs from the checkpoint's record"
                + (" (the model is partly overwritten: load a good checkpoint into it before use)" if overwritten else ""),
                url)

    def verify(self) -> None:
        """Check every referenced tensor's bytes in the folder against its checksum, reading
        each once (``statekit verify``); nothing is loaded.

        Raises:
            ChangedBaseError: the first tensor whose bytes differ (names it).
        """
        for name, src in self.reference.tensors.items():
            if self.folder.checksum(src.name) != src.checksum:
                url = self.folder.storage.url_of(src.file)
                raise ChangedBaseError(f"{url}: tensor {src.name!r} (state-dict name {name!r} of model {self.key!r}) differs from the "
                                       "checkpoint's record", url)


def carried_url(checkpoint: Storage, reference: Reference) -> str:
    """Where a copy of ``reference``'s folder carried beside ``checkpoint`` is:
    ``<the checkpoint's parent>/.statekit-bases/<base_id>`` (a replica tier, a materialized root)."""
    parent = checkpoint.url.rstrip("/").rsplit("/", 1)[0]
    return f"{parent}/{BASES_DIR}/{reference.base_id}"


@dataclasses.dataclass(frozen=True)
class CarriedCopy:
    """What :func:`carry_references` did for one referenced folder.

    Attributes:
        base_id: the folder's :attr:`Reference.base_id`.
        url: the carried copy (``<root>/.statekit-bases/<base_id>``).
        copied_files: files copied now (0: every file was there already, verified).
        copied_bytes: bytes copied now.
    """

    base_id: str
    url: str
    copied_files: int
    copied_bytes: int


def carry_references(references: Mapping[str, Reference] | None, source: Storage, destination: Storage) -> list[CarriedCopy]:
    """Carry a copy of every folder a checkpoint references beside its copy at another root,
    once per ``base_id``: ``<destination's parent>/.statekit-bases/<base_id>/`` (where
    :class:`ResolvedReference` looks when the recorded folder is gone), so that the copy at
    ``destination`` loads without the original folder. Call it before the destination's
    manifest is committed.

    A file already there with the recorded size and header checksum is not copied again.
    The others are read from the folder the source checkpoint resolves (the recorded one,
    else the source root's own carried copy), streamed, and checked at the destination
    against the recorded size and header checksum (each tensor's checksum is checked when
    it is loaded); then :data:`CARRIED_RECORD` is written. The copy holds statekit's lock
    while it fills, so ``statekit gc`` of the destination root keeps it.

    Args:
        references: the manifest's ``references`` (None or empty: nothing to do).
        source: the checkpoint copied (its references resolve from here).
        destination: its copy's directory (the carried copy goes beside it).

    Returns:
        One :class:`CarriedCopy` per ``base_id``, in ``base_id`` order.

    Raises:
        MissingBaseError: neither the recorded folder nor a copy carried beside ``source``
            exists.
        ChangedBaseError: the folder's files differ from the record.
        CorruptCheckpointError: a copied file differs from the record at the destination.
        StorageError: reading or writing failed.
    """
    by_base: dict[str, tuple[str, Reference]] = {}
    for key, ref in sorted((references or {}).items()):
        by_base.setdefault(ref.base_id, (key, ref))
    out = []
    for base, (key, ref) in sorted(by_base.items()):
        carried = Storage(carried_url(destination, ref), fs=destination.fs)
        carried.invalidate()
        todo = [name for name, recorded in sorted(ref.files.items()) if not _holds(carried, name, recorded)]
        if not todo:
            out.append(CarriedCopy(base, carried.url, 0, 0))
            continue
        folder = ResolvedReference(ref, source, key, source.storage_options).folder  # checks sizes and headers
        mark_copy_in_progress(carried)  # statekit gc keeps a copy being filled
        copied = 0
        for name in todo:
            copied += _carry_file(folder.storage, carried, name)
            if not _holds(carried, name, ref.files[name]):
                raise CorruptCheckpointError(
                    f"{carried.url_of(name)}: differs from {folder.storage.url_of(name)} after the copy (size or header)",
                    path=carried.url_of(name))
        record = {"base_id": base, "source": ref.source,
                  "files": {n: dataclasses.asdict(f) for n, f in sorted(ref.files.items())}}
        carried.write_bytes(CARRIED_RECORD, json.dumps(record, indent=1).encode("utf-8"))
        end_copy_in_progress(carried)
        logger.info("carried %d file(s) (%.1f MB) of %s to %s", len(todo), copied / 1e6, folder.url, carried.url)
        out.append(CarriedCopy(base, carried.url, len(todo), copied))
    return out


def _holds(carried: Storage, name: str, recorded: SourceFile) -> bool:
    """Whether the carried copy holds file ``name`` with its recorded size and header checksum."""
    try:
        if carried.size(name) != recorded.size_bytes:
            return False
        return SourceFolder(carried, only=[name]).files[name].header_checksum == recorded.header_checksum
    except (FileNotFoundError, CorruptCheckpointError, MissingBaseError, StorageError):
        return False


def _carry_file(source: Storage, carried: Storage, name: str) -> int:
    """Stream one file of a referenced folder into its carried copy; returns the bytes copied."""
    size = 0
    with source.open_read(name, bulk=True) as f, carried.open_write(name) as out:
        while chunk := f.read(_COPY_CHUNK):
            out.write(chunk)
            size += len(chunk)
    return size


def _same_protocol(url: str, storage: Storage) -> bool:
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    return protocol == storage.protocol or (protocol == "file" and storage.is_local)


def resolve_all(references: Mapping[str, Reference] | None, checkpoint: Storage,
                keys: Iterable[str] | None = None) -> dict[str, ResolvedReference]:
    """:class:`ResolvedReference` of every model of ``keys`` (all when None) the checkpoint
    references (raises as it does)."""
    if not references:
        return {}
    wanted = set(references) if keys is None else set(keys) & set(references)
    return {key: ResolvedReference(references[key], checkpoint, key, checkpoint.storage_options) for key in sorted(wanted)}


__all__ = ["BASES_DIR", "CARRIED_RECORD", "CarriedCopy", "ResolvedReference", "candidate_names", "carried_url",
           "carry_references", "reference_frozen", "resolve_all"]
