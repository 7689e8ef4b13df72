"""The copies of referenced pretrained folders carried under a checkpoint root
(``<root>/.statekit-bases/<base_id>/``, written by a replica tier:
:func:`statekit.engine.references.carry_references`), and which of them ``statekit gc`` may
remove.

Retention never deletes a carried copy: it deletes ``checkpoint-<step>`` folders only, so a
copy stays while any checkpoint references it and after. ``statekit gc`` removes one only
when statekit wrote it (its :data:`~statekit.engine.references.CARRIED_RECORD`, or
statekit's lock left by an interrupted carry or deletion), no committed checkpoint of the
root references its ``base_id``, nothing under the root is being saved or copied (a copy
not committed yet may reference it), and it is not being carried itself. The pretrained
folder a checkpoint records is never touched.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from statekit.engine.locking import LOCK_NAME, live_save_lock
from statekit.engine.references import BASES_DIR, CARRIED_RECORD
from statekit.errors import StatekitError
from statekit.format.manifest import read_manifest
from statekit.manager.listing import CheckpointDir
from statekit.storage import Storage


@dataclasses.dataclass(frozen=True)
class CarriedBase:
    """One folder under a root's :data:`~statekit.engine.references.BASES_DIR` and gc's verdict.

    Attributes:
        url: the folder (``<root>/.statekit-bases/<base_id>``).
        base_id: its name: the :attr:`~statekit.format.Reference.base_id` it holds.
        removable: True when ``statekit gc`` may remove it (see the module).
        reason: why it is kept (empty when removable).
    """

    url: str
    base_id: str
    removable: bool
    reason: str = ""


def carried_bases(root: Storage, checkpoints: Iterable[CheckpointDir]) -> list[CarriedBase]:
    """The carried copies under ``root``, each with whether ``statekit gc`` may remove it.

    Args:
        root: the checkpoint root.
        checkpoints: its checkpoints (:func:`statekit.manager.listing.list_checkpoints`,
            ``details`` not needed): the committed ones' manifests are read for their
            ``references``.

    Returns:
        One :class:`CarriedBase` per folder under ``.statekit-bases``, by ``base_id``.

    Raises:
        StorageError: the root cannot be listed.
    """
    bases = root.child(BASES_DIR)
    bases.invalidate()
    names = bases.listdir()
    if not names:
        return []
    referenced: dict[str, str] = {}  # base_id -> a committed checkpoint referencing it
    unknown = ""  # why no unreferenced copy may go: a manifest unread, a save or copy in progress
    for info in checkpoints:
        if info.committed and info.kind == "statekit":
            try:
                manifest = read_manifest(Storage(info.url, fs=root.fs))
            except StatekitError as exc:
                unknown = unknown or f"the manifest of {info.url} cannot be read, its references are unknown ({exc})"
                continue
            for ref in (manifest.references or {}).values():
                referenced.setdefault(ref.base_id, info.url)
        elif info.kind == "incomplete" and live_save_lock(Storage(info.url, fs=root.fs)) is not None:
            unknown = unknown or f"{info.url} is being saved or copied and may reference it"
    out = []
    for name in names:
        folder = bases.child(name)
        holder = live_save_lock(folder)
        if name in referenced:
            out.append(CarriedBase(folder.url, name, False, f"referenced by {referenced[name]}"))
        elif not (folder.exists(CARRIED_RECORD) or folder.exists(LOCK_NAME)):
            out.append(CarriedBase(folder.url, name, False, "not written by statekit"))
        elif holder is not None:
            out.append(CarriedBase(folder.url, name, False,
                                   f"being carried by {holder.get('host')} pid {holder.get('pid')}"))
        elif unknown:
            out.append(CarriedBase(folder.url, name, False, unknown))
        else:
            out.append(CarriedBase(folder.url, name, True))
    return out


__all__ = ["CarriedBase", "carried_bases"]
